"""How an embedding model turns its final hidden states into one vector (plain data, no torch): the
pooling a model's sentence-transformers config (or a GGUF's `pooling_type`) names, L2 normalisation,
Matryoshka truncation. The loader finds it (loading/pooling_config.py); engine/pooling.py pools by it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class PoolingMethod(enum.Enum):
    LAST = "last"  # the last token's hidden state (sentence-transformers' pooling_mode_lasttoken)
    MEAN = "mean"  # the mean over the prompt's tokens (pooling_mode_mean_tokens)
    CLS = "cls"  # the first token's (pooling_mode_cls_token)

    @property
    def reads_every_token(self) -> bool:
        """Whether pooling needs hidden states of tokens before the last: such a prompt takes no prefix-cache
        hits (a cached block's tokens are never run, so their hidden states never exist)."""
        return self is not PoolingMethod.LAST


@dataclass(frozen=True)
class PoolingSpec:
    """An embedding model's pooling: the method, whether the vector is L2-normalised, and whether a
    client may ask for fewer dimensions (Matryoshka: the leading `dimensions` values, normalised again)."""

    method: PoolingMethod
    normalize: bool
    truncatable: bool = False
