"""A model described from its files without loading its weights: what Ollama's `/api/show` tells of a
model that is not loaded, the same as it tells once the model is.

Clients read `/api/show` of every model they list, one after another, for its capabilities, template
and context (editor plugins, chat front-ends). Loading each model for that would evict the model in
use and take seconds to minutes a model; its config, tokenizer and template are all the answer needs.
The registry asks its `describe` function (localserve/model_loader.py's `EngineLoader.describe`) once
per model and keeps the short result: the chat format is worked out and the tokenizer dropped.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from localserve.loading.model_card import ModelCard
from localserve.loading.model_folder import ModelEntry
from localserve.loading.sampling_defaults import SamplingDefaults
from localserve.server.registry.served_model import ChatTokenizer, ServedModel, model_chat_format
from localserve.server.request.validation import ProtocolError
from localserve.tokenizer.chat_format import ChatFormat


@dataclass(frozen=True)
class FileDescription:
    """What a loader reads of a model's files: the context it would be served with, whether it is an
    embedding model, its tokenizer (with any chat template the server was told to use) and its card."""

    max_model_len: int
    is_embedding: bool
    tokenizer: ChatTokenizer
    card: ModelCard


ModelDescribe = Callable[[ModelEntry], FileDescription]  # blocking (run on a worker thread); raises with the reason


@dataclass(frozen=True)
class ShownModel:
    """A model as the model endpoints describe it: what its requests would see, and its chat template."""

    model: ServedModel
    chat_template: str | None


@dataclass(frozen=True)
class _Described:
    max_model_len: int
    is_embedding: bool
    chat_format: ChatFormat | None
    chat_template: str | None
    card: ModelCard


def _read(describe: ModelDescribe, entry: ModelEntry) -> _Described:
    files = describe(entry)
    return _Described(files.max_model_len, files.is_embedding, model_chat_format(files.tokenizer),
                      getattr(files.tokenizer, "chat_template", None), files.card)


class ModelDescriptions:
    """Each model's description from its files, read once on a worker thread (two requests at once share
    the read; a failed read is tried again by the next request)."""

    def __init__(self, describe: ModelDescribe) -> None:
        self._describe = describe
        self._reads: dict[str, asyncio.Task[_Described]] = {}

    async def shown(self, entry: ModelEntry, sampling_defaults: SamplingDefaults) -> ShownModel:
        """`entry`'s model as its files describe it; ProtocolError (503) naming it when they cannot be read."""
        read = self._reads.get(entry.id)
        if read is None:
            read = self._reads[entry.id] = asyncio.ensure_future(asyncio.to_thread(_read, self._describe, entry))
        try:
            described = await asyncio.shield(read)
        except Exception as exc:
            if self._reads.get(entry.id) is read:
                del self._reads[entry.id]
            raise ProtocolError("model_unreadable", f"model {entry.id!r} could not be described from its files: "
                                f"{type(exc).__name__}: {str(exc)[:500]}", "model", error_type="server_error",
                                status=503) from None
        model = ServedModel(entry.id, described.max_model_len, sampling_defaults,
                            is_embedding=described.is_embedding, chat_format=described.chat_format,
                            card=described.card)
        return ShownModel(model, described.chat_template)
