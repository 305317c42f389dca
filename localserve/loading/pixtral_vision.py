"""A Mistral3ForConditionalGeneration folder's vision encoder (models/vision/mistral3_vision.py): the
`vision_tower.*` / `multi_modal_projector.*` tensors (transformers 5 puts them under `model.`), its config's
vision fields, its image processor config (`preprocessor_config.json`, or `processor_config.json`'s
`image_processor`, with PixtralProcessor's own patch_size and spatial_merge_size), and one row of the
language model's token embeddings (the image row break's: Pixtral's span holds those tokens between the
image's rows). The language model loads apart (loading/hf.py with models/mistral3.py)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from localserve.loading.hf import safetensors_files
from localserve.loading.vision import VisionLoadError, _read_json, load_vision_weights, processor_config
from localserve.models.vision.mistral3_vision import Mistral3Vision, checkpoint_target
from localserve.models.vision.pixtral import Mistral3VisionConfig, mistral3_vision_config
from localserve.models.vision.pixtral_preprocess import PixtralImageProcessing, pixtral_image_processing

# the language model's token embeddings as transformers 5 saves them, then as earlier versions did
EMBEDDING_NAMES = ("model.language_model.embed_tokens.weight", "language_model.model.embed_tokens.weight",
                   "model.embed_tokens.weight")


def processor_fields(folder: Path) -> dict:
    """PixtralProcessor's own fields (`processor_config.json` without its image_processor part), or {}."""
    path = folder / "processor_config.json"
    fields = _read_json(path) if path.is_file() else {}
    return {key: value for key, value in fields.items() if key != "image_processor"} if isinstance(fields, dict) else {}


def folder_pixtral_processing(folder: Path, config: Mistral3VisionConfig) -> PixtralImageProcessing:
    """A folder's processing (loading/vision.py's `processor_config`), else PixtralImageProcessor's defaults
    bounded by the tower's image_size."""
    found = processor_config(folder) or ({}, str(folder))
    vision = config.vision
    return pixtral_image_processing(found[0], vision.patch_size, config.spatial_merge_size, vision.image_size,
                                    found[1], processor_fields(folder))


def token_embedding(folder: Path, token_id: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Row `token_id` of the language model's input embeddings [hidden], read alone from the folder's shards."""
    for file in safetensors_files(folder):
        try:
            with safe_open(file, framework="pt") as shard:
                name = next((name for name in EMBEDDING_NAMES if name in shard.keys()), None)  # noqa: SIM118
                if name is None:
                    continue
                table = shard.get_slice(name)
                rows = table.get_shape()[0]
                if not 0 <= token_id < rows:
                    raise VisionLoadError(f"{file}: {name} has {rows} rows; the image break token's id is {token_id}")
                return table[token_id:token_id + 1][0].to(device=device, dtype=dtype)
        except (SafetensorError, OSError) as exc:
            raise VisionLoadError(f"{file}: unreadable safetensors file ({exc})") from None
    raise VisionLoadError(f"{folder}: no token embeddings ({' or '.join(EMBEDDING_NAMES)}) in its safetensors files")


def load_mistral3_vision(folder: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                         config_dict: dict | None = None) -> Mistral3Vision:
    """The Pixtral tower and Mistral 3 projector of a Mistral3ForConditionalGeneration folder, in `dtype` on
    `device`, with the folder's image processing (`.processing`); `config_dict`: its config.json, where the
    caller has read it."""
    folder = Path(folder)
    source = folder / "config.json"
    config = mistral3_vision_config(config_dict if config_dict is not None else _read_json(source), str(source))
    processing = folder_pixtral_processing(folder, config)
    with torch.device("meta"):  # each weight is made once, in its place
        model = Mistral3Vision(config, processing).to(dtype=dtype)
    model.to_empty(device=device)
    load_vision_weights(model, folder, checkpoint_target, f"the config has {config.vision.num_layers} layers")
    return model.eval()
