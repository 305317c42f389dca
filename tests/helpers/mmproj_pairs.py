"""A GGUF vision pair (a language model .gguf and its mmproj, `LLM(model, mmproj=)`) served beside the checkpoint
folder both were converted from: the same chat with images sent by the openai SDK to each gets the same
greedy answer."""

from __future__ import annotations

import openai

from tests.helpers.server import make_llm, running_server

NUM_TOKENS = 6


def make_pair_llm(model, mmproj):
    """What `localserve serve -m model --mmproj mmproj` loads, on the CPU with a small engine."""
    from localserve.engine.config import EngineConfig
    from localserve.llm import LLM

    config = EngineConfig(num_kv_blocks=64, max_num_seqs=16, max_num_batched_tokens=256)
    return LLM(str(model), device="cpu", engine_config=config, mmproj=mmproj)


def chat_answer(llm, messages: list[dict], **options) -> tuple[str, list[float], int]:
    """The greedy answer of `llm` served to `messages` (`options` to the SDK's create): its text, its tokens'
    log-probabilities and the prompt's token count."""
    with running_server(llm, model_alias="served") as server, openai.OpenAI(
            base_url=f"http://127.0.0.1:{server.port}/v1", api_key="-", max_retries=0) as client:
        chat = client.chat.completions.create(model="served", max_tokens=NUM_TOKENS, temperature=0, logprobs=True,
                                              messages=messages, **options)
    return (chat.choices[0].message.content, [token.logprob for token in chat.choices[0].logprobs.content],
            chat.usage.prompt_tokens)


def assert_pair_answers_as_the_folder(folder, model, mmproj, marker: str, messages: list[dict],
                                      tolerance: float = 1e-4, **options) -> int:
    """The pair's encoder writes `marker` as the folder's does and its answer to `messages` is the folder's: the
    same text and prompt tokens, log-probabilities within `tolerance`. Returns the prompt's token count."""
    folder_llm = make_llm(folder, num_kv_blocks=64)
    assert folder_llm.vision is not None and folder_llm.vision.marker == marker
    hidden_size = folder_llm.vision.hidden_size
    expected, expected_logprobs, prompt_tokens = chat_answer(folder_llm, messages, **options)
    del folder_llm
    pair_llm = make_pair_llm(model, mmproj)
    assert (pair_llm.vision.marker, pair_llm.vision.hidden_size) == (marker, hidden_size)
    text, logprobs, pair_prompt_tokens = chat_answer(pair_llm, messages, **options)
    assert (text, pair_prompt_tokens) == (expected, prompt_tokens)
    assert len(logprobs) == len(expected_logprobs) == NUM_TOKENS
    assert max(abs(a - b) for a, b in zip(logprobs, expected_logprobs)) < tolerance
    return prompt_tokens

