#!/usr/bin/env bash
# The GPU check (issues #12 and #18): on a fresh checkout on a CUDA machine with no package registry,
# installs offline what scripts/prepare_gpu_carry.sh put in .gpu_carry/, runs the kernel tests natively on
# CUDA and the gpu-marked tests, then scripts/bench_kernels.py, and writes one Markdown report:
# $OUT/gpu_report.md under the device tool, else scripts/out/gpu_report.md. Each stage has a time limit,
# so the check ends within about 9 minutes, Triton's compiles included, and the report is written even
# when a stage fails or runs out of time. One part of it runs in about half that:
#   scripts/gpu_check.sh [all | attention | gguf]    attention: the paged KV kernels (#12);
#                                                   gguf: the quantized-weight kernels (#18); default all
#   scripts/gpu_check.sh tests                       the two test stages of all, without the benchmarks
#   scripts/gpu_check.sh speculation                 speculative decoding (#26): its gpu-marked tests (verify
#                                                   rows through Triton) and scripts/bench_speculative.py on
#                                                   CUDA at batch 1, 8 and 32 (needs the --stash call first)
#   scripts/gpu_check.sh window                      sliding windows, sinks, head sizes 256 / 512, keys as values
#                                                   (#36): their kernel tests natively on CUDA, cuda_compile's
#                                                   geometry variants for this GPU, and
#                                                   scripts/bench_window_attention.py (window decode bandwidth,
#                                                   sinks; the tiles a window decode visits, flat in the
#                                                   context); at most about 7 minutes; one call carrying
#                                                   .gpu_carry/wheels, no --stash call; its benchmark
#                                                   (--quick) is also part of attention and all. Checked
#                                                   without a GPU by
#                                                   `scripts/bench_window_attention.py --dry-run`
#   scripts/gpu_check.sh delta                       the gated delta rule (#37): its kernel tests natively on CUDA
#                                                   (our recurrent kernel over state slots; fla-core's chunked
#                                                   prefill, gpu-marked), the recurrent kernel compiled for this
#                                                   GPU, and scripts/bench_delta_rule.py (decode over batch
#                                                   sizes, a 4096-token prefill; torch beside the kernels,
#                                                   Qwen3.6-35B-A3B's shapes; exits 1 on a mismatch); at most
#                                                   about 8 minutes; one call carrying .gpu_carry/wheels
#                                                   (fla-core, einops), no --stash call; not part of all.
#                                                   Checked without a GPU by
#                                                   `scripts/bench_delta_rule.py --dry-run`
#   scripts/gpu_check.sh moe                         the fused mixture-of-experts kernels (#35): their tests
#                                                   natively on CUDA and scripts/bench_moe.py --device cuda
#                                                   (Qwen3-30B-A3B's layer, Q4_K_M-mixed experts); at most
#                                                   about 5 minutes; one call carrying .gpu_carry/wheels (gguf
#                                                   for the tests), no --stash call; not part of all
#
# The device tool carries at most 64 MiB per call and the default model's GGUF is 94 MiB, so the check
# takes two calls back to back (the second while the machine is still warm, i.e. within 30 s):
#   1. carry [".gpu_carry/gguf_part1"]                                      command: scripts/gpu_check.sh --stash
#   2. carry [".gpu_carry/wheels", ".gpu_carry/gguf_part2", ".gpu_carry/SHA256SUMS"]  command: scripts/gpu_check.sh
# (the second call may name a part: scripts/gpu_check.sh gguf). Without the first call the check still
# runs; the tests that need the default model are skipped.
set -uo pipefail
cd "$(dirname "$0")/.."
STASH=/tmp/localserve-carry  # outlives a call on a warm machine
MODEL=SmolLM2-135M-Instruct.Q4_1.gguf
if [ "${1:-}" = "--stash" ]; then
    mkdir -p "$STASH" && cp .gpu_carry/gguf_part1/"$MODEL".part1 "$STASH"/ && ls -l "$STASH"
    exit
