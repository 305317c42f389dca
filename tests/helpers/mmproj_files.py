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
