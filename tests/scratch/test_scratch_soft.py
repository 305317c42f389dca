import base64
from tests.server.test_gemma3_image_requests import SeenEngineThread, PICTURES, url, image_runs, MM_TOKENS
from tests.helpers.server import make_llm, post_json, running_server
from tests.helpers.vision_models import write_tiny_gemma3_vision, IMAGE_ID


def test_soft(tmp_path):
    folder = write_tiny_gemma3_vision(tmp_path / "g", seed=7, mm_tokens_per_image=MM_TOKENS)
    with running_server(make_llm(folder, num_kv_blocks=128), engine_thread_type=SeenEngineThread,
                        model_alias="served", default_max_output_tokens=2) as server:
        seen = SeenEngineThread.latest
        for text in ["<image_soft_token>" * 4, "<image_soft_token>" * 8 + "<start_of_image>"]:
            status, body = post_json(server.port, "/v1/chat/completions", {"model": "served", "max_tokens": 1,
                "messages": [{"role": "user", "content": [{"type": "text", "text": text},
                                                          {"type": "image_url", "image_url": {"url": url(0)}}]}]})
            print("STATUS", status, body)
            ids, mm = seen.seen[-1]
            print("IDS", ids, [(s.offset, s.length) for s in mm.spans], image_runs(ids))
        for system in ([{"type": "image_url", "image_url": {"url": url(0)}}, {"type": "text", "text": "hi"}],
                       [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": url(1)}}]):
            status, body = post_json(server.port, "/v1/chat/completions", {"model": "served", "max_tokens": 1,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": "x"}]})
            print("SYSTEM", status, body)
        status, body = post_json(server.port, "/v1/chat/completions", {"model": "served", "max_tokens": 1,
            "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": url(1)}}]}, {"role": "user", "content": "x"}]})
        print("ASSISTANT", status, body)
        status, body = post_json(server.port, "/v1/messages", {"model": "served", "max_tokens": 1,
            "system": [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(PICTURES[0]).decode()}}],
            "messages": [{"role": "user", "content": "x"}]})
        print("ANTHROPIC SYSTEM", status, body)
