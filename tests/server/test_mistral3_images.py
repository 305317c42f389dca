"""Images through the server to a tiny random Mistral Small 3.x (Mistral3ForConditionalGeneration with its Pixtral
tower), sent by the `openai` SDK as chat `image_url` parts: the greedy text and log-probabilities of
transformers' Mistral3ForConditionalGeneration given what PixtralProcessor makes of the same folder, pictures and
text: the real Mistral Small 3.2 chat template rendered by transformers' tokenizer, each `[IMG]` expanded to the
picture's rows (`[IMG]` x columns joined by `[IMG_BREAK]`, `[IMG_END]` last: PixtralProcessor's rule, written
out here as transformers' processor needs torchvision, which this project does not install), and
PixtralImageProcessorPil's pixel values and sizes.

The loading is honest about the parts: the encoder loads the vision tower and projector, so the text loader
says nothing of them being left unloaded."""

from __future__ import annotations

import base64
import io
import logging

import ollama
import openai
import pytest
import torch
from PIL import Image

from tests.helpers.pictures import picture
from tests.helpers.pixtral_models import MERGE, PATCH, reference_image_processor, write_tiny_mistral3
from tests.helpers.server import make_llm, running_server

NUM_TOKENS = 6
SYSTEM = "Be brief."  # the template's default system prompt would outgrow the tiny model's context


def png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


PICTURES = [png(picture(53, 37, seed=1)), png(picture(20, 44, seed=2, mode="RGBA"))]


def pixtral_text(height: int, width: int) -> str:
    """PixtralProcessor's text for a picture of height x width pixels (after its processing)."""
    rows, cols = height // (PATCH * MERGE), width // (PATCH * MERGE)
    return "[IMG_BREAK]".join(["[IMG]" * cols] * rows) + "[IMG_END]"


class Mistral3:
    def __init__(self, folder, server) -> None:
        import transformers

        self.server = server
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
        self.hf_model = transformers.Mistral3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32)
        self.hf_model.eval()

    def reference(self, question: str, pictures: list[bytes], images_first: bool = False) -> tuple[str, list[float]]:
        """transformers' greedy answer and its tokens' log-probabilities (the pictures after the question, or
        before it)."""
        images = [Image.open(io.BytesIO(data)) for data in pictures]
        content = [{"type": "text", "text": question}] + [{"type": "image"} for _ in images]
        content = content[1:] + content[:1] if images_first else content
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": content}]
        rendered = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        batch = reference_image_processor()(images=images, return_tensors="pt")
        pieces = rendered.split("[IMG]")
        assert len(pieces) == len(images) + 1
        text = pieces[0] + "".join(pixtral_text(*size) + piece
                                   for size, piece in zip(batch["image_sizes"].tolist(), pieces[1:]))
        ids = self.tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = self.hf_model.generate(ids, pixel_values=batch["pixel_values"], image_sizes=batch["image_sizes"],
                                         max_new_tokens=NUM_TOKENS, do_sample=False, output_logits=True,
                                         return_dict_in_generate=True)
        new = out.sequences[0, ids.shape[1]:]
        logprobs = [float(torch.log_softmax(logits[0].double(), -1)[token]) for logits, token in zip(out.logits, new)]
        return self.tokenizer.decode(new, skip_special_tokens=True), logprobs


@pytest.fixture(scope="module")
def mistral3(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mistral3_server")
    hf_model = write_tiny_mistral3(folder, seed=11)
    del hf_model
    llm = make_llm(folder, num_kv_blocks=64)
    assert type(llm.vision).__name__ == "Mistral3ImageEncoder"
    with running_server(llm, model_alias="served") as server:
        yield Mistral3(folder, server)


@pytest.mark.parametrize("pictures", [PICTURES[:1], PICTURES], ids=["one", "two-sizes"])
def test_openai_chat_answers_as_transformers(mistral3, pictures):
    question = "what is in this picture?"
    expected, logprobs = mistral3.reference(question, pictures)
    parts = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(data).decode()}}
             for data in pictures]
    with openai.OpenAI(base_url=f"http://127.0.0.1:{mistral3.server.port}/v1", api_key="-", max_retries=0) as client:
        chat = client.chat.completions.create(model="served", max_tokens=NUM_TOKENS, temperature=0, logprobs=True,
                                              messages=[{"role": "system", "content": SYSTEM},
                                                        {"role": "user", "content": [
                                                            {"type": "text", "text": question}, *parts]}])
    assert chat.choices[0].message.content == expected
    ours = [token.logprob for token in chat.choices[0].logprobs.content]
    assert len(ours) == len(logprobs) and max(abs(a - b) for a, b in zip(ours, logprobs)) < 1e-3, (ours, logprobs)
    assert chat.usage.prompt_tokens > 30 * len(pictures)  # the image rows are counted as prompt tokens


def test_the_vision_parts_are_loaded_not_said_left_out(tmp_path, caplog):
    write_tiny_mistral3(tmp_path, seed=2)
    with caplog.at_level(logging.INFO):
        llm = make_llm(tmp_path, num_kv_blocks=16)
    assert llm.vision is not None and llm.vision.hidden_size == 64
    assert "left unloaded" not in caplog.text and "vision encoder is loaded" in caplog.text


def test_a_picture_too_long_for_its_width_is_a_400_naming_the_part(mistral3):
    """1 x 200 pixels scaled into 48 x 48 keeps no column (transformers' processor fails on it too)."""
    thin = "data:image/png;base64," + base64.b64encode(png(picture(1, 200, seed=3))).decode()
    with openai.OpenAI(base_url=f"http://127.0.0.1:{mistral3.server.port}/v1", api_key="-", max_retries=0) as client:
        with pytest.raises(openai.BadRequestError) as error:
            client.chat.completions.create(model="served", max_tokens=2, messages=[{"role": "user", "content": [
                {"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": thin}}]}])
    message = error.value.response.json()["error"]["message"]
    assert "messages[0].content[1]" in message and "too long for its width" in message, message


def test_ollama_chat_answers_as_transformers(mistral3):
    """Ollama's `images` stand before the message's text."""
    question = "and this one?"
    expected, _ = mistral3.reference(question, PICTURES[1:], images_first=True)
    client = ollama.Client(host=f"http://127.0.0.1:{mistral3.server.port}")
    answer = client.chat(model="served", messages=[{"role": "system", "content": SYSTEM},
                                                   {"role": "user", "content": question, "images": PICTURES[1:]}],
                         options={"temperature": 0, "num_predict": NUM_TOKENS})
    # The answer's last token is half a character here: transformers' decode writes U+FFFD for it, the server's
    # detokenizer holds the incomplete bytes back (and the stream ends); the text before is the same.
    assert answer.message.content == expected.removesuffix("\ufffd")
