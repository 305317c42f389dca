"""What an embedding request asks (plain data, no torch): its prompt is prefilled, pooled by the model's
pooling (models/pooling.py) and returned as one vector; nothing is sampled, nothing decoded."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EmbeddingParams:
    """`dimensions`: keep the vector's first `dimensions` values, normalised again (Matryoshka truncation);
    only a model whose pooling allows it (`PoolingSpec.truncatable`), at most its hidden size. None: all."""

    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise ValueError(f"EmbeddingParams.dimensions must be an integer >= 1 (or None), got {self.dimensions!r}")