fi
PART=${1:-all}
GGUF_KERNEL_TESTS=tests/kernels/test_gguf_matmul.py
GGUF_GPU_TESTS=tests/loading/test_gguf_quantized.py
MOE_KERNEL_TESTS=(tests/kernels/test_fused_moe.py tests/kernels/test_moe_experts.py)
NOT_MOE=(--ignore="${MOE_KERNEL_TESTS[0]}" --ignore="${MOE_KERNEL_TESTS[1]}")
case "$PART" in
    all) kernel_tests=(tests/kernels "${NOT_MOE[@]}"); sections=attention,gguf,model ;;
    attention) kernel_tests=(tests/kernels --ignore="$GGUF_KERNEL_TESTS" "${NOT_MOE[@]}"); sections=attention,model ;;
    gguf) kernel_tests=("$GGUF_KERNEL_TESTS"); sections=gguf,model ;;
    tests) kernel_tests=(tests/kernels "${NOT_MOE[@]}"); sections="" ;;
    speculation|moe|window|delta) kernel_tests=(); sections="" ;;
    *) echo "usage: $0 [--stash | all | attention | gguf | tests | speculation | moe | window | delta]" >&2
       exit 2 ;;
esac

REPORT=${OUT:-scripts/out}/gpu_report.md
mkdir -p "$(dirname "$REPORT")"
export PYTHONUNBUFFERED=1
# Nothing can be fetched there: make the hub and pip fail at once instead of retrying for minutes.
export HF_HUB_OFFLINE=1 PIP_NO_INDEX=1
started=$SECONDS
# A test stage that runs out of time gets SIGINT, so pytest still prints which tests failed and the slowest.
run_tests() { local limit=$1; shift
    timeout -s INT -k 20 "$limit" python3 -m pytest -q -p no:cacheprovider --tb=short --durations=10 \
        --continue-on-collection-errors "$@" 2>&1 | fenced 80; }
section() { printf '\n## %s\n\n' "$1" >> "$REPORT"; echo "== $1" >&2; }
fenced() { { echo '```'; tail -n "${1:-60}"; echo '```'; } >> "$REPORT"; }
# bench SECONDS SCRIPT ARGS...: its tables (written row by row to --out) into the report, and its last
# errors if it fails or runs out of time.
bench() {
    local limit=$1 script=$2 out status
    shift 2
    out=$(mktemp)
    timeout "$limit" python3 "$script" "$@" --out "$out" > /dev/null 2> "$out.log"
    status=$?
    if [ -s "$out" ]; then cat "$out" >> "$REPORT"; fi
    if [ $status -ne 0 ]; then echo "$script exited with $status; its last rows and errors:" >> "$REPORT"
        fenced 30 < "$out.log"; fi
}

echo "# GPU check ($PART), $(date -u +%Y-%m-%dT%H:%MZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')" \
    > "$REPORT"
section "Machine"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import sys, torch, triton; print('python', sys.version.split()[0], '| torch', torch.__version__,
'| cuda', torch.version.cuda, '| triton', triton.__version__)"; } 2>&1 | fenced

