"""llama.cpp's `mmproj` files: the vision tower and projector of a multimodal model, beside its language
model's .gguf (llama.cpp's `--mmproj FILE`), as its converter (convert_hf_to_gguf.py `--mmproj`) writes them.

An mmproj is a GGUF of architecture `clip`: the tower's shape under `clip.vision.*` (image and patch size,
width, layers, heads, the normalisation's mean and std), the projector's kind under `clip.projector_type`
and `clip.vision.projection_dim` = the language model's hidden size; its tensors are `v.*` (the tower) and
`mm.*` (the projector). Served here (loading/mmproj_encoders.py picks by projector): Gemma 3's (`gemma3`:
SigLIP and Gemma's pooling projector, read into models/vision/gemma3_vision.py's `GemmaVision`),
Qwen3.5's (`qwen3vl_merger`: loading/mmproj_qwen.py) and Mistral 3's (`pixtral`: loading/mmproj_pixtral.py).

What the converter changed, undone here: Gemma 3's projector norm is stored as 1 + w (llama.cpp's RMSNorm
has no offset), so the norm is built without its offset and takes the stored values as they are. Every
other tensor keeps transformers' layout (numpy's row-major order of the GGUF's reversed shape). Tensors
stored quantized or in 16 bits are de-quantized with the `gguf` package. Errors (`MmprojError`) name the
file and the key or tensor."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from localserve.loading.gguf import GGUFLoadError, open_gguf
from localserve.loading.hf import ModelLoadError
from localserve.models.config import ModelConfig
from localserve.models.vision.adapter import ImageEncoder
from localserve.models.vision.config import Gemma3VisionConfig, SiglipConfig, VisionConfigError
from localserve.models.vision.gemma3_vision import GemmaVision
from localserve.models.vision.preprocess import ImageProcessing

SERVED_PROJECTORS = ("gemma3", "qwen3vl_merger", "pixtral")
GEMMA3_SCALE_FACTOR = 4  # llama.cpp's default pooling of Gemma 3's patches: 64 x 64 -> 16 x 16 tokens
# the language model families (general.architecture of the model's .gguf) each projector feeds
PROJECTOR_LANGUAGE_MODELS = {"gemma3": ("gemma3",), "qwen3vl_merger": ("qwen35", "qwen35moe"),
                             "pixtral": ("mistral3", "llama")}  # earlier converters wrote Mistral 3 as llama
# Gemma 3's image tokens, found by their text in the language model's vocabulary
GEMMA3_IMAGE_TOKENS = {"boi": "<start_of_image>", "image": "<image_soft_token>", "eoi": "<end_of_image>"}


class MmprojError(ModelLoadError):
    """An mmproj file that cannot be served; the message names the file and the key or tensor."""


@dataclass(frozen=True)
class MmprojFile:
    """An mmproj's metadata (every `clip.*` key) and its open GGUFReader."""

    path: Path
    projector: str
    metadata: dict[str, Any]
    reader: Any

    def value(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def positive_int(self, key: str) -> int:
        """A required positive integer key, or MmprojError naming it."""
        value = self.metadata.get(key)
        if value is None:
            raise MmprojError(f"{self.path}: missing key {key}")
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
            raise MmprojError(f"{self.path}: {key} must be a positive integer; got {value!r}")
        return int(value)

    def channel_values(self, key: str) -> tuple[float, ...]:
        value = self.metadata.get(key)
        if value is None:
            raise MmprojError(f"{self.path}: missing key {key}")
        if not isinstance(value, list) or len(value) != 3 or not all(isinstance(v, float) for v in value):
            raise MmprojError(f"{self.path}: {key} must be 3 numbers (R, G, B); got {value!r}")
        return tuple(value)


def read_mmproj(path: str | Path) -> MmprojFile:
    """Open an mmproj and check that it is one (architecture `clip` with a vision encoder) of a projector
    served here."""
    path = Path(path)
    if not path.is_file():
        raise MmprojError(f"{path}: no such mmproj file")
    try:
        reader = open_gguf(path)
    except GGUFLoadError as exc:
        raise MmprojError(str(exc)) from None
    metadata = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    architecture = metadata.get("general.architecture")
    if architecture != "clip":
        raise MmprojError(f"{path}: not an mmproj file: general.architecture is {architecture!r}, an mmproj's is "
                          f"'clip' (a language model's .gguf goes to -m)")
    if metadata.get("clip.has_vision_encoder") is not True:
        raise MmprojError(f"{path}: clip.has_vision_encoder is not true: the file holds no vision encoder")
    projector = metadata.get("clip.vision.projector_type", metadata.get("clip.projector_type"))
    if projector not in SERVED_PROJECTORS:
        raise MmprojError(f"{path}: clip.projector_type {projector!r} is not served; served: "
                          f"{', '.join(SERVED_PROJECTORS)}")
    return MmprojFile(path=path, projector=projector, metadata=metadata, reader=reader)


def mmproj_weight_bytes(mmproj: MmprojFile, bytes_per_param: int = 2) -> int:
    """The encoder's weights in memory: every tensor de-quantized, at `bytes_per_param` (2: bf16 / f16)."""
    return sum(int(tensor.n_elements) for tensor in mmproj.reader.tensors) * bytes_per_param


def check_language_model(mmproj: MmprojFile, architecture: str, hidden_size: int, model: str) -> None:
    """Refuse a pair whose language model (its .gguf's `general.architecture` and hidden size; `model`
    names it) is not the one the projector feeds."""
    families = PROJECTOR_LANGUAGE_MODELS[mmproj.projector]
    if architecture not in families:
        raise MmprojError(f"{mmproj.path}: a {mmproj.projector} projector feeds a {' or '.join(families)} language "
                          f"model; {model} is a {architecture} model")
    projection = mmproj.positive_int("clip.vision.projection_dim")
    if projection != hidden_size:
        raise MmprojError(f"{mmproj.path}: clip.vision.projection_dim {projection} does not match the hidden size "
                          f"{hidden_size} of {model}")


def mmproj_siglip_config(mmproj: MmprojFile) -> SiglipConfig:
    """SigLIP's shape from `clip.vision.*`."""
    hidden, heads = mmproj.positive_int("clip.vision.embedding_length"), mmproj.positive_int(
        "clip.vision.attention.head_count")
    image_size, patch_size = mmproj.positive_int("clip.vision.image_size"), mmproj.positive_int(
        "clip.vision.patch_size")
    if hidden % heads:
        raise MmprojError(f"{mmproj.path}: clip.vision.embedding_length {hidden} is not a multiple of "
                          f"clip.vision.attention.head_count {heads}")
    if image_size % patch_size:
        raise MmprojError(f"{mmproj.path}: clip.vision.image_size {image_size} is not a multiple of "
                          f"clip.vision.patch_size {patch_size}")
    if mmproj.value("clip.use_gelu") is not True or mmproj.value("clip.use_silu"):
        raise MmprojError(f"{mmproj.path}: clip.use_gelu is not true: SigLIP's activation is gelu (tanh)")
    eps = mmproj.value("clip.vision.attention.layer_norm_epsilon", 1e-6)
    if not isinstance(eps, float) or not 0 < eps < 1:
        raise MmprojError(f"{mmproj.path}: clip.vision.attention.layer_norm_epsilon must be in (0, 1); got {eps!r}")
    patch_shape = tensor_shape(mmproj, "v.patch_embd.weight")
    if len(patch_shape) != 4:
        raise MmprojError(f"{mmproj.path}: v.patch_embd.weight has shape {list(patch_shape)}; a convolution's "
                          f"[width, channels, patch, patch] expected")
    channels = patch_shape[1]
    return SiglipConfig(hidden_size=hidden, intermediate_size=mmproj.positive_int("clip.vision.feed_forward_length"),
                        num_layers=mmproj.positive_int("clip.vision.block_count"), num_heads=heads,
                        image_size=image_size, patch_size=patch_size, num_channels=channels, layer_norm_eps=eps,
                        gelu_approximate="tanh")


def gemma3_mmproj_config(mmproj: MmprojFile, token_ids: dict[str, int]) -> Gemma3VisionConfig:
    """Gemma 3's vision config from the mmproj; `token_ids` (boi, image, eoi) come from the language model's
    vocabulary (`image_token_ids`)."""
    siglip = mmproj_siglip_config(mmproj)
    scale = mmproj.value("clip.vision.projector.scale_factor", GEMMA3_SCALE_FACTOR)
    if isinstance(scale, bool) or not isinstance(scale, int) or scale <= 0 or siglip.patches_per_side % scale:
        raise MmprojError(f"{mmproj.path}: clip.vision.projector.scale_factor {scale!r} must be a positive integer "
                          f"dividing the {siglip.patches_per_side} patches per side")
    try:
        return Gemma3VisionConfig(vision=siglip, mm_tokens_per_image=(siglip.patches_per_side // scale) ** 2,
                                  text_hidden_size=mmproj.positive_int("clip.vision.projection_dim"),
                                  image_token_id=token_ids["image"], boi_token_id=token_ids["boi"],
                                  eoi_token_id=token_ids["eoi"])
    except VisionConfigError as exc:
        raise MmprojError(f"{mmproj.path}: {exc}") from None


def mmproj_image_processing(mmproj: MmprojFile, image_size: int) -> ImageProcessing:
    """The preprocessing the mmproj describes: resized to the tower's size (bilinear, Gemma3ImageProcessor's
    and llama.cpp's filter), x 1/255, normalised by `clip.vision.image_mean` / `image_std`."""
    mean, std = mmproj.channel_values("clip.vision.image_mean"), mmproj.channel_values("clip.vision.image_std")
    if 0.0 in std:
        raise MmprojError(f"{mmproj.path}: clip.vision.image_std {list(std)} has a zero")
    return ImageProcessing(height=image_size, width=image_size, mean=mean, std=std)


def image_token_ids(vocabulary: dict[str, int], wanted: dict[str, str], source: str) -> dict[str, int]:
    """The ids of `wanted` (role -> token text) in a vocabulary (token text -> id; `source` names it)."""
    missing = [text for text in wanted.values() if text not in vocabulary]
    if missing:
        raise MmprojError(f"{source}: the vocabulary has no {', '.join(missing)} token (the image tokens of its "
                          f"vision model)")
    return {role: vocabulary[text] for role, text in wanted.items()}


def tensor_shape(mmproj: MmprojFile, name: str) -> tuple[int, ...]:
    tensor = next((t for t in mmproj.reader.tensors if t.name == name), None)
    if tensor is None:
        raise MmprojError(f"{mmproj.path}: missing tensor {name}")
    return tuple(int(d) for d in reversed(tensor.shape))


def gemma3_target(name: str) -> str | None:
    """An mmproj tensor's name in GemmaVision (None: not one of Gemma 3's)."""
    layer = {"ln1": "layer_norm1", "ln2": "layer_norm2", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
             "attn_v": "self_attn.v_proj", "attn_out": "self_attn.out_proj", "ffn_up": "mlp.fc1",
             "ffn_down": "mlp.fc2"}
    fixed = {"v.patch_embd": "vision_tower.embeddings.patch_embedding",
             "v.position_embd": "vision_tower.embeddings.position_embedding",
             "v.post_ln": "vision_tower.post_layernorm",
             "mm.soft_emb_norm": "multi_modal_projector.mm_soft_emb_norm"}
    stem, _, kind = name.rpartition(".")
    if name == "mm.input_projection.weight":
        return "multi_modal_projector.mm_input_projection_weight"
    if stem in fixed:
        return f"{fixed[stem]}.{kind}"
    parts = stem.split(".")
    if len(parts) == 4 and parts[:2] == ["v", "blk"] and parts[2].isdigit() and parts[3] in layer:
        return f"vision_tower.encoder.layers.{parts[2]}.{layer[parts[3]]}.{kind}"
    return None


def block_target(name: str, fixed: dict[str, str], layer: dict[str, str], blocks: str) -> str | None:
    """An mmproj tensor's name in our model: `fixed` (whole names), else a `v.blk.N.<part>.<kind>` tensor under
    `blocks`.N with its part renamed by `layer`; None for any other."""
    if name in fixed:
        return fixed[name]
    parts = name.split(".")
    if len(parts) == 5 and parts[:2] == ["v", "blk"] and parts[2].isdigit() and parts[3] in layer:
        return f"{blocks}.{parts[2]}.{layer[parts[3]]}.{parts[4]}"
    return None


# (the file's tensor name, its shape in torch's order, a call that reads it de-quantized into float32)
MmprojTensor = tuple[str, tuple[int, ...], Callable[[], torch.Tensor]]


def mmproj_tensors(mmproj: MmprojFile) -> Iterator[MmprojTensor]:
    """The mmproj's tensors in file order; each is read (and de-quantized) only when its call is made."""
    import gguf

    def reader(tensor, shape: tuple[int, ...]) -> Callable[[], torch.Tensor]:
        def read() -> torch.Tensor:
            try:
                values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            except NotImplementedError:
                raise MmprojError(f"{mmproj.path}: {tensor.name} is stored as {tensor.tensor_type.name}, which the "
                                  f"gguf package cannot de-quantize") from None
            return torch.from_numpy(np.array(values, dtype=np.float32)).reshape(shape)
        return read

    for tensor in mmproj.reader.tensors:
        shape = tuple(int(d) for d in reversed(tensor.shape))
        yield tensor.name, shape, reader(tensor, shape)


def load_mmproj_weights(model: torch.nn.Module, mmproj: MmprojFile,
                        tensors: Iterable[tuple[str, str | None, tuple[int, ...], Callable[[], torch.Tensor]]]
                        ) -> None:
    """Each of `tensors` (the file's name, our parameter's name or None, its shape, its read) into `model`;
    MmprojError names an unexpected or misshapen tensor (before reading it) and the parameters none filled."""
    wanted = dict(model.named_parameters())
    seen: set[str] = set()
    for name, ours, shape, read in tensors:
        parameter = wanted.get(ours) if ours is not None else None
        if parameter is None:
            raise MmprojError(f"{mmproj.path}: unexpected tensor {name} for a {mmproj.projector} projector")
        if shape != tuple(parameter.shape):
            raise MmprojError(f"{mmproj.path}: {name} has shape {list(shape)}; the metadata gives "
                              f"{list(parameter.shape)}")
        with torch.no_grad():
            parameter.copy_(read())
        seen.add(ours)
    missing = [name for name in wanted if name not in seen]
    if missing:
        raise MmprojError(f"{mmproj.path}: missing tensors for {', '.join(missing[:5])}"
                          + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))


def load_mmproj_gemma_vision(mmproj: MmprojFile, token_ids: dict[str, int], dtype: torch.dtype = torch.float32,
                             device: torch.device | str = "cpu") -> GemmaVision:
    """Gemma 3's tower and projector from a `gemma3` mmproj, with the mmproj's preprocessing."""
    config = gemma3_mmproj_config(mmproj, token_ids)
    processing = mmproj_image_processing(mmproj, config.vision.image_size)
    with torch.device("meta"):
        model = GemmaVision(config, processing).to(dtype=dtype)
    model.multi_modal_projector.mm_soft_emb_norm.offset = 0.0  # the file holds 1 + w
    model.to_empty(device=device)
    load_mmproj_weights(model, mmproj, ((name, gemma3_target(name), shape, read)
                                        for name, shape, read in mmproj_tensors(mmproj)))
    return model.eval()


def open_mmproj_for(mmproj: str | Path, model: Path) -> MmprojFile:
    """The mmproj for the model at `model`, checked before the model loads: a pair is a language model's .gguf
    (a checkpoint folder's vision weights load from the folder) of the family and hidden size the projector
    feeds (`check_language_model`, from the model's header alone)."""
    from localserve.loading.gguf_header import GGUFHeaderError, read_gguf_metadata

    if not (model.is_file() and model.suffix == ".gguf"):
        raise MmprojError(f"{mmproj}: an mmproj pairs with a language model's .gguf file; {model} is not one (a "
                          f"checkpoint folder's vision weights load from the folder itself)")
    found = read_mmproj(mmproj)
    families = PROJECTOR_LANGUAGE_MODELS[found.projector]
    try:
        header = read_gguf_metadata(model, ["general.architecture", *(f"{f}.embedding_length" for f in families)])
    except GGUFHeaderError:
        return found  # the model's load names what is wrong with it
    architecture = header.get("general.architecture")
    hidden_size = header.get(f"{architecture}.embedding_length")
    if isinstance(architecture, str) and (architecture not in families or isinstance(hidden_size, int)):
        check_language_model(found, architecture, hidden_size if isinstance(hidden_size, int) else 0, str(model))
    return found


def gemma3_mmproj_encoder(mmproj: MmprojFile, model: Path, config: ModelConfig, vocabulary: dict[str, int],
                          dtype: torch.dtype, device: torch.device | str) -> ImageEncoder:
    """Gemma 3's encoder (models/vision/gemma3_encoder.py) over the mmproj's GemmaVision, the image tokens
    those of the language model's vocabulary."""
    from localserve.models.vision.gemma3_encoder import Gemma3ImageEncoder, GemmaImageTokens

    ids = image_token_ids(vocabulary, GEMMA3_IMAGE_TOKENS, str(model))
    vision = load_mmproj_gemma_vision(mmproj, ids, dtype, device)
    tokens = GemmaImageTokens(boi=GEMMA3_IMAGE_TOKENS["boi"], eoi=GEMMA3_IMAGE_TOKENS["eoi"],
                              soft=GEMMA3_IMAGE_TOKENS["image"], soft_id=ids["image"])
    return Gemma3ImageEncoder(vision, tokens)
