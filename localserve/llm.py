"""The offline API: `LLM(model).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import gc
import json
import logging
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from localserve.engine.builder import build_engine
from localserve.engine.config import EngineConfig
from localserve.engine.embedding_params import EmbeddingParams
from localserve.engine.image_hash import pixel_hash
from localserve.engine.image_prompt import ImagePrompt
from localserve.engine.multimodal import MultiModalInputs
from localserve.engine.outputs import RequestOutput
from localserve.engine.sampling_params import SamplingParams
from localserve.loading.hf import default_dtype, load_model, resolve_model_path
from localserve.loading.image_encoders import load_image_encoder
from localserve.loading.mmproj import open_mmproj_for
from localserve.loading.mmproj_encoders import mmproj_encoder_for
from localserve.models.vision.adapter import ImageEncoder
from localserve.tokenizer.tokenizer import Tokenizer

log = logging.getLogger(__name__)

Prompt = str | list[int]

YOUNG_COLLECTION_THRESHOLD = 50_000  # new container objects between two young collections (Python's is 700)


def settle_garbage_collector() -> None:
    """Once the model is loaded: collect, then freeze what is alive (weights, modules, the engine's own
    books: they live as long as the process, and no collection walks them again), and let a young
    collection wait for 50,000 new objects instead of 700. A decode step makes a few objects per
    sequence (its chunk, its output) that die by the next step: at 700 several collections a step walk
    them and promote the survivors, which later collections walk again; at 50,000 one collection every
    tens of steps meets one step's worth, and full collections become rare (gc.callbacks in
    scripts/bench_step_overhead.py counts them)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_COLLECTION_THRESHOLD, *gc.get_threshold()[1:])


def check_same_tokenizer(model: Tokenizer, draft: Tokenizer) -> None:
    """Raise ValueError, naming both, unless the draft model's tokenizer maps every token to the same id
    as the model's (a draft proposes token ids that the model verifies)."""
    model_vocab, draft_vocab = model.backend.get_vocab(with_added_tokens=True), draft.backend.get_vocab(
        with_added_tokens=True)
    if model_vocab != draft_vocab:
        differing = sorted(set(model_vocab.items()) ^ set(draft_vocab.items()), key=lambda item: item[1])[:3]
        raise ValueError(f"the draft model {draft.source} does not share the tokenizer of {model.source}: "
                         f"{len(draft_vocab)} tokens against {len(model_vocab)}, differing in "
                         f"{', '.join(f'{token!r}={index}' for token, index in differing)}")


