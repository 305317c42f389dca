"""The prefix cache with images, through the server on a tiny Gemma 3 (four tokens per image): the same picture sent
again (another client; a Responses follow-up naming `previous_response_id`, whose stored conversation keeps the
image) reports the cached tokens and answers as a server without the prefix cache does; another picture of the
same size, or the same picture with one pixel changed, hits nothing (the image's tokens are the same ids; only
the blocks' content hashes tell them apart) and answers as the server without the cache does."""

from __future__ import annotations

import openai
import pytest

from localserve.engine.config import EngineConfig
from localserve.llm import LLM
from localserve.server.request import images as images_module
from tests.helpers.pictures import picture
from tests.helpers.server import running_server
from tests.helpers.vision_models import data_url, png_file, write_tiny_gemma3_vision

BLOCK = 16
QUESTION = "what is in this picture? say it in a few words, please."
NUM_TOKENS = 4




FIRST = picture(40, 30, seed=1)
CHANGED = FIRST.copy()
CHANGED.putpixel((7, 5), tuple((value + 1) % 256 for value in FIRST.getpixel((7, 5))))
PICTURES = {"first": png_file(FIRST), "other": png_file(picture(40, 30, seed=2)), "changed": png_file(CHANGED),
            "fresh": png_file(picture(40, 30, seed=3)),  # "fresh", "resent": sent by one test each
            "resent": png_file(picture(40, 30, seed=4))}


def llm(folder, prefix_caching: bool) -> LLM:
    config = EngineConfig(num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=256, block_size=BLOCK,
                          enable_prefix_caching=prefix_caching)
    return LLM(str(folder), device="cpu", engine_config=config)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    folder = write_tiny_gemma3_vision(tmp_path_factory.mktemp("gemma3"), seed=5, mm_tokens_per_image=4)
    with_cache, without_cache = llm(folder, True), llm(folder, False)
    with running_server(with_cache, model_alias="served") as cached, \
            running_server(without_cache, model_alias="served") as uncached:
        cached.llm, uncached.llm = with_cache, without_cache
        yield cached, uncached


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="-", max_retries=0)


def ask(server, picture_name: str, question: str = QUESTION):
    """A chat completion (a new client each time): the image first, then the question."""
    with client(server) as sdk:
        return sdk.chat.completions.create(model="served", max_tokens=NUM_TOKENS, temperature=0, logprobs=True,
                                           messages=[{"role": "user", "content": [
                                               {"type": "image_url",
                                                "image_url": {"url": data_url(PICTURES[picture_name])}},
                                               {"type": "text", "text": question}]}])


def answer(completion) -> tuple[str, list[float]]:
    choice = completion.choices[0]
    return choice.message.content, [round(token.logprob, 4) for token in choice.logprobs.content]


def cached_tokens(completion) -> int:
    return completion.usage.prompt_tokens_details.cached_tokens


def test_the_same_picture_again_hits_and_answers_as_without_the_cache(servers):
    cached, uncached = servers
    question = "the same picture: " + QUESTION
    first = ask(cached, "first", question)
    assert cached_tokens(first) == 0
    again = ask(cached, "first", question)  # another client
    prompt_tokens = again.usage.prompt_tokens
    assert prompt_tokens > 2 * BLOCK  # the image (tokens 9-14) lies in the first block
    assert cached_tokens(again) == (prompt_tokens - 1) // BLOCK * BLOCK
    assert answer(again) == answer(first) == answer(ask(uncached, "first", question))


@pytest.mark.parametrize("name", ["other", "changed"])
def test_another_picture_of_the_same_size_misses(servers, name):
    cached, uncached = servers
    question = f"a {name} picture: " + QUESTION
    ask(cached, "first", question)  # its blocks are in the cache now
    missed = ask(cached, name, question)
    assert cached_tokens(missed) == 0  # the first block holds the image: a false hit would show here
    assert answer(missed) == answer(ask(uncached, name, question))


def test_a_follow_up_keeps_the_earlier_turns_picture(servers):
    """Responses' previous_response_id: the stored conversation keeps the image, so the follow-up's prompt holds
    it where it was (its blocks hit) and the answer is that of the whole conversation sent to a server without
    the cache."""
    cached, uncached = servers
    image = {"type": "input_image", "image_url": data_url(PICTURES["first"]), "detail": "auto"}
    turn = [{"role": "user", "content": [image, {"type": "input_text", "text": "a follow-up: " + QUESTION}]}]
    with client(cached) as sdk:
        first = sdk.responses.create(model="served", max_output_tokens=NUM_TOKENS, temperature=0, input=turn)
        follow_up = sdk.responses.create(model="served", max_output_tokens=NUM_TOKENS, temperature=0,
                                         previous_response_id=first.id, input="and its colours?")
    assert follow_up.usage.input_tokens_details.cached_tokens >= (first.usage.input_tokens - 1) // BLOCK * BLOCK > 0
    whole = [*turn, {"role": "assistant", "content": first.output_text},
             {"role": "user", "content": "and its colours?"}]
    with client(uncached) as sdk:
        expected = sdk.responses.create(model="served", max_output_tokens=NUM_TOKENS, temperature=0, input=whole)
    assert follow_up.usage.input_tokens == expected.usage.input_tokens
    assert follow_up.output_text == expected.output_text


def test_a_picture_is_encoded_once_while_its_embeddings_are_cached(servers):
    """Without the prefix cache every request computes the image's tokens again, from the engine's cache of
    embeddings: the encoder runs once for the picture."""
    _, uncached = servers
    encoder = uncached.server.models.serving_now().vision
    calls = []
    encode = encoder.encode
    encoder.encode = lambda prepared: calls.append(prepared) or encode(prepared)
    try:
        answers = [answer(ask(uncached, "fresh", f"turn {turn}: " + QUESTION)) for turn in range(3)]
    finally:
        del encoder.encode
    assert len(calls) == 1 and len(answers) == 3


def test_requests_with_pictures_together_answer_as_alone(servers):
    from concurrent.futures import ThreadPoolExecutor

    cached, _ = servers
    names = ["first", "other", "changed"]
    alone = {name: answer(ask(cached, name, "together: " + QUESTION)) for name in names}
    with ThreadPoolExecutor(len(names)) as pool:
        together = dict(zip(names, pool.map(lambda name: answer(ask(cached, name, "together: " + QUESTION)),
                                            names)))
    for name in names:
        assert together[name][0] == alone[name][0]
        assert max(abs(a - b) for a, b in zip(together[name][1], alone[name][1])) < 2e-3


def test_a_picture_sent_again_is_decoded_and_prepared_once_and_answers_alike(servers, monkeypatch):
    """The decoded-file and prepared-image caches (server/request/image_cache.py): the second request's picture is
    neither decoded (Pillow's opens counted) nor prepared (the encoder's calls counted) again, on the server
    without the prefix cache, and answers as the first did (decoded and prepared then)."""
    _, uncached = servers
    encoder, opens, prepares = uncached.llm.vision, [], []
    real_open, real_prepare = images_module.Image.open, encoder.prepare
    monkeypatch.setattr(images_module.Image, "open", lambda *args, **kw: opens.append(1) or real_open(*args, **kw))
    monkeypatch.setattr(encoder, "prepare", lambda picture: prepares.append(1) or real_prepare(picture))
    first = ask(uncached, "resent")
    assert (len(opens), len(prepares)) == (2, 1)  # decode_image's open, then ImageInput.picture()'s
    again = ask(uncached, "resent")
    assert (len(opens), len(prepares)) == (2, 1) and cached_tokens(again) == 0
    assert answer(again) == answer(first)
