"""Qwen3.5 (dense hybrid: Gated DeltaNet and gated full attention) against transformers on the same random
weights (tests/helpers/hybrid_models.py), our model run on hand-built steps with its recurrent states in
slots: one pass, a prompt prefilled in chunks that cut 16-token blocks anywhere (the state carried through
a slot), save points inside a chunk (the saved state is the prefix's own), decodes batched with a prefill,
the multimodal checkpoint read as its language model; and the configs refused, naming what is wrong."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from localserve.models.config import ModelConfigError
from localserve.models.registry import config_from_hf

from localserve.kv.state_steps import kept_state_slots
from localserve.loading.hf import load_model
from tests.helpers.hybrid_models import (
    VOCAB,
    Chunk,
    HybridDriver,
    assert_close_logits,
    qwen3_5_config,
    save_hybrid,
    text_fields,
    transformers_logits,
)

PROMPT = torch.randint(3, VOCAB, (53,), generator=torch.Generator().manual_seed(5)).tolist()
TABLE = [6, 2, 9, 4]


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_5")
    hf_model = save_hybrid(folder, qwen3_5_config())
    loaded = load_model(folder, dtype=torch.float32)
    return folder, hf_model, loaded, transformers_logits(hf_model, PROMPT)


def test_config_read(dense):
    config = dense[2].config
    assert config.architecture == "Qwen3_5ForCausalLM" and config.family == "qwen3_5"
    assert config.recurrent_layers == (0, 1, 3)
    assert config.rotary_dim == 8 and config.qk_norm
    state = config.attention_of(0).state
    assert (state.conv_dim, state.conv_width, state.num_heads, state.key_dim, state.value_dim) == (64, 4, 4, 8, 8)
    assert config.attention_of(2).state is None
    assert config.kv_bytes_per_token_fp16 == 2 * 1 * 2 * 32 * 2  # the one full layer keeps KV


def test_one_pass_matches_transformers(dense):
    _, _, loaded, theirs = dense
    ours = HybridDriver(loaded.model).prefill_in_pieces(PROMPT, [], TABLE)
    assert_close_logits(ours, theirs)


def test_two_chunks_off_the_blocks_carry_the_state_through_a_slot(dense):
    """Chunks of 21 and 32 tokens (neither on a 16-token boundary): the second reads the first's state from
    its slot; starting it from zeros instead changes the logits by far more than the tolerance."""
    _, _, loaded, theirs = dense
    driver = HybridDriver(loaded.model)
    assert_close_logits(driver.prefill_in_pieces(PROMPT, [21], TABLE, slot=3), theirs)
    fresh = HybridDriver(loaded.model)
    fresh.step([Chunk(PROMPT[:21], 0, -1, [(21, 3)], TABLE)])
    forgotten = fresh.step([Chunk(PROMPT[21:], 21, -1, [(32, 3)], TABLE)])
    assert (forgotten - theirs[21:]).abs().max() > 0.1


def test_save_point_mid_chunk_holds_the_prefix_state(dense):
    """One chunk saving after 16 and 37 of its 53 tokens: those slots hold what running the first 16 (37)
    tokens alone leaves, and a chunk started from either gives transformers' logits."""
    _, _, loaded, theirs = dense
    driver = HybridDriver(loaded.model)
    assert_close_logits(driver.step([Chunk(PROMPT, 0, -1, [(16, 1), (37, 2), (53, 3)], TABLE)]), theirs)
    for tokens, slot in ((16, 1), (37, 2)):
        alone = HybridDriver(loaded.model)
        alone.step([Chunk(PROMPT[:tokens], 0, -1, [(tokens, 5)], TABLE)])
        for layer in loaded.config.recurrent_layers:
            for saved, own in zip(driver.state(layer, slot), alone.state(layer, 5)):
                torch.testing.assert_close(saved, own, rtol=1e-4, atol=2e-5)
        resumed = driver.step([Chunk(PROMPT[tokens:], tokens, slot, [(53 - tokens, 6)], TABLE)])
        assert_close_logits(resumed, theirs[tokens:])


