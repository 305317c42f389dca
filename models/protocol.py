"""What the engine, the runner, CUDA graphs, the KV calibration and the loaders see of a model: the
`CausalLM` protocol and the `ForwardContext` a forward pass is handed. No family class is named outside
models/."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from localserve.models.config import ModelConfig
    from localserve.models.layers.rotary import RotaryEmbedding

    from localserve.attention.base import AttentionBackend, AttentionGeometry
    from localserve.kv.cache import PagedKVCache
    from localserve.kv.recurrent_states import StepStates


@dataclass
class InputEmbeds:
    """Input embeddings that replace some tokens' own (an image's, engine/multimodal.py): the rows of the step's
    flat batch [K] (int64, on the model's device) and their embeddings [K, hidden_size]. Each family places
    them after whatever it does to token embeddings (models/layers/decoder.py, `place_input_embeds`)."""

    rows: torch.Tensor
    values: torch.Tensor


@dataclass
class ForwardContext:
    """What attention needs besides activations; passed down explicitly, never held in globals."""

    backend: AttentionBackend
    kv_cache: PagedKVCache
    metadata: Any  # what backend.build_metadata made for this step
    # The step's recurrent-state reads and writes (kv/recurrent_states.py) where the model has recurrent layers.
    states: StepStates | None = None
    # Rows whose input embeddings are given rather than looked up (image tokens); None: every row is a token's.
    input_embeds: InputEmbeds | None = None


class CausalLM(Protocol):
    """A decoder-only language model over the flat batch of a step (an `nn.Module` in practice)."""

    config: ModelConfig
    rotary: RotaryEmbedding  # the rotary embedding of its keys (the 4-bit KV format rotates its key mean by it)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids, positions [T] -> hidden states [T, hidden_size] after the final norm. The rows that
        `ctx.input_embeds` names take its embeddings instead of their tokens' (images)."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] -> logits [N, vocab_size], in float32 at least."""

    @property
    def can_generate(self) -> bool:
        """Whether it has an output head to compute logits with (an embedding model may not)."""

    @property
    def supports_cuda_graphs(self) -> bool:
        """Whether a decode step can be captured as a CUDA graph (no host synchronisation inside)."""

    def attention_geometry(self) -> list[AttentionGeometry]:
        """Each layer's attention as it describes itself, in layer order."""

    def calibration_sample(self) -> list[torch.Tensor]:
        """A few of its weights (their first values are hashed) that tell one checkpoint from another:
        the KV calibration's cache key."""

    def init_rope(self, device: torch.device | str) -> None:
        """(Re)compute the rotary frequencies on `device`; needed after building on the meta device."""

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]: ...

    def eval(self) -> CausalLM: ...
