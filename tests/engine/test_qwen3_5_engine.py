"""The engine on tiny Qwen3.5, Qwen3.5-MoE and Qwen3-Next models (tests/helpers/hybrid_models.py: Gated DeltaNet layers
with long memory and a gated full-attention layer): greedy tokens alone equal transformers' (whole forward
passes); the same batched in prefill chunks that cut blocks and checkpoints anywhere, a shared prefix
resumed from a checkpoint, and under pressure (preemption by recompute and by swap); every
step checked (tests/helpers/engine_checks.py) and every block and state slot back at the end."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from localserve.engine.builder import build_engine
from localserve.engine.config import EngineConfig
from localserve.engine.drafting import DraftQuery
from localserve.engine.ngram_drafter import NgramDrafter
from localserve.engine.sampling_params import SamplingParams
from localserve.loading.hf import load_model
from tests.helpers.engine_checks import run_requests
from tests.helpers.hybrid_models import VOCAB, qwen3_5_config, qwen3_5_moe_config, qwen3_next_config, save_hybrid
from tests.helpers.models import write_tiny_model
from tests.helpers.oracle_drafter import OracleDrafter
from tests.helpers.spec_costs import FixedStepCost

CHECKPOINT = 32  # tokens between state checkpoints: two blocks
CONFIGS = {"qwen3_5": qwen3_5_config, "qwen3_5_moe": qwen3_5_moe_config, "qwen3_next": qwen3_next_config}


def workload(seed: int = 0, count: int = 5) -> list[tuple[list[int], SamplingParams]]:
    """Prompts of 5 to 70 tokens, every other one a prefix of one 70-token text (shared prefixes), 6 to 14
    tokens generated each."""
    rng = random.Random(seed)
    base = [rng.randrange(3, VOCAB) for _ in range(70)]
    work = []
    for index in range(count):
        length = rng.randint(5, 70)
        prompt = base[:length] if index % 2 else [rng.randrange(3, VOCAB) for _ in range(length)]
        work.append((prompt, SamplingParams(temperature=0, max_tokens=rng.randint(6, 14), ignore_eos=True)))
    return work


def run(model, work, build=None, **config) -> tuple[list[list[int]], object]:
    """Each request's tokens from an engine with `config` (every step checked; `build(model, config)` makes
    it where given), which ends with every KV block and state slot free."""
    config = {"num_kv_blocks": 64, "max_num_seqs": 4, "max_num_batched_tokens": 64,
              "state_checkpoint_tokens": CHECKPOINT, "check_integrity": True} | config
    engine = (build or (lambda model, config: build_engine(model, None, config)))(model, EngineConfig(**config))
    results = run_requests(engine, work, check=True)
    assert engine.block_manager.num_used_blocks == 0
    return [list(result.outputs[0].token_ids) for result in results], engine


@pytest.fixture(scope="module", params=list(CONFIGS))
def models(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf_model = save_hybrid(folder, CONFIGS[request.param]())
    return hf_model, load_model(folder, dtype=torch.float32).model


@pytest.fixture(scope="module")
def alone(models):
    return [run(models[1], [item], max_num_seqs=1, enable_prefix_caching=False)[0][0] for item in workload()]


def test_alone_gives_transformers_greedy_tokens(models, alone):
    hf_model = models[0]
    for (prompt, params), tokens in zip(workload(), alone):
        with torch.no_grad():
            expected = hf_model.generate(torch.tensor([prompt]), max_new_tokens=params.max_tokens, do_sample=False,
                                         eos_token_id=None, pad_token_id=0, use_cache=False)[0, len(prompt):]
        assert tokens == expected.tolist()


def test_batched_in_unaligned_chunks_with_prefix_caching_equals_alone(models, alone):
    """Chunks of 13 tokens start and end inside blocks and across checkpoints; shared prefixes resume from
    a checkpoint."""
    tokens, engine = run(models[1], workload(), max_num_batched_tokens=13, enable_prefix_caching=True)
    assert tokens == alone
    assert max(step.num_seqs for step in engine.step_history) > 1


def test_a_shared_prefix_resumes_from_a_checkpoint(models):
    """A second prompt sharing 70 tokens with a first one resumes from the state saved after 64 (the last
    checkpoint in the shared part) and gives transformers' tokens."""
    hf_model, model = models
    rng = random.Random(4)
    first = [rng.randrange(3, VOCAB) for _ in range(75)]
    second = first[:70] + [rng.randrange(3, VOCAB) for _ in range(9)]
    engine = build_engine(model, None, EngineConfig(num_kv_blocks=64, max_num_seqs=1, max_num_batched_tokens=64,
                                                    state_checkpoint_tokens=CHECKPOINT, check_integrity=True))
    _, reused = run_requests(engine, [(first, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)),
                                      (second, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))],
                             check=True)  # one after the other (one sequence at a time)
    assert reused.num_cached_tokens == 64
    with torch.no_grad():
        expected = hf_model.generate(torch.tensor([second]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                                     pad_token_id=0, use_cache=False)[0, len(second):]
    assert list(reused.outputs[0].token_ids) == expected.tolist()


def test_preemption_keeps_greedy_output(models):
    """Short prompts that grow past a pool of 6 blocks: sequences are preempted (their states recomputed, or
    swapped out and in with their KV) and still give what a roomy pool gives."""
    rng = random.Random(6)
    work = [([rng.randrange(3, VOCAB) for _ in range(rng.randint(5, 20))],
             SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)) for _ in range(4)]
    expected, _ = run(models[1], work, num_kv_blocks=64)
    for mode in ("recompute", "swap"):
        tokens, engine = run(models[1], work, num_kv_blocks=6, num_cpu_blocks=32, max_num_batched_tokens=24,
                             preemption_mode=mode)
        assert engine.num_preemptions > 0, mode
        assert tokens == expected, mode


