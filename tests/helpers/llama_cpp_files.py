"""llama.cpp's chat templates, vocabularies and converter, taken from the llama-cpp-python sdist on PyPI once
per machine.

llama.cpp keeps the chat templates of many model families (`models/templates/*.jinja`), the vocabularies
of their tokenizers (`models/ggml-vocab-*.gguf`, metadata only) and its Hugging Face -> GGUF converter
(`convert_hf_to_gguf.py` with its `conversion/` and `gguf-py/` folders) in its repository, and
llama-cpp-python's sdist vendors that repository. The sdist is downloaded with `pip download --no-deps
--no-binary :all:` (never installed), only the files and folders named below are extracted, and they are
kept under localserve's cache folder like the default model. A test that needs them is skipped, with the
reason, only when PyPI cannot be reached.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import tempfile
from functools import cache
from pathlib import Path

import pytest

from localserve.loading.default_model import cache_dir

SDIST_VERSION = "0.3.36"
SDIST_REQUIREMENT = f"llama-cpp-python=={SDIST_VERSION}"
MODELS_IN_SDIST = f"llama_cpp_python-{SDIST_VERSION}/vendor/llama.cpp/models"
TEMPLATES = (
    "Qwen-Qwen2.5-7B-Instruct.jinja", "Qwen-Qwen3-0.6B.jinja", "Qwen3-Coder.jinja", "Qwen-QwQ-32B.jinja",
    "meta-llama-Llama-3.1-8B-Instruct.jinja", "meta-llama-Llama-3.2-3B-Instruct.jinja",
    "meta-llama-Llama-3.3-70B-Instruct.jinja", "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja",
    "mistralai-Mistral-Nemo-Instruct-2407.jinja", "Mistral-Small-3.2-24B-Instruct-2506.jinja",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", "microsoft-Phi-3.5-mini-instruct.jinja",
    "mistralai-Ministral-3-14B-Reasoning-2512.jinja", "unsloth-mistral-Devstral-Small-2507.jinja",
    "openai-gpt-oss-120b.jinja",
    "google-gemma-4-31B-it.jinja", "Qwen3.5-4B.jinja",
)
VOCABULARIES = ("ggml-vocab-qwen2.gguf", "ggml-vocab-llama-bpe.gguf", "ggml-vocab-llama-spm.gguf",
                "ggml-vocab-gemma-4.gguf", "ggml-vocab-qwen35.gguf")
# llama.cpp's tokenizer cases beside a vocabulary: `<vocab>.inp` (texts between VOCABULARY_CASE_SEPARATOR lines)
# and `<vocab>.out` (one line of token ids per text, as the model's Hugging Face tokenizer encodes it).
VOCABULARY_CASES = ("ggml-vocab-qwen35.gguf",)
VOCABULARY_CASE_SEPARATOR = "\n__ggml_vocab_test__\n"
MEMBERS = {f"{MODELS_IN_SDIST}/templates/{name}": f"templates/{name}" for name in TEMPLATES} | {
    f"{MODELS_IN_SDIST}/{name}": f"vocab/{name}" for name in VOCABULARIES} | {
    f"{MODELS_IN_SDIST}/{name}{suffix}": f"vocab/{name}{suffix}" for name in VOCABULARY_CASES
    for suffix in (".inp", ".out")}
# Folders taken whole (every member under the prefix), under converter/, and the file that says they are there.
LLAMA_CPP_IN_SDIST = f"llama_cpp_python-{SDIST_VERSION}/vendor/llama.cpp"
TREES = {f"{LLAMA_CPP_IN_SDIST}/{name}": f"converter/{name}" for name in ("conversion/", "gguf-py/")} | {
    f"{LLAMA_CPP_IN_SDIST}/convert_hf_to_gguf.py": "converter/convert_hf_to_gguf.py"}
CONVERTER = "converter/convert_hf_to_gguf.py"


def files_dir() -> Path:
    """Where the extracted files are kept: `<cache>/llama-cpp-python-<version>/{templates,vocab}/`."""
    return cache_dir() / f"llama-cpp-python-{SDIST_VERSION}"


@cache
def _fetch() -> Path | str:
    """The folder, fetched on first use, or why it could not be (kept, so that a machine without PyPI tries once).

    A folder that lacks any file of the lists (one extracted when the lists were shorter) is extracted anew,
    whole, from the same sdist, keeping the files tests wrote there."""
    folder = files_dir()
    if all((folder / path).is_file() for path in [*MEMBERS.values(), CONVERTER]):
        return folder
    with tempfile.TemporaryDirectory(prefix="localserve-llama-cpp-") as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--retries", "1",
                   "--timeout", "30", "--dest", tmp, SDIST_REQUIREMENT]
        result = subprocess.run(command, capture_output=True, text=True)
        sdists = list(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        if result.returncode != 0 or not sdists:
            last_line = (result.stderr.strip().splitlines() or [""])[-1]
            return f"cannot download {SDIST_REQUIREMENT} from PyPI (pip exit {result.returncode}): {last_line}"
        staging = Path(tmp) / "extracted"
        with tarfile.open(sdists[0]) as sdist:
            for member, target in MEMBERS.items():
                source = sdist.extractfile(member)
                if source is None:
                    raise FileNotFoundError(f"{sdists[0].name} has no {member}")
                (staging / target).parent.mkdir(parents=True, exist_ok=True)
                (staging / target).write_bytes(source.read())
            for member in sdist.getmembers():
                prefix = next((p for p in TREES if member.name.startswith(p)), None)
                if prefix is None or not member.isfile():
                    continue
                target = staging / (TREES[prefix] + member.name[len(prefix):])
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(sdist.extractfile(member).read())
        folder.parent.mkdir(parents=True, exist_ok=True)
        if folder.is_dir():  # keep what tests derived from the older extraction (tokenizer metadata read once)
            for kept in folder.rglob("*"):
                if kept.is_file() and not (staging / kept.relative_to(folder)).exists():
                    (staging / kept.relative_to(folder)).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(kept, staging / kept.relative_to(folder))
        partial = folder.with_name(folder.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        shutil.move(staging, partial)
        shutil.rmtree(folder, ignore_errors=True)
        partial.replace(folder)  # all files or none: a crash never leaves half a folder behind
    return folder


def llama_cpp_files() -> Path:
    """The folder holding the templates and vocabularies; skips the test when PyPI is out of reach."""
    fetched = _fetch()
    if isinstance(fetched, str):
        pytest.skip(fetched)
    return fetched


def template_text(name: str) -> str:
    """One of `TEMPLATES`, as text."""
    return (llama_cpp_files() / "templates" / name).read_text(encoding="utf-8")


def vocabulary_path(name: str) -> Path:
    """One of `VOCABULARIES`."""
    return llama_cpp_files() / "vocab" / name


def vocabulary_cases(name: str) -> list[tuple[str, list[int]]]:
    """llama.cpp's tokenizer cases of one of `VOCABULARY_CASES`: each text with the ids the model's Hugging Face
    tokenizer gives it (no special tokens added)."""
    folder = llama_cpp_files() / "vocab"
    texts = (folder / f"{name}.inp").read_text(encoding="utf-8").removesuffix(VOCABULARY_CASE_SEPARATOR)
    lines = (folder / f"{name}.out").read_text(encoding="utf-8").removesuffix("\n")
    return [(text, [int(i) for i in line.split()])
            for text, line in zip(texts.split(VOCABULARY_CASE_SEPARATOR), lines.split("\n"), strict=True)]


def converter_path() -> Path:
    """llama.cpp's convert_hf_to_gguf.py, beside its conversion/ and gguf-py/ folders."""
    return llama_cpp_files() / CONVERTER
