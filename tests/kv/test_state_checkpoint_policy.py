"""Where a prompt's end checkpoint lies (kv/state_group.py, `PROMPT_TAIL`): at the last block boundary at least
`PROMPT_TAIL` tokens before the prompt's end, so that the next turn of a chat, whose template renders the
end of this prompt (its generation prompt) differently, still resumes from it.

Blocks of 16 tokens and a checkpoint every 32 blocks (the defaults: 512 tokens), so that in prompts of up
to 200 tokens the end checkpoint is the only one: fixed examples at each residue's bound, then every prompt
length with the next turn differing 2 and 4 tokens before this prompt's end (Qwen3.5's template with
thinking on and off), and a generated one.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from localserve.kv.block_manager import BlockManager
from localserve.kv.layer_groups import RECURRENT
from localserve.kv.state_group import PROMPT_TAIL, CheckpointPolicy
from localserve.kv.state_steps import step_state_slots

BLOCK = 16
EVERY = 32  # blocks between periodic checkpoints: none in these prompts
STATE = 1


def test_the_tail_covers_what_qwen3_5s_generation_prompt_re_renders():
    assert PROMPT_TAIL == 8 and PROMPT_TAIL >= 4  # thinking off: the next turn differs 4 tokens before the end


@pytest.mark.parametrize("num_prompt_tokens, end_blocks", [
    (0, 0), (1, 0), (15, 0), (16, 0),  # shorter than a block and the tail: none
    (23, 0),  # 16 + tail - 1: the first boundary lies 7 tokens before the end
    (24, 1),  # 16 + tail: the first boundary, exactly the tail before the end
    (25, 1),
    (160, 9),  # P mod 16 = 0: the boundary at the end lies inside the tail, the one before it
    (167, 9),  # P mod 16 = 7: the boundary 7 tokens back lies inside the tail
    (168, 10),  # P mod 16 = 8: the boundary exactly the tail back
    (169, 10),  # P mod 16 = 9
    (175, 10),  # P mod 16 = 15
    (176, 10),  # the next residue 0
])
def test_the_prompts_end_checkpoint_is_the_last_boundary_a_tail_before_its_end(num_prompt_tokens, end_blocks):
    policy = CheckpointPolicy(BLOCK, EVERY, checkpoints=True)
    assert policy.prompt_end_blocks(num_prompt_tokens) == end_blocks
    expected = [end_blocks - 1] if end_blocks else []
    assert [index for index in range(20) if policy.is_checkpoint(index, num_prompt_tokens)] == expected


def test_periodic_checkpoints_stay_beside_the_end_checkpoint():
    policy = CheckpointPolicy(4, 3, checkpoints=True)
    # 30 tokens: the end checkpoint after 20 tokens (30 - 8 = 22, boundary 20), entry 4; periodic 2, 5, 8.
    assert [index for index in range(10) if policy.is_checkpoint(index, 30)] == [2, 4, 5, 8]
    assert [index for index in range(10) if policy.is_checkpoint(index, 32)] == [2, 5, 8]  # 24: periodic
    assert not any(CheckpointPolicy(4, 3, checkpoints=False).is_checkpoint(index, 30) for index in range(10))


def manager() -> BlockManager:
    return BlockManager([64, 16], BLOCK, 0, True, (None, RECURRENT), None, EVERY)


def prefill(bm: BlockManager, seq_id: int, token_ids: list[int]) -> int:
    """Admit and prefill a prompt in one step as the runner does; the tokens it found cached."""
    num_cached = bm.allocate(seq_id, token_ids)
    bm.make_slots(seq_id)
    step_state_slots(bm.live_block_table(seq_id, STATE), num_cached, len(token_ids) - num_cached, BLOCK)
    bm.mark_computed(seq_id, len(token_ids))
    bm.check_integrity()
    return num_cached


def next_turn_hit(num_prompt_tokens: int, num_re_rendered: int) -> int:
    """Tokens the next turn finds cached when it differs from a prompt `num_re_rendered` tokens before its end."""
    bm = manager()
    prompt = list(range(num_prompt_tokens))
    prefill(bm, 1, prompt)
    bm.free(1)
    return prefill(bm, 2, prompt[:num_prompt_tokens - num_re_rendered] + [1000 + index for index in range(40)])


@pytest.mark.parametrize("num_re_rendered", [2, 4])
@pytest.mark.parametrize("num_prompt_tokens, hit", [
    (23, 0), (24, 16), (32, 16), (39, 16), (40, 32), (41, 32),  # P mod 16 = 0, 7, 8, 9 on the first blocks
    (160, 144), (162, 144), (167, 144), (168, 160), (169, 160), (175, 160),
])
def test_the_next_turn_resumes_from_the_end_checkpoint(num_prompt_tokens, num_re_rendered, hit):
    assert next_turn_hit(num_prompt_tokens, num_re_rendered) == hit


def test_every_prompt_length_resumes_within_a_tail_and_a_block_of_the_difference():
    for num_prompt_tokens in range(1, 120):
        for num_re_rendered in (2, 4):
            hit = next_turn_hit(num_prompt_tokens, num_re_rendered)
            assert hit == max(0, num_prompt_tokens - PROMPT_TAIL) // BLOCK * BLOCK, (num_prompt_tokens, hit)
            assert num_prompt_tokens - hit < PROMPT_TAIL + BLOCK or num_prompt_tokens < PROMPT_TAIL + BLOCK


@settings(max_examples=30, deadline=None)
@given(num_prompt_tokens=st.integers(1, 300), num_re_rendered=st.integers(0, PROMPT_TAIL))
def test_a_re_rendered_tail_up_to_the_limit_never_misses_the_end_checkpoint(num_prompt_tokens, num_re_rendered):
    hit = next_turn_hit(num_prompt_tokens, num_re_rendered)
    assert hit == max(0, num_prompt_tokens - PROMPT_TAIL) // BLOCK * BLOCK