section "Offline install"
{ python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu_carry/wheels/*.whl \
  && python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . \
  && echo "installed: $(ls .gpu_carry/wheels | tr '\n' ' ')"; } 2>&1 | fenced 20
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}

export LOCALSERVE_CACHE=/tmp/localserve-cache  # where resolve_default_model() looks for the GGUF
if [ -f "$STASH/$MODEL.part1" ] && [ -f ".gpu_carry/gguf_part2/$MODEL.part2" ]; then
    mkdir -p "$LOCALSERVE_CACHE"
    cat "$STASH/$MODEL.part1" ".gpu_carry/gguf_part2/$MODEL.part2" > "$LOCALSERVE_CACHE/$MODEL"
    (cd "$LOCALSERVE_CACHE" && sha256sum -c "$OLDPWD/.gpu_carry/SHA256SUMS") 2>&1 | fenced 2
else
    echo "The default model's GGUF is not here (run the --stash call first): its tests are skipped." >> "$REPORT"
fi

SPEC_GPU_TESTS=tests/engine/test_speculative_greedy.py
if [ "$PART" = speculation ]; then
    section "Speculative decoding: gpu-marked tests ($SPEC_GPU_TESTS)"
    run_tests 120 -m gpu "$SPEC_GPU_TESTS"
    section "Speculative decoding: scripts/bench_speculative.py --device cuda --batches 1 8 32"
    timeout 300 python3 scripts/bench_speculative.py --device cuda --batches 1 8 32 --prompts-per-cell 2 \
        --max-tokens 256 --json "$(realpath -m "$(dirname "$REPORT")")/speculative_cuda" 2>&1 | grep -v '^loading' | fenced 40
    printf '\nWhole check: %d s.\n' $((SECONDS - started)) >> "$REPORT"
    echo "report: $REPORT" >&2
    exit
fi

if [ "$PART" = moe ]; then
    section "MoE kernel tests, natively on CUDA (${MOE_KERNEL_TESTS[*]})"
    run_tests 150 "${MOE_KERNEL_TESTS[@]}"
    section "MoE benchmark (scripts/bench_moe.py --device cuda)"
    bench 120 scripts/bench_moe.py --device cuda
    printf '\nWhole check: %d s.\n' $((SECONDS - started)) >> "$REPORT"
    echo "report: $REPORT" >&2
    exit
fi

DELTA_KERNEL_TESTS=(tests/kernels/test_gated_delta.py
                    "tests/engine/test_qwen3_5_engine.py::test_on_cuda_the_kernels_give_the_torch_delta_rules_tokens"
                    "tests/engine/test_qwen3_5_engine.py::test_on_cuda_verified_drafts_keep_the_tokens_without_drafts")
if [ "$PART" = delta ]; then
    section "Gated delta rule kernel tests, natively on CUDA, gpu-marked included (${DELTA_KERNEL_TESTS[*]})"
    (cd /tmp && python3 -c "from localserve.kernels.gated_delta import fla_chunk_function as f; import fla
print('fla-core', fla.__version__, 'imports' if f() else 'does NOT import: the chunked prefill runs torch')") \
        2>&1 | tail -n 3 | fenced 3
    run_tests 240 "${DELTA_KERNEL_TESTS[@]}"
    section "Recurrent kernel compiled for this GPU (tests/kernels/cuda_compile.py --only delta)"
    arch=$(python3 -c "import torch; major, minor = torch.cuda.get_device_capability(); print(10 * major + minor)")
    timeout 120 python3 tests/kernels/cuda_compile.py --only delta --arch "$arch" 2>&1 \
        | grep -E "^(FAILED|ok _fused|[0-9]+ kernels)" | fenced 20
    section "Gated delta rule benchmark (scripts/bench_delta_rule.py --device cuda)"
    bench 150 scripts/bench_delta_rule.py --device cuda
    printf '\nWhole check: %d s.\n' $((SECONDS - started)) >> "$REPORT"
    echo "report: $REPORT" >&2
    exit
fi

WINDOW_KERNEL_TESTS=(tests/kernels/test_paged_attention_geometry.py)
window_section() {
    if [ "$PART" = window ]; then
        section "Window / sink / head-size kernel tests, natively on CUDA (${WINDOW_KERNEL_TESTS[*]})"
        run_tests 120 "${WINDOW_KERNEL_TESTS[@]}"
        section "Geometry kernels compiled for this GPU (tests/kernels/cuda_compile.py --only attention-geometry)"
        local arch
        arch=$(python3 -c "import torch; major, minor = torch.cuda.get_device_capability(); print(10 * major + minor)")
        timeout 150 python3 tests/kernels/cuda_compile.py --only attention-geometry --arch "$arch" 2>&1 \
            | grep -E "^(FAILED|ok _paged|[0-9]+ kernels)" | fenced 40
    fi
    section "Window decode attention (scripts/bench_window_attention.py --device cuda${1:+ $1})"
    bench 120 scripts/bench_window_attention.py --device cuda ${1:+"$1"}
}
if [ "$PART" = window ]; then
    window_section
    printf '\nWhole check: %d s.\n' $((SECONDS - started)) >> "$REPORT"
    echo "report: $REPORT" >&2
    exit
fi

section "Kernel tests, natively on CUDA (${kernel_tests[*]})"
run_tests 200 "${kernel_tests[@]}"

section "gpu-marked tests"
mapfile -t gpu_files < <(grep -rl --include='test_*.py' 'mark.gpu' tests | grep -v '^tests/kernels/' \
    | { case "$PART" in gguf) grep -x "$GGUF_GPU_TESTS" ;; attention) grep -vx "$GGUF_GPU_TESTS" ;; *) cat ;; esac; })
if [ ${#gpu_files[@]} -gt 0 ]; then
    run_tests 120 -m gpu "${gpu_files[@]}"
else
    echo "none outside tests/kernels" >> "$REPORT"
fi

if [ -z "$sections" ]; then
    printf '\nWhole check: %d s.\n' $((SECONDS - started)) >> "$REPORT"
    echo "report: $REPORT" >&2
    exit
fi
section "Benchmarks (scripts/bench_kernels.py --sections $sections)"
bench 240 scripts/bench_kernels.py --sections "$sections"
case "$sections" in *attention*) window_section --quick ;; esac

printf '\nWhole check: %d s.\n' $((SECONDS - started)) >> "$REPORT"
echo "report: $REPORT" >&2