@settings(max_examples=12, deadline=None)
@given(cuts=st.lists(st.integers(1, len(PROMPT) - 1), max_size=4, unique=True),
       inner=st.lists(st.integers(1, len(PROMPT) - 1), max_size=2, unique=True))
def test_any_chunking_matches_one_pass(dense, cuts, inner):
    """The prompt cut anywhere (one-token chunks run as decodes), each chunk also saving at the `inner`
    points that fall inside it: the logits are transformers', and each inner save holds the prefix's state
    (it resumes to the same logits)."""
    _, _, loaded, theirs = dense
    driver = HybridDriver(loaded.model)
    bounds = [0, *sorted(cuts), len(PROMPT)]
    logits, saved = [], {}
    for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        points = sorted(p for p in inner if lo < p < hi)
        saves = [(p - lo, 4 + len(saved) + j) for j, p in enumerate(points)] + [(hi - lo, 0)]
        saved |= {p: slot for p, (_, slot) in zip(points, saves)}
        logits.append(driver.step([Chunk(PROMPT[lo:hi], lo, -1 if i == 0 else 0, saves, TABLE)]))
    assert_close_logits(torch.cat(logits), theirs)
    for point, slot in saved.items():
        resumed = driver.step([Chunk(PROMPT[point:], point, slot, [(len(PROMPT) - point, 1)], TABLE)])
        assert_close_logits(resumed, theirs[point:])


def test_bfloat16_follows_transformers_bfloat16(dense):
    """In bfloat16 (conv inputs kept in it, matrices in float32), chunked, near transformers' bfloat16."""
    folder, hf_model, _, _ = dense
    loaded = load_model(folder, dtype=torch.bfloat16)
    import copy

    theirs = transformers_logits(copy.deepcopy(hf_model).to(torch.bfloat16), PROMPT)
    ours = HybridDriver(loaded.model).prefill_in_pieces(PROMPT, [21, 22], TABLE)
    assert ours.dtype == torch.float32 and (ours - theirs).abs().max() < 0.05 * theirs.abs().max()


def test_decodes_batched_with_a_prefill(dense):
    """A step of two decodes and a prefill gives each sequence what it gets alone."""
    _, hf_model, loaded, theirs = dense
    other = PROMPT[::-1]
    other_logits = transformers_logits(hf_model, other)
    driver = HybridDriver(loaded.model)
    driver.step([Chunk(PROMPT[:30], 0, -1, [(30, 0)], [1, 2])])
    driver.step([Chunk(other[:40], 0, -1, [(40, 1)], [3, 4, 5])])
    logits = driver.step([Chunk(PROMPT[30:31], 30, 0, [(1, 0)], [1, 2]),
                          Chunk(other[40:41], 40, 1, [(1, 1)], [3, 4, 5])])
    assert_close_logits(logits, torch.stack([theirs[30], other_logits[40]]))
    logits = driver.step([Chunk(PROMPT[31:], 31, 0, [(22, 0)], [1, 2, 7, 8]),
                          Chunk(other[41:42], 41, 1, [(1, 1)], [3, 4, 5])])
    assert_close_logits(logits, torch.cat([theirs[31:], other_logits[41:42]]))


