"""A reasoning model's thinking over Ollama's chat and generate and Anthropic's messages (the tiny chat model
given a template that opens `<think>` in the prompt and can switch it off, as Qwen3's does): thinking on,
the answer's reasoning comes as `message.thinking` / `thinking` and as a `thinking` block (streamed as
`thinking_delta`), equal to chat completions' `reasoning_content` for the same conversation; thinking off,
it is all answer text. /api/show lists the `thinking` capability."""

from __future__ import annotations

import anthropic
import ollama
import pytest

from tests.helpers.server import make_llm, running_server
from tests.helpers.server import post_ok as post

THINKING_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% else %}<think>\n"
    "{% endif %}{% endif %}")
MESSAGES = [{"role": "user", "content": "hello world tell me a story"}]


@pytest.fixture(scope="module")
def server(tiny_chat_model_dir):
    llm = make_llm(tiny_chat_model_dir, max_model_len=512)
    llm.tokenizer.chat_template = THINKING_TEMPLATE  # as --chat-template-file sets it
    with running_server(llm, model_alias="thinker") as server:
        yield server


def test_thinking_comes_apart_from_the_answer_on_every_api(server):
    reference = post(server.port, "/v1/chat/completions", {"messages": MESSAGES, "temperature": 0,
                                                           "max_tokens": 8})["choices"][0]["message"]
    assert reference["reasoning_content"]  # the random model never closes its block: all of it is reasoning
    client = ollama.Client(host=f"http://127.0.0.1:{server.port}", timeout=60)
    assert client.show("thinker").capabilities == ["completion", "tools", "thinking"]
    options = {"temperature": 0, "num_predict": 8}
    chat = client.chat(model="thinker", messages=MESSAGES, think=True, options=options)
    assert chat.message.thinking == reference["reasoning_content"] and chat.message.content == reference["content"]
    streamed = list(client.chat(model="thinker", messages=MESSAGES, think=True, options=options, stream=True))
    assert "".join(part.message.thinking or "" for part in streamed) == chat.message.thinking
    generated = client.generate(model="thinker", prompt=MESSAGES[0]["content"], think=True, options=options)
    assert generated.thinking == chat.message.thinking and generated.response == chat.message.content
    with anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.port}", api_key="unused", max_retries=0) as sdk:
        message = sdk.messages.create(model="thinker", max_tokens=8, messages=MESSAGES, extra_body={"temperature": 0},
                                      thinking={"type": "enabled", "budget_tokens": 1024})
        assert message.content[0].type == "thinking" and message.content[0].thinking == chat.message.thinking
        with sdk.messages.stream(model="thinker", max_tokens=8, messages=MESSAGES, extra_body={"temperature": 0},
                                 thinking={"type": "enabled", "budget_tokens": 1024}) as stream:
            deltas = [event.delta.thinking for event in stream
                      if event.type == "content_block_delta" and event.delta.type == "thinking_delta"]
            final = stream.get_final_message()
        assert "".join(deltas) == final.content[0].thinking == message.content[0].thinking
        stop = message.content[0].thinking.split()[2]  # a word the model says while it thinks
        stopped = sdk.messages.create(model="thinker", max_tokens=8, messages=MESSAGES, stop_sequences=[stop],
                                      extra_body={"temperature": 0}, thinking={"type": "enabled", "budget_tokens": 99})
        assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", stop)
        off = sdk.messages.create(model="thinker", max_tokens=8, messages=MESSAGES, extra_body={"temperature": 0},
                                  thinking={"type": "disabled"})
    unthinking = client.chat(model="thinker", messages=MESSAGES, think=False, options=options)
    assert unthinking.message.thinking is None and unthinking.message.content
    assert [block.type for block in off.content] == ["text"] and off.content[0].text == unthinking.message.content
