"""The Gated DeltaNet mixer: the linear-attention layers of Qwen3.5 / Qwen3.6 / Qwen3-Next hybrid models.

For each token x of a sequence:
    qkv = silu(causal depthwise conv over time of in_proj_qkv(x))   (queries, keys, values side by side)
    z = in_proj_z(x); beta = sigmoid(in_proj_b(x)); g = -exp(A_log) * softplus(in_proj_a(x) + dt_bias)
    o = gated delta rule (models/layers/gated_delta.py) over L2-normalised q, k, with decay exp(g), strength beta
    out = out_proj(rmsnorm(o) * w * silu(z))                        (per value head)

The layer keeps no KV: per sequence it carries the convolution's last `conv_kernel - 1` inputs and one
delta-rule matrix per value head (LinearAttentionConfig.state). It reads each sequence's starting state
from `ctx.states` (kv/recurrent_states.py: StepStates) and writes the state at every save point the step
asks for (a checkpoint inside the chunk, and always the state after its last token): the delta rule runs
segment by segment between save points, carrying the state, so a saved state is exactly the state of the
tokens before it. A sequence's query length is its last save point (StepStates.saves).

A speculative verify row (StepStates.held) gets its outputs like any chunk but saves nothing: the layer
hands the step a replay, which makes the states of the row's kept tokens once the verification is done
(`StepStates.settle`), so a rejected drafted token never reaches a state. A step of such rows beside
decodes runs in one padded recurrence (`short_rows`, SHORT_ROWS), and so does the replay of its rows.

Parameter names follow transformers' Qwen3.5 (`linear_attn.in_proj_qkv`, `in_proj_z`, `in_proj_b`,
`in_proj_a`, `conv1d` [conv_dim, 1, kernel], `A_log`, `dt_bias`, `norm`, `out_proj`). Qwen3-Next's
checkpoints fuse the input projections per key head (`in_proj_qkvz`, `in_proj_ba`): kept fused as stored
(their rows interleave per key head, which a row range cannot cut out), their outputs split here. The
other layouts llama.cpp's GGUFs use (value heads tiled, `A` stored as -exp(A_log)) are
LinearAttentionConfig's switches too.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from localserve.models.config import LinearAttentionConfig
from localserve.models.layers.gated_delta import (
    chunked_gated_delta_rule,
    recurrent_gated_delta_rule,
    recurrent_gated_delta_rule_slots,
)
from localserve.models.protocol import ForwardContext
from torch import nn

SHORT_ROWS = 16
"""A step with speculative verify rows whose sequences all compute at most this many tokens, each saving only
its final state (verify rows beside decodes), runs them in one padded batch (`GatedDeltaNet.short_rows`)
instead of one after another; its recurrence goes token by token, as long as the longest. (Other steps keep
the chunked form for chunks: their numbers stay those of a step without drafts.)"""


class GatedRMSNorm(nn.Module):
    """rmsnorm(x) * w * silu(gate) per head: normalised in float32, scaled in x's dtype, gated in float32
    (transformers' Qwen3.5 / Qwen3-Next `RMSNormGated`); `w` is the scale itself (not zero-centred)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        wide = x if x.dtype == torch.float64 else x.float()
        normed = self.weight * F.rms_norm(wide, (x.shape[-1],), eps=self.eps).to(x.dtype)
        return (normed * F.silu(gate.to(wide.dtype))).to(x.dtype)


def causal_conv(inputs: torch.Tensor, past: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """silu of the causal depthwise convolution of one sequence's inputs [T, C] preceded by its `past`
    inputs [C, K - 1] (zeros for a fresh sequence), with `weight` [C, K] (tap K - 1 on the newest input);
    returns [T, C] in the inputs' dtype (computed in the weight's)."""
    window = torch.cat((past.to(weight.dtype), inputs.t().to(weight.dtype)), dim=1)  # [C, K - 1 + T]
    out = F.conv1d(window[None], weight[:, None, :], groups=weight.shape[0])[0]  # [C, T]
    return F.silu(out).t().to(inputs.dtype)


def query_lengths(ctx: ForwardContext, num_tokens: int, layer: int) -> list[int]:
    """Each sequence's tokens in this step (its last save point), checked against the batch's size."""
    if ctx.states is None:
        raise ValueError(f"layer {layer} is a linear-attention layer: its forward pass needs the step's "
                         "recurrent states (ForwardContext.states)")
    lengths = [seq[-1][0] if seq else 0 for seq in ctx.states.saves]
    if sum(lengths) != num_tokens or min(lengths, default=1) < 1:
        raise ValueError(f"layer {layer}: the step's save points give sequences of {lengths} tokens, the batch "
                         f"holds {num_tokens}: each sequence's last save point must be its whole query")
    return lengths


class GatedDeltaNet(nn.Module):
    """One linear-attention layer (module doc), its parameters laid out as LinearAttentionConfig says."""

    def __init__(self, hidden_size: int, linear: LinearAttentionConfig, eps: float, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.linear = linear
        self.k_heads, self.v_heads = linear.num_key_heads, linear.num_value_heads
        self.k_dim, self.v_dim = linear.key_head_dim, linear.value_head_dim
        if linear.fused_qkvz:
            self.in_proj_qkvz = nn.Linear(hidden_size, linear.conv_dim + linear.value_dim, bias=False)
        else:
            self.in_proj_qkv = nn.Linear(hidden_size, linear.conv_dim, bias=False)
            self.in_proj_z = nn.Linear(hidden_size, linear.value_dim, bias=False)
        if linear.fused_ba:
            self.in_proj_ba = nn.Linear(hidden_size, 2 * self.v_heads, bias=False)
        else:
            self.in_proj_b = nn.Linear(hidden_size, self.v_heads, bias=False)
            self.in_proj_a = nn.Linear(hidden_size, self.v_heads, bias=False)
        self.conv1d = nn.Conv1d(linear.conv_dim, linear.conv_dim, linear.conv_kernel, groups=linear.conv_dim,
                                bias=False)
        if linear.log_decay_rate:
            self.A_log = nn.Parameter(torch.empty(self.v_heads))
        else:
            self.A = nn.Parameter(torch.empty(self.v_heads))
        self.dt_bias = nn.Parameter(torch.empty(self.v_heads))
        self.norm = GatedRMSNorm(self.v_dim, eps)
        self.out_proj = nn.Linear(linear.value_dim, hidden_size, bias=False)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H] -> the convolution's inputs [T, conv_dim] (all queries, all keys, all values), the output
        gate z [T, value_dim], b and a [T, v_heads]: split out of the fused projections where they are."""
        tokens, group = x.shape[0], self.v_heads // self.k_heads
        if self.linear.fused_qkvz:
            qkvz = self.in_proj_qkvz(x).view(tokens, self.k_heads, -1)
            parts = qkvz.split((self.k_dim, self.k_dim, group * self.v_dim, group * self.v_dim), dim=-1)
            mixed = torch.cat([part.reshape(tokens, -1) for part in parts[:3]], dim=-1)
            z = parts[3].reshape(tokens, -1)
        else:
            mixed, z = self.in_proj_qkv(x), self.in_proj_z(x)
        if self.linear.fused_ba:
            b, a = self.in_proj_ba(x).view(tokens, self.k_heads, 2 * group).split((group, group), dim=-1)
            b, a = b.reshape(tokens, -1), a.reshape(tokens, -1)
        else:
            b, a = self.in_proj_b(x), self.in_proj_a(x)
        return mixed, z, b, a

    def decay_rate(self) -> torch.Tensor:
        """-A per value head [Hv] in float32 (g = -A * softplus(a + dt_bias))."""
        return -self.A_log.float().exp() if self.linear.log_decay_rate else self.A.float()

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """x [T, H] (the step's sequences one after another) -> [T, H]; reads and saves ctx.states."""
        num_tokens = x.shape[0]
        lengths = query_lengths(ctx, num_tokens, self.layer)
        mixed, z, b, a = self.project(x)
        beta = b.sigmoid()
        g = self.decay_rate() * F.softplus(a.float() + self.dt_bias.float())
        weight = self.conv1d.weight[:, 0, :]
        states = ctx.states
        if max(lengths) == 1 and all(len(saves) == 1 for saves in states.saves):  # decodes only
            core = self.decode(mixed, g, beta, states.initial_conv(self.layer), weight, ctx)
        elif states.held and max(lengths) <= SHORT_ROWS and all(len(saves) == 1 or seq in states.held
                                                                for seq, saves in enumerate(states.saves)):
            core = self.short_rows(lengths, mixed, g, beta, weight, ctx)  # verify rows beside decodes
        else:
            conv_states, matrices = ctx.states.initial(self.layer)
            core = self.prefill(lengths, mixed, g, beta, conv_states, matrices, weight, ctx)
        core = core.view(num_tokens, self.v_heads, self.v_dim)
        gated = self.norm(core, z.view(num_tokens, self.v_heads, self.v_dim))
        return self.out_proj(gated.reshape(num_tokens, -1))

    def decode(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, conv_states: torch.Tensor,
               weight: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """One token per sequence, all sequences at once: mixed [S, conv_dim] -> outputs [S, Hv, Dv]. The
        delta-rule matrices are read from and written to the state pool in place (on CUDA one kernel, no
        copy of a state out of the pool and back)."""
        window = torch.cat((conv_states, mixed[:, :, None].to(conv_states.dtype)), dim=2)  # [S, C, K]
        qkv = F.silu((window.to(weight.dtype) * weight).sum(-1)).to(mixed.dtype)
        query, key, value = self.heads(qkv[:, None])
        slots = ctx.states.save_slots()
        out = recurrent_gated_delta_rule_slots(query, key, value, g[:, None], beta[:, None],
                                               ctx.states.cache.matrix[self.layer], ctx.states.read_slots, slots,
                                               l2norm_qk=True)
        ctx.states.save_conv(self.layer, slots, window[:, :, 1:])
        return out

    def prefill(self, lengths: list[int], mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                conv_states: torch.Tensor, matrices: torch.Tensor, weight: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        """Sequence after sequence, segment by segment between its save points (module doc). A held
        sequence (a verify row, StepStates.held) runs whole and saves nothing: its `replay` goes to the
        step's states, which make its kept tokens' states once the verification is done."""
        outputs, saved_conv, saved_matrix, held = [], [], [], {}
        start = 0
        states = ctx.states
        for seq, length in enumerate(lengths):
            stop = start + length
            past = conv_states[seq]
            qkv = causal_conv(mixed[start:stop], past, weight)
            history = torch.cat((past, mixed[start:stop].t().to(past.dtype)), dim=1)  # [C, K - 1 + T]
            segment = (qkv, g[start:stop], beta[start:stop], history)
            if seq in states.held:
                outputs.append(self.delta_rule(qkv[None], g[None, start:stop], beta[None, start:stop],
                                               matrices[seq:seq + 1])[0][0])
                held[seq] = segment
            else:
                out, conv, matrix = self.segments(*segment, matrices[seq:seq + 1],
                                                  [tokens for tokens, _ in states.saves[seq]])
                outputs.append(out)
                saved_conv.append(conv)
                saved_matrix.append(matrix)
            start = stop
        if saved_conv:
            states.save(self.layer, states.save_slots(), torch.cat(saved_conv), torch.cat(saved_matrix))
        if held:
            states.hold(self.layer, list(held), partial(self.replay, list(held.values())))
        return torch.cat(outputs)

    def short_rows(self, lengths: list[int], mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   weight: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Sequences of at most SHORT_ROWS tokens, each saving only its state after all of them (decodes,
        verify rows, short chunks inside a block), all at once: padded to the longest, the padding made a
        no-op of the delta rule (decay exp(0) = 1, write strength 0: the state passes it unchanged), one
        batched recurrence. A held sequence's replay reuses the padded inputs, masked at its kept tokens."""
        states, num_seqs, longest = ctx.states, len(lengths), max(lengths)
        device = mixed.device
        counts = torch.tensor(lengths, device=device)
        places = torch.arange(longest, device=device)
        valid = places[None, :] < counts[:, None]  # [S, T]
        rows = torch.where(valid, (counts.cumsum(0) - counts)[:, None] + places[None, :], 0)
        conv_states, matrices = states.initial(self.layer)
        window = torch.cat((conv_states, mixed[rows].transpose(1, 2).to(conv_states.dtype)), dim=2)  # [S, C, K-1+T]
        qkv = F.silu(F.conv1d(window.to(weight.dtype), weight[:, None, :], groups=weight.shape[0]))
        query, key, value = self.heads(qkv.transpose(1, 2).to(mixed.dtype))
        g_rows, beta_rows = g[rows] * valid[..., None], beta[rows] * valid[..., None]
        out, final = recurrent_gated_delta_rule(query, key, value, g_rows, beta_rows, matrices, l2norm_qk=True)
        width = conv_states.shape[2]
        writing = [seq for seq in range(num_seqs) if seq not in states.held]
        if writing:
            states.save(self.layer, states.save_slots(),
                        torch.stack([window[seq, :, lengths[seq]:lengths[seq] + width] for seq in writing]),
                        final[writing])
        held = sorted(states.held)
        if held:
            states.hold(self.layer, held, partial(self.replay_rows, query[held], key[held], value[held],
                                                  g_rows[held], beta_rows[held], window[held]))
        return out[valid]

    def segments(self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, history: torch.Tensor,
                 state: torch.Tensor, save_points: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One sequence's tokens (qkv [T, conv_dim], g and beta [T, Hv], history [C, K - 1 + T]: its conv
        inputs, the past ones first) from `state` [1, Hv, Dk, Dv], run up to each save point (increasing
        token counts) in turn: the outputs [t, Hv, Dv] of the tokens before the last save point t, and the
        states after each save point, conv [N, C, K - 1] and matrices [N, Hv, Dk, Dv]."""
        outputs, saved_conv, saved_matrix, done = [], [], [], 0
        width = history.shape[1] - qkv.shape[0]
        for tokens in save_points:
            if tokens > done:  # (a save point at 0 tokens saves the state read)
                out, state = self.delta_rule(qkv[None, done:tokens], g[None, done:tokens], beta[None, done:tokens],
                                             state)
                outputs.append(out[0])
            saved_conv.append(history[:, tokens:tokens + width])
            saved_matrix.append(state[0])
            done = tokens
        out = torch.cat(outputs) if outputs else qkv.new_empty(0, self.v_heads, self.v_dim)
        return out, torch.stack(saved_conv), torch.stack(saved_matrix)

    def replay(self, segments: list[tuple[torch.Tensor, ...]], members: list[int], conv: torch.Tensor,
               matrix: torch.Tensor, tokens: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The states of held sequences after each of their `tokens` (kv/recurrent_states.py, `Replay`), from
        the matrices they read, segment by segment (`segments`: each held sequence's qkv, g, beta and conv
        history, which holds the conv inputs it read: `conv` is not needed)."""
        convs, matrices = [], []
        for member, state, counts in zip(members, matrix, tokens, strict=True):
            _, conv_after, matrix_after = self.segments(*segments[member], state[None], counts)
            convs.append(conv_after)
            matrices.append(matrix_after)
        return torch.cat(convs), torch.cat(matrices)

    def replay_rows(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor, window: torch.Tensor, members: list[int], conv: torch.Tensor,
                    matrix: torch.Tensor, tokens: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """`replay` over `short_rows`' padded inputs of the held sequences: where each keeps one state (its
        kept tokens', the common case), one batched recurrence masked past them; else sequence by sequence."""
        width = conv.shape[2]
        if any(len(counts) != 1 for counts in tokens):
            convs, matrices = [], []
            for member, state, counts in zip(members, matrix, tokens, strict=True):
                for count in counts:
                    _, after = recurrent_gated_delta_rule(
                        query[member:member + 1, :count], key[member:member + 1, :count],
                        value[member:member + 1, :count], g[member:member + 1, :count],
                        beta[member:member + 1, :count], state[None], l2norm_qk=True)
                    convs.append(window[member, :, count:count + width])
                    matrices.append(after[0])
            return torch.stack(convs), torch.stack(matrices)
        counts = torch.tensor([counts[0] for counts in tokens], device=g.device)
        keep = (torch.arange(g.shape[1], device=g.device)[None, :] < counts[:, None])[..., None]
        _, after = recurrent_gated_delta_rule(query[members], key[members], value[members], g[members] * keep,
                                              beta[members] * keep, matrix, l2norm_qk=True)
        return torch.stack([window[member, :, count:count + width]
                            for member, [count] in zip(members, tokens, strict=True)]), after

    def delta_rule(self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Segments of B sequences, t tokens each: qkv [B, t, conv_dim], g and beta [B, t, Hv], the states
        [B, Hv, Dk, Dv] entering them -> their outputs [B, t, Hv, Dv] and the states after them."""
        query, key, value = self.heads(qkv)
        rule = recurrent_gated_delta_rule if qkv.shape[1] == 1 else chunked_gated_delta_rule
        return rule(query, key, value, g, beta, state, l2norm_qk=True)

    def heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv [B, t, conv_dim] -> query, key [B, t, Hv or Hk, Dk] (one per value head where the checkpoint
        tiles them) and value [B, t, Hv, Dv]."""
        linear, (batch, length) = self.linear, qkv.shape[:2]
        query, key, value = qkv.split((linear.key_dim, linear.key_dim, linear.value_dim), dim=-1)
        query = query.reshape(batch, length, self.k_heads, self.k_dim)
        key = key.reshape(batch, length, self.k_heads, self.k_dim)
        if linear.tiled_value_heads and self.v_heads != self.k_heads:  # value head j reads key head j % Hk
            repeats = self.v_heads // self.k_heads
            query, key = query.repeat(1, 1, repeats, 1), key.repeat(1, 1, repeats, 1)
        return query, key, value.reshape(batch, length, self.v_heads, self.v_dim)
