"""llama.cpp mmproj files (the vision tower and projector of a multimodal model, as `--mmproj` takes them) made
by llama.cpp's own converter (convert_hf_to_gguf.py `--mmproj`, tests/helpers/gguf_convert.py) out of a tiny
multimodal checkpoint folder.

The converter maps the tensor names of the released checkpoints: Gemma 3's tower under
`vision_tower.vision_model.` (transformers 5 saves it as `vision_tower.`), so the folder is first rewritten
to that layout. It reads how many tokens an image becomes from the processor's `image_seq_length`
(processor_config.json, as Gemma3Processor saves it), which the folder is given when it lacks one.
"""

from __future__ import annotations

import json
import struct
import tempfile
from pathlib import Path

from safetensors.torch import load_file, save_file

from tests.helpers.gguf_convert import convert


def released_gemma3_layout(folder: Path, mm_tokens_per_image: int) -> None:
    """Rewrite a Gemma3ForConditionalGeneration folder's tensors to the released checkpoints' names
    (`vision_tower.vision_model.*`, the language model's as they are) and write the processor's
    `image_seq_length` if the folder has none."""
    for file in sorted(folder.glob("*.safetensors")):
        tensors = load_file(file)
        renamed = {}
        for name, tensor in tensors.items():
            bare = name.removeprefix("model.")
            if bare.startswith("vision_tower.") and not bare.startswith("vision_tower.vision_model."):
                name = "vision_tower.vision_model." + bare.removeprefix("vision_tower.")
            elif bare.startswith(("vision_tower.", "multi_modal_projector.")):
                name = bare
            renamed[name] = tensor
        save_file(renamed, file, metadata={"format": "pt"})
    processor = folder / "processor_config.json"
    config = json.loads(processor.read_text()) if processor.is_file() else {"processor_class": "Gemma3Processor"}
    if "image_seq_length" not in config:
        processor.write_text(json.dumps(config | {"image_seq_length": mm_tokens_per_image}))


def convert_mmproj(folder: Path, out: Path, outtype: str = "f32") -> Path:
    """The mmproj of a checkpoint folder (in the converter's `outtype`: f32, f16, bf16, q8_0), at `out`."""
    return convert(folder, out, "--outtype", outtype, "--mmproj")


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _read_varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at, shift = at + 1, shift + 7
        if not byte & 0x80:
            return value, at


def _piece(text: str, score: float, kind: int) -> bytes:
    """A ModelProto.SentencePiece: piece (1, string), score (2, float), type (3, enum)."""
    raw = text.encode("utf-8")
    body = b"\x0a" + _varint(len(raw)) + raw + b"\x15" + struct.pack("<f", score) + b"\x18" + _varint(kind)
    return b"\x0a" + _varint(len(body)) + body


SPM_NORMAL, SPM_UNKNOWN, SPM_CONTROL = 1, 2, 3  # sentencepiece's SentencePiece.Type


def write_sentencepiece_twin(folder: Path) -> None:
    """A tokenizer.model holding exactly the pieces of the folder's tokenizer.json (a sentencepiece-style BPE of
    single characters, no merges: tests/helpers/vision_models.py's), at their ids, its added special tokens as
    control pieces and its <unk> as the unknown piece, so that llama.cpp's converter, which reads Gemma 3's
    vocabulary from tokenizer.model only, writes the same vocabulary into the GGUF. The file's other parts
    (trainer and normalizer specs) come from a sentencepiece model trained here (no protobuf package needed:
    the pieces, ModelProto's field 1, are written in protobuf's wire format)."""
    from tests.helpers.gguf_convert import write_spm_tokenizer

    tokenizer = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = tokenizer["model"]["vocab"]
    special = {token["content"] for token in tokenizer["added_tokens"] if token.get("special")}
    unknown = tokenizer["model"].get("unk_token")
    pieces = sorted(vocab.items(), key=lambda item: item[1])
    assert [index for _, index in pieces] == list(range(len(pieces))), "the ids must run 0..n-1"
    with tempfile.TemporaryDirectory() as scratch:
        write_spm_tokenizer(Path(scratch), 100)
        trained = (Path(scratch) / "tokenizer.model").read_bytes()
    kept, at = bytearray(), 0
    while at < len(trained):  # every top-level field but the pieces (all length-delimited)
        start = at
        key, at = _read_varint(trained, at)
        length, at = _read_varint(trained, at)
        at += length
        if key >> 3 != 1:
            kept += trained[start:at]
    model = b"".join(_piece(text, -float(index), SPM_UNKNOWN if text == unknown else
                            SPM_CONTROL if text in special else SPM_NORMAL) for text, index in pieces)
    (folder / "tokenizer.model").write_bytes(model + bytes(kept))