class LLM:
    """A model and its engine in this process.

    `model` is a Hugging Face folder, a hub repo id, a .gguf file, or None for the default model
    (SmolLM2-135M-Instruct). `keep_quantized_weights`: keep a .gguf's quantized weights in their blocks
    (None: on CUDA yes, on a CPU no; see loading/hf.py). `draft_model` (the same kinds of source): the
    draft model of speculative decoding (`EngineConfig.spec_type` "draft"), which must share the model's
    tokenizer. `mmproj`: llama.cpp's mmproj file of a .gguf model (its vision tower and projector,
    loading/mmproj.py), whose encoder becomes `vision`.
    """

    def __init__(self, model: str | None = None, *, dtype: torch.dtype | None = None, device: str | None = None,
                 offline: bool = False, engine_config: EngineConfig | None = None,
                 keep_quantized_weights: bool | None = None, draft_model: str | None = None,
                 mmproj: str | Path | None = None) -> None:
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        path = resolve_model_path(model, offline=offline)
        mmproj_file = open_mmproj_for(mmproj, path) if mmproj is not None else None  # refused before the load
        # The vision encoder (None: a text model, a .gguf, a checkpoint saved without its vision weights)
        self.vision: ImageEncoder | None = load_vision(path, dtype or default_dtype(device), device)
        loaded = load_model(path, dtype=dtype, device=device, keep_quantized_weights=keep_quantized_weights,
                            loaded_apart=VISION_PARTS if self.vision is not None else ())
        self.model_path = path  # the local folder or .gguf file the model came from
        self.model_config = loaded.config
        self.tokenizer = read_tokenizer(path, loaded.gguf_reader)
        if mmproj_file is not None:  # a .gguf's vision encoder, from its mmproj
            self.vision = mmproj_encoder_for(mmproj_file, loaded, self.tokenizer, dtype or default_dtype(device),
                                             device)
        draft = None
        if draft_model is not None:
            draft_path = resolve_model_path(draft_model, offline=offline)
            draft_loaded = load_model(draft_path, dtype=dtype, device=device,
                                      keep_quantized_weights=keep_quantized_weights)
            check_same_tokenizer(self.tokenizer, read_tokenizer(draft_path, draft_loaded.gguf_reader))
            draft = draft_loaded.model
        self.engine = build_engine(loaded.model, self.tokenizer, engine_config, draft_model=draft)
        settle_garbage_collector()

    def generate(self, prompts: Prompt | Seq[Prompt], params: SamplingParams | None = None) -> list[RequestOutput]:
        """Generate for each prompt (text, or token ids); returns one output per prompt, in order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        token_lists = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        return self._run(token_lists, params or SamplingParams())

    def chat(self, conversations: list[dict[str, Any]] | list[list[dict[str, Any]]],
             params: SamplingParams | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation (a list of role/content messages). A message's
        content may be a list of parts in transformers' form: `{"type": "text", "text": ...}` and, for a model
        whose vision encoder is loaded (`vision`), `{"type": "image", "image": a PIL image}`."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]  # type: ignore[list-item]
        prompts = [self._chat_prompt(messages) for messages in conversations]
        return self._run([tokens for tokens, _ in prompts], params or SamplingParams(),
                         [multimodal for _, multimodal in prompts])

    def _chat_prompt(self, messages: list[dict[str, Any]]) -> tuple[list[int], MultiModalInputs | None]:
        """A conversation's prompt ids, and its images for the engine (None: it has none)."""
        pictures = [part.get("image") for message in messages if isinstance(message.get("content"), list)
                    for part in message["content"] if part.get("type") == "image"]
        if not pictures:
            return self.tokenizer.encode_chat(messages), None
        if self.vision is None:
            raise ValueError(f"{self.model_path.name} does not take images: it has no vision encoder loaded")
        for index, picture in enumerate(pictures):
            if not isinstance(picture, Image.Image):
                raise TypeError(f"chat: image {index}'s 'image' must be a PIL.Image.Image, got "
                                f"{type(picture).__name__}")
        parts = [{**message, "content": [{"type": "image"} if part.get("type") == "image" else part
                                         for part in message["content"]]}
                 if isinstance(message.get("content"), list) else message for message in messages]
        prompt = ImagePrompt(self.vision, tuple(pixel_hash(picture) for picture in pictures),
                             tuple(self.vision.prepare(picture) for picture in pictures))
        tokens = self.tokenizer.encode_chat(parts, expand=prompt.expand)
        return tokens, prompt.multimodal(tokens)

    def embed(self, inputs: Prompt | Seq[Prompt], params: EmbeddingParams | None = None) -> list[RequestOutput]:
        """Embed each input (text, or token ids) with an embedding model's pooling (models/pooling.py); returns
        one output per input, in order, its vector in `embedding`. Raises ValueError for a generation model."""
        if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
            inputs = [inputs]  # type: ignore[list-item]
        token_lists = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in inputs]
        return self._run(token_lists, params or EmbeddingParams())

    def _run(self, token_lists: list[list[int]], params: SamplingParams | EmbeddingParams,
             multimodal: list[MultiModalInputs | None] | None = None) -> list[RequestOutput]:
        images = multimodal or [None] * len(token_lists)
        ids = [self.engine.add_request(tokens, params, multimodal=inputs)
               for tokens, inputs in zip(token_lists, images)]
        final = self.engine.run_to_completion()
        return [final[i] for i in ids]


VISION_PARTS = ("vision tower", "multimodal projector")  # models/*.py's unloaded_parts that the encoder loads


def load_vision(path: Path, dtype: torch.dtype, device: str) -> ImageEncoder | None:
    """The image encoder of the checkpoint folder `path` (loading/image_encoders.py), or None."""
    if not path.is_dir() or not (path / "config.json").is_file():
        return None
    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    encoder = load_image_encoder(path, config, dtype, device) if isinstance(config, dict) else None
    if encoder is not None:
        log.info("%s: its vision encoder is loaded (%s): the model takes images", path.name, type(encoder).__name__)
    return encoder


def read_tokenizer(path: Path, gguf_reader=None) -> Tokenizer:
    """The tokenizer of the model in `path`: from a .gguf's open reader, else from the folder's files."""
    return Tokenizer.from_gguf(gguf_reader) if gguf_reader is not None else Tokenizer.from_path(path)
