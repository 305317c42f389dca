"""A loaded model as its requests see it (`ServedModel`), and what the server uses of its tokenizer."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from localserve.loading.model_card import ModelCard
from localserve.loading.sampling_defaults import SamplingDefaults
from localserve.server.request.validation import ProtocolError
from localserve.tokenizer.chat_format import ChatFormat, detect_chat_format
from localserve.tokenizer.errors import TokenizerError

if TYPE_CHECKING:
    from localserve.server.request.generation_request import GenerationRequest

log = logging.getLogger(__name__)


class ChatTokenizer(Protocol):
    """What the server uses of a model's tokenizer (localserve.tokenizer.tokenizer.Tokenizer)."""

    def encode(self, text: str) -> list[int]: ...

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    tools: Sequence[Mapping[str, Any]] | None = None, **variables: Any) -> list[int]:
        """(`expand=`, a function of the rendered text, is passed only with images: a test's tokenizer may lack it.)"""

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            tools: Sequence[Mapping[str, Any]] | None = None, **variables: Any) -> str: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(frozen=True)
class ServedModel:
    """A loaded model as its requests see it: the name it is served under, its context, its sampling defaults,
    its chat format (how it calls tools and reasons; None: its tokenizer has no chat template), its files
    (`card`, for Ollama's and llama.cpp's model endpoints) and whether it is an embedding model."""

    served_name: str  # its id in /v1/models (--alias for the default model)
    max_model_len: int
    sampling_defaults: SamplingDefaults  # what a request leaves out (the model's generation_config.json, ...)
    is_embedding: bool = False  # an embedding model (EngineFacts.embedding): /v1/embeddings, no text generation
    takes_images: bool = False  # it sees images: its vision encoder is loaded (ModelLease.vision)
    chat_format: ChatFormat | None = None
    card: ModelCard = ModelCard()

    def check_generates(self) -> None:
        """Refuse text generation from an embedding model (400 naming `model`)."""
        if self.is_embedding:
            raise ProtocolError("model_not_generative", f"model {self.served_name!r} is an embedding model: it "
                                "computes embeddings (POST /v1/embeddings, /api/embed), not text", "model")

    def check_images(self, request: GenerationRequest) -> None:
        """Refuse a request with images to a model that takes none (400 naming the first image part)."""
        if request.images and not self.takes_images:
            where = request.images[0].image.where
            raise ProtocolError("model_takes_no_images", f"'{where}': model {self.served_name!r} does not take "
                                "images (it reads text only); send text, or name a vision model", where)

    @property
    def capabilities(self) -> list[str]:
        """What the model does, in Ollama's words (`/api/show`): "embedding" for an embedding model; else
        "completion", "tools" where it has a chat format (every format can be offered tools:
        tokenizer/chat_format.py), "thinking" where that format reasons and "vision" where it takes images."""
        if self.is_embedding:
            return ["embedding"]
        found = ["completion"]
        if self.chat_format is not None:
            found.append("tools")
            if self.chat_format.reasoning is not None:
                found.append("thinking")
        if self.takes_images:
            found.append("vision")
        return found

    def chat_fields(self) -> dict[str, Any]:
        """`/v1/models`' fields of the chat format: the tool-call format's name and the reasoning format."""
        chat_format = self.chat_format
        reasoning = chat_format.reasoning if chat_format is not None else None
        return {"tool_call_format": chat_format.tool_format.name if chat_format is not None else None,
                "reasoning": None if reasoning is None else {"format": reasoning.name,
                                                             "can_disable": reasoning.can_disable}}


def model_chat_format(tokenizer: Any) -> ChatFormat | None:
    """The served model's chat format, or None when its tokenizer has no chat template (no tools then)."""
    try:
        return detect_chat_format(tokenizer)
    except (TokenizerError, AttributeError, TypeError) as exc:  # no template, or a tokenizer without one at all
        log.info("no chat format: %s", exc)
        return None
