"""A tiny hybrid model for engine tests of recurrent states, with a plain-torch reference over whole sequences.

`RecurrentToyLM` is a `CausalLM` of two layers: layer 0 is models' `Attention` over the paged KV (rotary,
grouped-query), layer 1 a recurrent layer whose state is exactly what a test can check:

- its convolution keeps the last `CONV_WIDTH - 1` inputs x (conv_dim = hidden size) and mixes each token's
  window of inputs, `sum_j conv[j] * x[t - j]` (zeros before the sequence);
- its matrices are the running sums `M_t = sum_{s <= t} tanh(k_s) v_s^T` per head, read as
  `q_t M_t / (t + 1)`, the mean over the whole prefix (t: the token's position).

So its output at a token depends on every token before it through the state alone: a state read from the
wrong slot, saved at the wrong point, or left with a rejected token changes the logits. The layer reads its
starting states from `ctx.states.initial`, carries them through each sequence's tokens, and saves the
states after each save point (`StepStates.saves`), as a Gated DeltaNet layer does; a held sequence (a
speculative verify row) saves nothing and hands the step a replay of its states instead.

`reference_logits` computes the same function over a whole sequence in plain torch: causal softmax
attention and the recurrences written out token by token, no paged cache and no states.
"""

from __future__ import annotations

import torch
from localserve.models.config import LayerAttention, ModelConfig
from localserve.models.layers.attention import Attention, RopeTables
from localserve.models.layers.norms import RMSNorm
from localserve.models.layers.rotary import RotaryEmbedding
from localserve.models.protocol import ForwardContext
from torch import nn

from localserve.attention.base import AttentionGeometry
from localserve.kv.state_shape import StateShape

VOCAB = 64
HIDDEN = 16
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 8
CONV_WIDTH = 3
STATE_HEADS, KEY_DIM, VALUE_DIM = 2, 4, 4
STATE = StateShape(HIDDEN, CONV_WIDTH, STATE_HEADS, KEY_DIM, VALUE_DIM)


def toy_config(name: str = "recurrent-toy") -> ModelConfig:
    """Layer 0 attends (KV), layer 1 keeps a recurrent state (no KV)."""
    return ModelConfig(
        architecture="RecurrentToyForCausalLM", vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=HIDDEN,
        num_layers=2, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, name=name,
        max_position_embeddings=4096, eos_token_ids=(2,),
        layer_attention=(LayerAttention(NUM_KV_HEADS, HEAD_DIM), LayerAttention(NUM_KV_HEADS, HEAD_DIM, state=STATE)))