@pytest.mark.parametrize(("budget", "prefix_caching"), [(64, True), (13, False)])
def test_verified_drafts_keep_greedy_output(models, budget, prefix_caching):
    """Drafts are verified over the recurrent layers too: a rejected drafted token must leave no trace in
    their states (the runner writes the states of the kept tokens only, after the verification), so the
    tokens equal those without speculation, batched, in chunks off the blocks. The drafter drafts the known
    greedy continuation with planted wrong tokens (tests/helpers/oracle_drafter.py): whole drafts kept,
    drafts cut inside, drafts rejected at once."""
    work = [(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)) for prompt, _ in workload(seed=3)]
    expected, _ = run(models[1], work, max_num_seqs=1, enable_prefix_caching=False)
    oracle = OracleDrafter([prompt + tokens for (prompt, _), tokens in zip(work, expected)], VOCAB, seed=budget)
    kept = Counter()

    def build(model, config):
        engine = build_engine(model, None, config)
        engine.scheduler.speculation.drafter = oracle
        engine.scheduler.speculation.cost = FixedStepCost()  # drafts whatever this machine's speed
        settle = engine.scheduler.speculation.settle
        engine.scheduler.speculation.settle = lambda seq, drafted, accepted: (
            kept.update([(drafted, accepted)]), settle(seq, drafted, accepted))
        return engine

    tokens, engine = run(models[1], work, spec_type="ngram", spec_tokens=4, max_num_batched_tokens=budget,
                         enable_prefix_caching=prefix_caching, build=build)
    assert tokens == expected
    assert oracle.num_planted > 0
    # Drafts rejected at once, cut inside, kept whole (which cuts: the cost model picks the drafts' lengths).
    assert any(accepted == 0 for _, accepted in kept) and any(accepted == drafted for drafted, accepted in kept)
    assert any(0 < accepted < drafted for drafted, accepted in kept)


def drafts_something(tokens: list[int], prompt_len: int) -> bool:
    """Whether the n-gram drafter would draft at some decode of this whole token list (prompt and output)."""
    return any(NgramDrafter().propose([DraftQuery(0, tokens[:end], prompt_len, 4, SamplingParams())])[0].token_ids
               for end in range(prompt_len + 1, len(tokens)))


def test_ngram_speculation_keeps_greedy_output(models):
    """The n-gram drafter on prompts that repeat a stretch of text, the first whose greedy output it drafts
    for (found by running the drafter over the output without speculation): the tokens are those without it."""
    for seed in range(40):
        rng = random.Random(seed)
        stretch = [rng.randrange(3, VOCAB) for _ in range(12)]
        work = [(stretch * 3, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))]
        [expected], _ = run(models[1], work, max_num_seqs=1, enable_prefix_caching=False)
        if drafts_something(work[0][0] + expected, len(work[0][0])):
            break
    else:
        pytest.fail("no prompt found whose greedy output the n-gram drafter drafts for")
    [tokens], engine = run(models[1], work, spec_type="ngram", spec_tokens=4)
    assert tokens == expected
    assert engine.scheduler.speculation.totals.num_draft_tokens > 0