def settle_case(driver: HybridDriver, length: int, checkpoint: int | None, num_kept: int) -> None:
    """A held row of `length` tokens after 20 computed ones (their state in slot 0), beside a decode of
    another sequence, then settled at `num_kept`: its logits are those of the row computed plainly, it writes
    nothing before it is settled, and then every state it writes (its checkpoint inside the kept tokens,
    its final state) is the one a plain step of the kept tokens writes."""
    other = PROMPT[::-1]
    driver.step([Chunk(PROMPT[:20], 0, -1, [(20, 0)], [1, 2]), Chunk(other[:9], 0, -1, [(9, 1)], [5])])
    row = PROMPT[20:20 + length]
    saves = ([(checkpoint, 3)] if checkpoint else []) + [(length, 4)]
    plain = driver.step([Chunk(row, 20, 0, [(c, slot + 6) for c, slot in saves], [1, 2, 3]),
                         Chunk(other[9:10], 9, 1, [(1, 5)], [5])])
    layer = driver.model.config.recurrent_layers[0]
    before = {slot: driver.state(layer, slot) for slot in (3, 4)}
    held = driver.step([Chunk(row, 20, 0, saves, [1, 2, 3], held=True), Chunk(other[9:10], 9, 1, [(1, 6)], [5])])
    assert_close_logits(held, plain)  # (one padded recurrence, or segments: the same to rounding)
    for slot, (conv, matrix) in before.items():  # held: nothing written yet
        assert torch.equal(driver.state(layer, slot)[0], conv) and torch.equal(driver.state(layer, slot)[1], matrix)
    torch.testing.assert_close(driver.state(layer, 6)[1], driver.state(layer, 5)[1], atol=1e-5, rtol=1e-5)
    driver.settle({0: num_kept})
    # The kept tokens computed plainly, their states into slots 11 and 12 (the held row's 3 and 4, plus 8).
    reference = [(tokens, slot + 8) for tokens, slot in kept_state_slots(saves, num_kept)]
    driver.step([Chunk(row[:num_kept], 20, 0, reference, [1, 2, 3])])
    for tokens, slot in kept_state_slots(saves, num_kept):
        conv, matrix = driver.state(layer, slot + 8)
        got_conv, got_matrix = driver.state(layer, slot)
        # (the projections' rounding depends on the step's rows: the same inputs to 1e-5)
        torch.testing.assert_close(got_conv, conv, atol=1e-5, rtol=1e-5, msg=f"conv after {tokens}")
        torch.testing.assert_close(got_matrix, matrix, atol=1e-5, rtol=1e-5, msg=f"matrix after {tokens}")


@pytest.mark.parametrize(("length", "checkpoint", "num_kept"), [
    (5, None, 5), (5, None, 1), (5, None, 3),  # short rows: kept whole, its first token only, cut
    (6, 2, 4), (6, 2, 2), (6, 2, 1),  # a checkpoint inside (kept past it, on it, before it)
    (16, None, 9), (17, None, 9),  # SHORT_ROWS and one past (the prefill path)
    (20, 12, 15), (20, 12, 20),  # long rows with a checkpoint inside
])
def test_held_rows_settle_to_the_states_of_their_kept_tokens(dense, length, checkpoint, num_kept):
    settle_case(HybridDriver(dense[2].model), length, checkpoint, num_kept)


@settings(max_examples=15, deadline=None)
@given(data=st.data(), length=st.integers(2, 24))
def test_generated_held_rows_settle_to_the_states_of_their_kept_tokens(dense, data, length):
    checkpoint = data.draw(st.none() | st.integers(1, length - 1))
    settle_case(HybridDriver(dense[2].model), length, checkpoint, data.draw(st.integers(1, length)))


@pytest.mark.parametrize("tied", [False, True])
def test_multimodal_checkpoint_is_read_as_its_language_model(tmp_path, tied):
    """`Qwen3_5ForConditionalGeneration` (a tiny vision tower beside; its output head its own, or tied to
    the embeddings as the small models'): its text part gives transformers' logits, the vision tower is
    left unloaded and said so."""
    import transformers

    config = transformers.Qwen3_5Config(
        text_config=text_fields(), vision_config=dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2,
                                                      out_hidden_size=64, num_position_embeddings=16),
        tie_word_embeddings=tied)
    hf_model = save_hybrid(tmp_path, config, model_class=transformers.Qwen3_5ForConditionalGeneration)
    loaded = load_model(tmp_path, dtype=torch.float32)
    assert loaded.config.architecture == "Qwen3_5ForConditionalGeneration"
    assert loaded.config.tie_word_embeddings == tied and hasattr(loaded.model, "lm_head") != tied
    assert loaded.config.unloaded_parts == ("vision tower",)
    prompt = PROMPT[:24]
    ours = HybridDriver(loaded.model).prefill_in_pieces(prompt, [9], TABLE)
    assert_close_logits(ours, transformers_logits(hf_model, prompt))