class ToyRecurrent(nn.Module):
    """The recurrent layer (module doc): a causal convolution over its inputs and running outer-product sums."""

    def __init__(self, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.conv = nn.Parameter(torch.empty(CONV_WIDTH, HIDDEN))  # conv[j]: the weight of input t - j
        self.q_proj = nn.Linear(HIDDEN, STATE_HEADS * KEY_DIM, bias=False)
        self.k_proj = nn.Linear(HIDDEN, STATE_HEADS * KEY_DIM, bias=False)
        self.v_proj = nn.Linear(HIDDEN, STATE_HEADS * VALUE_DIM, bias=False)
        self.out_proj = nn.Linear(HIDDEN + STATE_HEADS * VALUE_DIM, HIDDEN, bias=False)

    def mix(self, window: torch.Tensor, x: torch.Tensor, matrix: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """One token's output from its input window [CONV_WIDTH, HIDDEN] (oldest first), its input x [HIDDEN],
        the matrices after it [heads, Dk, Dv] and its position."""
        convolved = (window.flip(0) * self.conv).sum(0)
        query = self.q_proj(x).view(STATE_HEADS, KEY_DIM)
        read = torch.einsum("hk,hkv->hv", query, matrix) / (position + 1)
        return self.out_proj(torch.cat((convolved, read.flatten())))

    def update(self, matrix: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        key = torch.tanh(self.k_proj(x)).view(STATE_HEADS, KEY_DIM)
        value = self.v_proj(x).view(STATE_HEADS, VALUE_DIM)
        return matrix + torch.einsum("hk,hv->hkv", key, value)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        states = ctx.states
        if states is None:
            raise ValueError(f"layer {self.layer} keeps a recurrent state: the step must carry StepStates")
        conv_states, matrices = states.initial(self.layer)  # [S, HIDDEN, w - 1], [S, heads, Dk, Dv]
        outputs, saved_conv, saved_matrix, held = [], [], [], {}
        start = 0
        for seq, saves in enumerate(states.saves):
            length = saves[-1][0]
            x_seq = x[start:start + length]
            inputs = torch.cat((conv_states[seq].T.to(x.dtype), x_seq))  # [w - 1 + length, H]
            matrix = matrices[seq].to(x.dtype)
            save_points = set() if seq in states.held else {tokens for tokens, _ in saves}
            for i in range(length):
                matrix = self.update(matrix, x_seq[i])
                outputs.append(self.mix(inputs[i:i + CONV_WIDTH], x_seq[i], matrix, positions[start + i]))
                if i + 1 in save_points:
                    saved_conv.append(inputs[i + 1:i + CONV_WIDTH].T)
                    saved_matrix.append(matrix)
            if seq in states.held:  # a verify row: its states once the kept tokens are known
                held[seq] = (x_seq, inputs)
            start += length
        if start != x.shape[0]:
            raise ValueError(f"the step's states cover {start} tokens, the batch has {x.shape[0]}")
        if saved_conv:
            states.save(self.layer, states.save_slots(), torch.stack(saved_conv), torch.stack(saved_matrix))
        if held:
            rows = list(held.values())
            states.hold(self.layer, list(held), lambda members, conv, matrix, tokens: self.replay(rows, members,
                                                                                                 matrix, tokens))
        return torch.stack(outputs)

    def replay(self, rows: list[tuple[torch.Tensor, torch.Tensor]], members: list[int], matrix: torch.Tensor,
               tokens: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The states after each of `tokens[i]` of held sequence `members[i]`'s step (`rows`: each held
        sequence's inputs and conv window), from the matrices they read."""
        convs, matrices = [], []
        for member, start_matrix, counts in zip(members, matrix, tokens, strict=True):
            (x_seq, inputs), state, done = rows[member], start_matrix.to(rows[member][0].dtype), 0
            for count in counts:
                for i in range(done, count):
                    state = self.update(state, x_seq[i])
                convs.append(inputs[count:count + CONV_WIDTH - 1].T)
                matrices.append(state)
                done = count
        return torch.stack(convs), torch.stack(matrices)


class RecurrentToyLM(nn.Module):
    """embeddings -> attention (layer 0) -> recurrent layer (layer 1) -> norm -> head, each with a residual."""

    def __init__(self, config: ModelConfig | None = None) -> None:
        super().__init__()
        self.config = config or toy_config()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.attn_norm = RMSNorm(HIDDEN, 1e-6)
        self.self_attn = Attention(self.config, 0)
        self.mix_norm = RMSNorm(HIDDEN, 1e-6)
        self.linear_attn = ToyRecurrent(1)
        self.norm = RMSNorm(HIDDEN, 1e-6)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.rotary = RotaryEmbedding(self.config.rope, HEAD_DIM)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        rope = RopeTables(*self.rotary(positions, x.dtype))
        x = x + self.self_attn(self.attn_norm(x), rope, ctx)
        x = x + self.linear_attn(self.mix_norm(x), positions, ctx)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        return logits if logits.dtype == torch.float64 else logits.float()

    @property
    def can_generate(self) -> bool:
        return True

    @property
    def supports_cuda_graphs(self) -> bool:
        return False

    def attention_geometry(self) -> list[AttentionGeometry]:
        return [self.self_attn.geometry] * self.config.num_layers  # the recurrent layer's: unused

    def calibration_sample(self) -> list[torch.Tensor]:
        return [self.self_attn.k_proj.weight]

    def init_rope(self, device: torch.device | str) -> None:
        self.rotary = RotaryEmbedding(self.config.rope, HEAD_DIM, device=device)


def make_toy_model(seed: int = 0, dtype: torch.dtype = torch.float64, name: str = "recurrent-toy") -> RecurrentToyLM:
    """The toy with wide random weights (logits far from flat, so greedy ties are rare)."""
    torch.manual_seed(seed)
    model = RecurrentToyLM(toy_config(name)).to(dtype).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.5)
    return model


@torch.no_grad()
def reference_logits(model: RecurrentToyLM, token_ids: list[int]) -> torch.Tensor:
    """Logits [len(token_ids), VOCAB] of the whole sequence from position 0 in plain torch (module doc)."""
    x = model.embed_tokens(torch.tensor(token_ids))
    num_tokens = x.shape[0]
    positions = torch.arange(num_tokens)
    attn = model.self_attn
    h = model.attn_norm(x)
    cos, sin = model.rotary(positions, x.dtype)
    query = attn.q_proj(h).view(num_tokens, NUM_HEADS, HEAD_DIM)
    key = attn.k_proj(h).view(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    value = attn.v_proj(h).view(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    query, key = _rotate_half(query, cos, sin), _rotate_half(key, cos, sin)
    key = key.repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=1)
    value = value.repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=1)
    scores = torch.einsum("thd,shd->hts", query, key) * HEAD_DIM ** -0.5
    scores = scores.masked_fill(torch.ones(num_tokens, num_tokens, dtype=torch.bool).triu(1), float("-inf"))
    attended = torch.einsum("hts,shd->thd", scores.softmax(-1), value)
    x = x + attn.o_proj(attended.reshape(num_tokens, -1))
    h = model.mix_norm(x)
    mixer = model.linear_attn
    padded = torch.cat((torch.zeros(CONV_WIDTH - 1, HIDDEN, dtype=h.dtype), h))
    matrix = torch.zeros(STATE_HEADS, KEY_DIM, VALUE_DIM, dtype=h.dtype)
    outputs = []
    for t in range(num_tokens):
        key_t = torch.tanh(h[t] @ mixer.k_proj.weight.T).view(STATE_HEADS, KEY_DIM)
        matrix = matrix + key_t[:, :, None] * (h[t] @ mixer.v_proj.weight.T).view(STATE_HEADS, 1, VALUE_DIM)
        convolved = sum(mixer.conv[j] * padded[CONV_WIDTH - 1 + t - j] for j in range(CONV_WIDTH))
        query_t = (h[t] @ mixer.q_proj.weight.T).view(STATE_HEADS, KEY_DIM)
        read = (query_t[:, :, None] * matrix).sum(1) / (t + 1)
        outputs.append(torch.cat((convolved, read.flatten())) @ mixer.out_proj.weight.T)
    x = x + torch.stack(outputs)
    return model.lm_head(model.norm(x))


def _rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding written out (Llama's halves): x [T, heads, D], cos/sin [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def reference_greedy(model: RecurrentToyLM, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens after `prompt`, each from `reference_logits` over everything so far."""
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(int(reference_logits(model, tokens)[-1].argmax()))
    return tokens[len(prompt):]