def test_a_draft_model_of_attention_layers_drafts_for_a_hybrid_target(models, tmp_path):
    """A plain draft model (a tiny Qwen3 of the same vocabulary: its own KV pool, no states) drafts for the
    hybrid target: its drafts are verified over the target's recurrent layers and the tokens are those
    without speculation."""
    write_tiny_model(tmp_path, "qwen3", vocab_size=VOCAB)
    draft = load_model(tmp_path, dtype=torch.float32).model
    work = [(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)) for prompt, _ in workload(seed=5)]
    expected, _ = run(models[1], work, max_num_seqs=1, enable_prefix_caching=False)

    def build(model, config):
        engine = build_engine(model, None, config, draft_model=draft)
        engine.scheduler.speculation.cost = FixedStepCost()
        return engine

    tokens, engine = run(models[1], work, build=build, spec_type="draft", spec_tokens=3)
    assert tokens == expected
    assert engine.scheduler.speculation.totals.num_draft_tokens > 0


def assert_same_greedy_run(expected, got, tolerance: float, tie: float = 0.1) -> None:
    """Each request's tokens equal while the reference's top two are at least `tie` apart (a nearer tie may go
    either way under other rounding), and their logprobs within `tolerance` there."""
    for want, have in zip(expected, got, strict=True):
        want, have = want.outputs[0], have.outputs[0]
        for step, (top, token) in enumerate(zip(want.top_logprobs, want.token_ids)):
            if top[0][1] - top[1][1] < tie:
                break
            assert have.token_ids[step] == token, step
            assert abs(have.logprobs[step] - want.logprobs[step]) < tolerance, step


def cuda_run(folder, dtype: torch.dtype, work, torch_delta_rule: bool = False, drafts=None, **config) -> list:
    """The requests' outputs on a CUDA engine over the model in `folder`: the gated delta rule through the
    kernels (fla-core's chunked form, our recurrent ones), or in torch (`torch_delta_rule`: on the same device,
    every other operation the same); `drafts`: whole token lists an oracle drafts from (speculation on)."""
    import localserve.models.layers.gated_delta as gated_delta

    config = {"num_kv_blocks": 64, "max_num_seqs": 4, "max_num_batched_tokens": 13,
              "state_checkpoint_tokens": CHECKPOINT, "check_integrity": True} | config
    engine = build_engine(load_model(folder, dtype=dtype, device="cuda").model, None, EngineConfig(**config))
    if drafts is not None:
        engine.scheduler.speculation.drafter = OracleDrafter(drafts, VOCAB, seed=2)
        engine.scheduler.speculation.cost = FixedStepCost()
    with pytest.MonkeyPatch.context() as patch:
        if torch_delta_rule:
            patch.setattr(gated_delta, "_backend", lambda value, backend, **_: "torch")
        outputs = run_requests(engine, work, check=True)
    if drafts is not None:
        totals = engine.scheduler.speculation.totals
        assert 0 < totals.num_accepted_tokens < totals.num_draft_tokens
    return outputs


@pytest.mark.gpu
def test_on_cuda_the_kernels_give_the_torch_delta_rules_tokens(tmp_path):
    """On CUDA in bfloat16 (states in float32), batched with prefill chunks off the blocks and checkpoints:
    the gated delta rule through fla-core's chunked kernel and our in-place decode kernel over the state pool
    gives the tokens and logprobs it gives in torch on the same device (every other operation the same; a
    float32 CPU reference would differ by bfloat16's own rounding, which picks other tokens for these wide
    random models)."""
    save_hybrid(tmp_path, qwen3_5_config())
    work = [(prompt, SamplingParams(temperature=0, max_tokens=params.max_tokens, ignore_eos=True, logprobs=2))
            for prompt, params in workload(seed=7, count=4)]
    expected = cuda_run(tmp_path, torch.bfloat16, work, torch_delta_rule=True)
    # fla's chunked form sums in another order and may round intermediates to the inputs' bfloat16 (not measured
    # yet): a margin above rounding alone, far tighter than a wrong state (whole nats on these wide models)
    assert_same_greedy_run(expected, cuda_run(tmp_path, torch.bfloat16, work), tolerance=0.15, tie=0.25)


@pytest.mark.gpu
def test_on_cuda_verified_drafts_keep_the_tokens_without_drafts(tmp_path):
    """On CUDA (float32), verify rows held and settled through the kernels (one padded recurrence per step
    and per settle): with oracle drafts kept whole, cut and rejected, each request's tokens and logprobs are
    those of the same CUDA engine without speculation."""
    save_hybrid(tmp_path, qwen3_5_config())
    work = [(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2))
            for prompt, _ in workload(seed=8, count=4)]
    expected = cuda_run(tmp_path, torch.float32, work)
    drafts = [prompt + list(out.outputs[0].token_ids) for (prompt, _), out in zip(work, expected)]
    got = cuda_run(tmp_path, torch.float32, work, drafts=drafts, spec_type="ngram", spec_tokens=4)
    assert_same_greedy_run(expected, got, tolerance=0.02)  # cuDNN's convolutions may round through TF32
