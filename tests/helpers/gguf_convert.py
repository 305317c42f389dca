"""GGUF files made by llama.cpp's own converter (convert_hf_to_gguf.py, from the llama-cpp-python sdist) out
of a tiny model's save_pretrained folder, and GGUF files rewritten with some tensors in other types.

The converter needs a tokenizer. Families it reads through sentencepiece (Phi-3) get a small sentencepiece
model trained here (`write_spm_tokenizer`). Families it reads only as byte-level BPE (Qwen3-MoE, ...) get
a small BPE tokenizer (`write_bpe_tokenizer`), and the converter names a BPE tokenizer's pre-tokenizer by a
hash of how it splits a fixed text, which no tiny tokenizer matches: for those it runs as is, from a
wrapper that tells its one lookup (`TextModel.get_vocab_base_pre`) the name to write.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np

from tests.helpers.llama_cpp_files import converter_path

TRAINING_TEXT = """\
A small server for language models keeps its memory in blocks of sixteen tokens. The workshop at the end of
the lane repairs bicycles, clocks and old radios. How much rain falls in a year depends on where the clouds
meet the mountains. Grandmother's recipe for bread asks for flour, water, salt and patience. Open the
settings, choose the network, enter the password twice, then restart the device. {"name": "get_weather",
"arguments": {"city": "Paris", "unit": "celsius"}} <tool_call> </tool_call> 0123456789 +-*/=()[]{}<>_|#@!?;:'
"""


def write_spm_tokenizer(folder: Path, vocab_size: int) -> None:
    """A sentencepiece BPE tokenizer of `vocab_size` pieces (ids 0-2: <unk>, <s>, </s>) as tokenizer.model."""
    import sentencepiece

    lines = [line for line in TRAINING_TEXT.splitlines() if line] * 4
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_prefix=str(folder / "tokenizer"), vocab_size=vocab_size,
        model_type="bpe", character_coverage=1.0, hard_vocab_limit=False, minloglevel=2, bos_id=1, eos_id=2,
        unk_id=0, pad_id=-1)
    (folder / "tokenizer.vocab").unlink()


def write_bpe_tokenizer(folder: Path, vocab_size: int, special_tokens: list[str]) -> None:
    """A byte-level BPE tokenizer of at most `vocab_size` tokens, `special_tokens` first, as tokenizer.json
    and tokenizer_config.json."""
    from tests.helpers.tokenizers import train_bpe

    backend = train_bpe(special_tokens, vocab_size)
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": special_tokens[-1],
        "added_tokens_decoder": {str(i): {"content": token, "special": True, "lstrip": False, "rstrip": False,
                                          "normalized": False, "single_word": False}
                                 for i, token in enumerate(special_tokens)}}))


WRAPPER = """\
import runpy, sys
sys.path[:0] = [{folder!r}, {gguf_py!r}]
import conversion.base
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: {pre!r}
sys.argv = {argv!r}
runpy.run_path({script!r}, run_name="__main__")
"""


def convert(folder: Path, out: Path, *args: str, pre_tokenizer: str | None = None) -> Path:
    """Run convert_hf_to_gguf.py on `folder` writing `out`; extra `args` (`--outtype f32`,
    `--fuse-gate-up-exps`, ...); `pre_tokenizer`: the name its BPE lookup gives (see above). Fails the test
    with the converter's own last words."""
    script = converter_path()
    argv = [str(script), str(folder), "--outfile", str(out), *args]
    command = [sys.executable, *argv]
    if pre_tokenizer is not None:
        wrapper = out.with_suffix(".convert.py")
        wrapper.write_text(WRAPPER.format(folder=str(script.parent), gguf_py=str(script.parent / "gguf-py"),
                                          pre=pre_tokenizer, argv=argv, script=str(script)))
        command = [sys.executable, str(wrapper)]
    # The converter imports its `conversion` package from its own folder: the script's folder must stay on
    # sys.path (PYTHONSAFEPATH, which tests/conftest.py sets, would take it off).
    env = {name: value for name, value in os.environ.items() if name != "PYTHONSAFEPATH"}
    result = subprocess.run(command, capture_output=True, text=True, cwd=out.parent, env=env)
    if result.returncode != 0:
        raise AssertionError(f"convert_hf_to_gguf.py failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return out


Change = Callable[[str, np.ndarray], list[tuple[str, np.ndarray, object]] | None]


def rewrite_gguf(source: Path, out: Path, change: Change = lambda name, values: None,
                 metadata: dict | None = None, architecture: str | None = None) -> Path:
    """A copy of the GGUF `source` with its metadata and tensor order, where `change(name, float32 values)`
    may return the tensors [(name, data, GGML type)] that replace that one ([]: drop it; None: keep it);
    `metadata` overrides values of existing keys; `architecture` renames general.architecture (not its keys)."""
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(str(out), architecture or reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        value = (metadata or {}).get(field.name, field.contents())
        writer.add_key_value(field.name, value, value_type, sub_type=sub_type)
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        changed = change(tensor.name, values)
        if changed is None:
            writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=tensor.tensor_type)
            continue
        for name, data, qtype in changed:
            writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
