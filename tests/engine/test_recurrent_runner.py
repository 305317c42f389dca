"""The model runner over a pool with a state group (kv/recurrent_states.py), on the toy hybrid model of
tests/helpers/recurrent_toy.py, against its plain-torch reference: tables written by hand as the block
manager keeps them (kv/state_steps.py), prompts prefilled in chunks that do not line up with blocks, a
sequence resumed from a checkpoint another one saved, block moves of the state group routed to the states,
and the pool's bytes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from localserve.attention.torch_backend import TorchAttentionBackend
from localserve.engine.model_runner import ModelRunner
from localserve.engine.step import SeqChunk, StepInput
from localserve.kv.block_pool import NO_BLOCK
from localserve.kv.cache import PagedKVCache
from localserve.kv.recurrent_states import RecurrentStateCache
from tests.helpers.recurrent_toy import HEAD_DIM, NUM_KV_HEADS, STATE, make_toy_model, reference_logits

BLOCK = 4
NUM_BLOCKS = 32
NUM_SLOTS = 12
TOLERANCE = 1e-6  # the attention backend may round through float32; a wrong state is off by O(1)


@pytest.fixture(scope="module")
def model():
    return make_toy_model(seed=0)


def make_runner(model, num_cpu_blocks: int = 0) -> ModelRunner:
    states = RecurrentStateCache([1], STATE, NUM_SLOTS, torch.float64, num_cpu_slots=num_cpu_blocks)
    cache = PagedKVCache(2, NUM_BLOCKS, BLOCK, NUM_KV_HEADS, HEAD_DIM, torch.float64, num_cpu_blocks=num_cpu_blocks,
                         layer_groups=[0, 1], group_num_blocks=[NUM_BLOCKS, NUM_SLOTS], states=states)
    return ModelRunner(model, cache, TorchAttentionBackend())


class StateTable:
    """One sequence's state table kept by the block manager's rule (kv/state_steps.py, the contract): the
    running slot moves ahead in place unless its entry is a checkpoint (`checkpoints`: entries), then a new
    slot is taken; a checkpoint strictly inside a step gets a slot of its own. Slots come from `free`."""

    def __init__(self, checkpoints: set[int], free: list[int], resume: tuple[int, int] | None = None) -> None:
        self.checkpoints, self.free = checkpoints, free
        self.entries: dict[int, int] = dict([resume]) if resume else {}
        self.running = resume[0] if resume else None  # the entry of the running state

    def step(self, num_computed: int, num_new: int) -> list[int]:
        last = (num_computed + num_new - 1) // BLOCK
        if self.running is None or (last != self.running and self.running in self.checkpoints):
            self.entries[last] = self.free.pop(0)
        elif last != self.running:
            self.entries[last] = self.entries.pop(self.running)
        for entry in range(num_computed // BLOCK, last):
            if entry in self.checkpoints and entry not in self.entries:
                self.entries[entry] = self.free.pop(0)
        self.running = last
        return [self.entries.get(entry, NO_BLOCK) for entry in range(last + 1)]


def run_chunks(runner, tokens: list[int], chunk_lens: list[int], kv_table: list[int], table: StateTable,
               start: int = 0) -> torch.Tensor:
    """Prefill tokens[start:] in chunks of `chunk_lens`, one sequence with the state table `table`; the
    logits of every token."""
    logits = []
    position = start
    for length in chunk_lens:
        chunk = SeqChunk(tokens[position:position + length], position, kv_table, seq_id=7,
                         group_block_tables=[kv_table, table.step(position, length)])
        step = StepInput([chunk])
        inputs, input_ids, _ = runner.prepare_inputs(step)
        with torch.inference_mode():
            logits.append(runner._forward(input_ids, inputs, None, runner.step_states(step)))
        position += length
    return torch.cat(logits)


def test_chunks_across_blocks_equal_the_reference_and_save_checkpoints(model):
    runner = make_runner(model)
    tokens = [(7 * i + 3) % 64 for i in range(23)]
    # Checkpoints after 8 and 20 tokens (entries 1 and 4).
    table = StateTable({1, 4}, list(range(6)))
    ours = run_chunks(runner, tokens, [3, 6, 5, 9], list(range(6)), table)
    torch.testing.assert_close(ours, reference_logits(model, tokens), atol=TOLERANCE, rtol=0)
    # A second sequence resumes from the checkpoint after 8 tokens and equals the whole prompt's reference.
    other = tokens[:8] + [5, 6, 7, 8, 9]
    resumed = run_chunks(runner, other, [5], [0, 1, 10, 11], StateTable(set(), [10], resume=(1, table.entries[1])),
                         start=8)
    torch.testing.assert_close(resumed, reference_logits(model, other)[8:], atol=TOLERANCE, rtol=0)


def test_a_batch_of_prefills_and_decodes_equals_each_alone(model):
    runner = make_runner(model)
    first, second = [(5 * i + 1) % 64 for i in range(10)], [(3 * i + 2) % 64 for i in range(6)]
    run_chunks(runner, first, [10], [0, 1, 2], StateTable(set(), [0]))
    # One step: the first sequence decodes a token (its running slot moves on in place), the second prefills.
    step = StepInput([SeqChunk([11], 10, [0, 1, 2], seq_id=1, group_block_tables=[[0, 1, 2], [NO_BLOCK, NO_BLOCK, 0]]),
                      SeqChunk(second, 0, [5, 6], seq_id=2, group_block_tables=[[5, 6], [NO_BLOCK, 1]])])
    logits = runner.execute(step)
    torch.testing.assert_close(logits[0], reference_logits(model, first + [11])[-1], atol=TOLERANCE, rtol=0)
    torch.testing.assert_close(logits[1], reference_logits(model, second)[-1], atol=TOLERANCE, rtol=0)


def test_prompt_logits_take_the_state_table(model):
    runner = make_runner(model)
    tokens = [(11 * i + 5) % 64 for i in range(9)]
    with pytest.raises(ValueError, match="a table per group"):
        runner.prompt_logits(tokens, [0, 1, 2])
    logits = runner.prompt_logits(tokens, [0, 1, 2], [[0, 1, 2], [NO_BLOCK, NO_BLOCK, 3]])
    torch.testing.assert_close(logits, reference_logits(model, tokens), atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("num_kept", [1, 2, 3, 4])
def test_a_verify_row_writes_the_states_of_its_kept_tokens_only_once_settled(model, num_kept):
    """A verify row (its last real token and three drafted ones, past a block boundary, with a second
    sequence decoding beside it): its logits are the reference's at every row, its state slot is untouched
    by the forward pass, and `settle_states` writes the state of its first `num_kept` tokens: the next
    token's logits are the reference's over the kept tokens."""
    runner = make_runner(model)
    prompt, other = [(5 * i + 1) % 64 for i in range(6)], [(3 * i + 2) % 64 for i in range(5)]
    run_chunks(runner, prompt, [6], [0, 1, 2], StateTable(set(), [0]))  # its running state in slot 0
    run_chunks(runner, other, [5], [5, 6], StateTable(set(), [1]))
    before = runner.kv_cache.states.matrix[1][0].clone()
    row = [9, 17, 23, 31]  # tokens 6-9: blocks 1 and 2; the running slot moved to entry 2
    step = StepInput([SeqChunk(row, 6, [0, 1, 2], seq_id=1, num_draft_tokens=3,
                               group_block_tables=[[0, 1, 2], [NO_BLOCK, NO_BLOCK, 0]]),
                      SeqChunk([40], 5, [5, 6], seq_id=2, group_block_tables=[[5, 6], [NO_BLOCK, 1]])])
    logits = runner.execute(step)
    torch.testing.assert_close(logits[:4], reference_logits(model, prompt + row)[6:], atol=TOLERANCE, rtol=0)
    torch.testing.assert_close(logits[4], reference_logits(model, other + [40])[-1], atol=TOLERANCE, rtol=0)
    assert torch.equal(runner.kv_cache.states.matrix[1][0], before)  # held: nothing written yet
    runner.settle_states({1: num_kept, 2: 1})  # sequence 2 was no verify row: left as its step wrote it
    kept = prompt + row[:num_kept]
    table = [NO_BLOCK] * (len(kept) // BLOCK) + [0]  # the running slot moved to the new token's block
    step = StepInput([SeqChunk([50], len(kept), [0, 1, 2], seq_id=1, group_block_tables=[[0, 1, 2], table]),
                      SeqChunk([41], 6, [5, 6], seq_id=2, group_block_tables=[[5, 6], [NO_BLOCK, 1]])])
    logits = runner.execute(step)
    torch.testing.assert_close(logits[0], reference_logits(model, kept + [50])[-1], atol=TOLERANCE, rtol=0)
    torch.testing.assert_close(logits[1], reference_logits(model, other + [40, 41])[-1], atol=TOLERANCE, rtol=0)
    assert runner.held_states is None
    runner.settle_states({1: 1})  # nothing held any more: nothing happens


def test_state_moves_copy_and_swap_slots_not_kv(model):
    runner = make_runner(model, num_cpu_blocks=4)
    cache, states = runner.kv_cache, runner.kv_cache.states
    assert cache.key_stores[1] == {} and cache.value_stores[1] == {}
    assert cache.group_bytes_per_token() == [cache.bytes_per_token(), 0]
    assert cache.state_bytes() == NUM_SLOTS * STATE.nbytes(8, 4)  # conv in the model dtype, matrices float32
    states.conv[1][2] = 1.5
    states.matrix[1][2] = 2.5
    keys_before = cache.key_stores[0]["values"].clone()
    cache.copy_blocks([(2, 5, 1)])
    cache.swap_out([(5, 3, 1)])
    cache.swap_in([(3, 7, 1)])
    for slot in (5, 7):
        assert bool((states.conv[1][slot] == 1.5).all()) and bool((states.matrix[1][slot] == 2.5).all())
    assert torch.equal(cache.key_stores[0]["values"], keys_before)


def test_the_state_group_must_be_the_recurrent_layers_alone_and_last():
    states = RecurrentStateCache([1], STATE, 4, torch.float32)
    with pytest.raises(ValueError, match="must form the last layer group alone"):
        PagedKVCache(2, 8, BLOCK, NUM_KV_HEADS, HEAD_DIM, torch.float32, layer_groups=[1, 0],
                     group_num_blocks=[4, 8], states=states)
    with pytest.raises(ValueError, match="state group has 8 blocks but its cache 4 slots"):
        PagedKVCache(2, 8, BLOCK, NUM_KV_HEADS, HEAD_DIM, torch.float32, layer_groups=[0, 1],
                     group_num_blocks=[8, 8], states=states)


@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_any_chunking_with_any_checkpoints_equals_the_reference(model, data):
    length = data.draw(st.integers(1, 20), label="length")
    cuts = sorted(data.draw(st.sets(st.integers(1, length - 1), max_size=4), label="cuts")) if length > 1 else []
    bounds = [0, *cuts, length]
    chunk_lens = [b - a for a, b in zip(bounds, bounds[1:])]
    num_entries = -(-length // BLOCK)
    checkpoints = data.draw(st.sets(st.integers(0, num_entries - 2), max_size=3), label="checkpoints") \
        if num_entries > 1 else set()
    tokens = data.draw(st.lists(st.integers(0, 63), min_size=length, max_size=length), label="tokens")
    runner = make_runner(model)
    table = StateTable(checkpoints, list(range(8)))
    ours = run_chunks(runner, tokens, chunk_lens, list(range(num_entries)), table)
    torch.testing.assert_close(ours, reference_logits(model, tokens), atol=TOLERANCE, rtol=0)
    for entry in checkpoints:  # a sequence resumed from each checkpoint goes on as the whole prompt's reference
        start = (entry + 1) * BLOCK
        if start >= length:
            continue
        resume = StateTable(set(), [10], resume=(entry, table.entries[entry]))
        resumed = run_chunks(runner, tokens, [length - start], list(range(num_entries)), resume, start=start)
        torch.testing.assert_close(resumed, reference_logits(model, tokens)[start:], atol=TOLERANCE, rtol=0)


def test_execute_pooled_carries_the_states(model):
    runner = make_runner(model)
    tokens = [(13 * i + 4) % 64 for i in range(11)]
    table = StateTable({1}, [0, 1])
    first = SeqChunk(tokens[:6], 0, [0, 1, 2], seq_id=3, needs_logits=False, needs_hidden=True,
                     group_block_tables=[[0, 1, 2], table.step(0, 6)])
    _, hidden_first = runner.execute_pooled(StepInput([first]))
    second = SeqChunk(tokens[6:], 6, [0, 1, 2], seq_id=3, needs_hidden=True,
                      group_block_tables=[[0, 1, 2], table.step(6, 5)])
    logits, hidden_second = runner.execute_pooled(StepInput([second]))
    with torch.inference_mode():
        pooled_logits = model.compute_logits(torch.cat((hidden_first, hidden_second)))
    expected = reference_logits(model, tokens)
    torch.testing.assert_close(pooled_logits, expected, atol=TOLERANCE, rtol=0)
    torch.testing.assert_close(logits[0], expected[-1], atol=TOLERANCE, rtol=0)
