"""One embedding request's pooling across the chunks of its prefill (models/pooling.py says how a model
pools): a prompt prefilled in several steps pools exactly as in one pass, the mean over every token of
every chunk, the last token of the last chunk, the first token of the first.
"""

from __future__ import annotations

import torch

from localserve.models.pooling import PoolingMethod, PoolingSpec


class PromptPooling:
    """One prompt's pooling state across the chunks of its prefill (float32 on the hidden states' device),
    and the `dimensions` its vector is cut to (None: all)."""

    __slots__ = ("spec", "dimensions", "_pooled", "_num_tokens")

    def __init__(self, spec: PoolingSpec, dimensions: int | None = None) -> None:
        self.spec, self.dimensions = spec, dimensions
        self._pooled: torch.Tensor | None = None  # the sum (MEAN), the first (CLS) or the latest last token
        self._num_tokens = 0

    def add(self, hidden: torch.Tensor, start_pos: int) -> None:
        """Take a chunk's hidden states [tokens, hidden] for positions start_pos, start_pos + 1, ...

        A chunk at position 0 starts the prompt over (a prefill again after a preemption by recompute)."""
        if start_pos == 0:
            self._pooled, self._num_tokens = None, 0
        method = self.spec.method
        if method is PoolingMethod.LAST:
            self._pooled = hidden[-1].to(torch.float32, copy=True)  # not a view holding the step's
        elif method is PoolingMethod.CLS:
            if start_pos == 0:
                self._pooled = hidden[0].to(torch.float32, copy=True)
        else:
            chunk_sum = hidden.float().sum(0)
            self._pooled = chunk_sum if self._pooled is None else self._pooled + chunk_sum
        self._num_tokens += hidden.shape[0]

    def vector(self) -> list[float]:
        """The pooled vector (normalised if the model's is), cut to its first `dimensions` values and
        normalised again when asked (the engine checked that the model allows it)."""
        if self._pooled is None:
            raise ValueError("no hidden states were pooled")
        pooled = self._pooled / self._num_tokens if self.spec.method is PoolingMethod.MEAN else self._pooled
        if self.dimensions is not None:
            pooled = pooled[:self.dimensions]
        if self.spec.normalize:
            pooled = torch.nn.functional.normalize(pooled, dim=0)
        return pooled.tolist()