def test_the_forward_pass_needs_the_step_states(dense):
    from localserve.models.protocol import ForwardContext

    loaded = dense[2]
    with pytest.raises(ValueError, match="layer 0 is a linear-attention layer.*ForwardContext.states"):
        loaded.model(torch.tensor([3, 4]), torch.arange(2), ForwardContext(None, None, None))
    with pytest.raises(ValueError, match=r"save points give sequences of \[4\] tokens, the batch holds 5"):
        HybridDriver(loaded.model).step([Chunk(PROMPT[:5], 0, -1, [(4, 0)], TABLE)])


def hf_dict(**changes) -> dict:
    return {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text"} | text_fields(**changes)


@pytest.mark.parametrize(("changes", "message"), [
    ({"layer_types": ["linear_attention", "mamba", "full_attention", "linear_attention"]},
     r"layer 1's type 'mamba' in layer_types is not one of linear_attention, full_attention"),
    ({"layer_types": ["linear_attention", "full_attention"]}, "layer_types has 2 entries for 4 layers"),
    ({"layer_types": ["linear_attention"] * 4}, "no full_attention layer"),
    ({"linear_num_value_heads": 3}, "linear_num_value_heads 3 must be a multiple of linear_num_key_heads 2"),
    ({"linear_key_head_dim": 0}, "key_head_dim must be >= 1"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"attn_output_gate": False}, "attn_output_gate false is not supported"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.01}},
     "partial_rotary_factor 0.01 of head_dim 32 gives 0 rotated values"),
])
def test_config_errors_name_the_field(changes, message):
    with pytest.raises(ModelConfigError, match=message):
        config_from_hf(hf_dict(**changes), source="config.json")


def test_missing_linear_field_is_named():
    config = hf_dict()
    del config["linear_num_key_heads"]
    with pytest.raises(ModelConfigError, match="missing field 'linear_num_key_heads'"):
        config_from_hf(config)


def test_layer_types_default_every_fourth_full_and_partial_rotary_from_the_top_level():
    config = hf_dict(num_hidden_layers=8, partial_rotary_factor=0.5)
    del config["layer_types"]
    read = config_from_hf(json.loads(json.dumps(config)))
    assert read.recurrent_layers == (0, 1, 2, 4, 5, 6) and read.rotary_dim == 16


@pytest.mark.parametrize(("file", "family", "recurrent", "conv_dim", "billions"), [
    ("qwen3_6_35b_a3b_config.json", "qwen3_5_moe", 30, 8192, (34.0, 35.0)),  # 3B active
    ("qwen3_6_27b_config.json", "qwen3_5", 48, 10240, (26.5, 27.0)),
])
def test_released_configs(file, family, recurrent, conv_dim, billions):
    """Qwen3.6's released config.json files: read as their text models (vision tower and MTP layers left
    unloaded), and their parameters, built on the meta device, as many as the names say (less the vision)."""
    from pathlib import Path

    from localserve.models.registry import family as family_of

    from localserve.loading.model_card import parameter_count

    text = json.loads((Path(__file__).parents[1] / "helpers" / file).read_text())
    config = config_from_hf(text)
    assert config.family == family and len(config.recurrent_layers) == recurrent
    assert config.num_layers == 4 * recurrent // 3
    assert config.attention_of(0).state.conv_dim == conv_dim and config.rotary_dim == 64
    assert config.unloaded_parts == ("vision tower", "multi-token prediction layers")
    assert config.eos_token_ids == (248044,) and not config.tie_word_embeddings
    with torch.device("meta"):
        model = family_of(family).model_class(config)
    count = sum(p.numel() for p in model.parameters())
    assert billions[0] < count / 1e9 < billions[1]
    assert parameter_count(config) == count  # the model card's count, from the config alone
