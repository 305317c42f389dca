"""Find a model (HF folder, hub repo id, .gguf file, or the default) and stream its weights in.

The config names the family (models/registry.py), whose model is built on the meta device; each tensor is
read from disk, cut to where the family puts it, converted to the run dtype and assigned in place, so peak
memory stays near one copy of the weights. A GGUF's quantized weights may instead stay in their blocks
(`keep_quantized_weights`): their layers become `QuantizedLinear` / `QuantizedEmbedding`, and a mixture of
experts' stacks keep their blocks (`RoutedExperts.keep_quantized`). So may a Hugging Face folder's MXFP4
experts (`_blocks`/`_scales` pairs, loading/mxfp4.py), dequantized at load otherwise.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import logging
import os
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from localserve.loading import mxfp4
from localserve.loading.default_model import HUB_PATTERNS, resolve_default_model
from localserve.loading.pieces import same_values, take
from localserve.loading.pooling_config import PoolingConfigError, folder_pooling
from localserve.models.config import ModelConfig, ModelConfigError
from localserve.models.family import Target
from localserve.models.layers.linear import QuantizedEmbedding, QuantizedLinear, QuantizedTensor
from localserve.models.layers.moe import RoutedExperts
from localserve.models.protocol import CausalLM
from localserve.models.registry import config_from_hf, family

log = logging.getLogger(__name__)

# Buffers some checkpoints carry that this implementation recomputes.
IGNORED_WEIGHT_SUFFIXES = ("rotary_emb.inv_freq",)


class ModelLoadError(RuntimeError):
    """A model that cannot be loaded; the message names the file and the problem."""


@dataclass
class LoadedModel:
    model: CausalLM
    config: ModelConfig
    path: Path
    gguf_reader: object | None = None  # the open GGUFReader of a .gguf, so its tokenizer is not read again


def resolve_model_path(model: str | None, offline: bool = False) -> Path:
    """Turn `-m` into a local path: None is the default model; a repo id is downloaded (or read from cache)."""
    if model is None:
        return resolve_default_model(offline=offline)
    path = Path(model).expanduser()
    if path.exists():
        return path
    if model.count("/") == 1 and not model.startswith((".", "/")) and not model.endswith(".gguf"):
        from huggingface_hub import snapshot_download

        try:
            return Path(snapshot_download(model, allow_patterns=HUB_PATTERNS, local_files_only=offline))
        except Exception as exc:
            where = "in the local hub cache (--offline)" if offline else "on the Hugging Face hub"
            raise ModelLoadError(f"{model}: not found {where}: {type(exc).__name__}: {exc}") from None
    raise ModelLoadError(f"{model}: no such file or folder")


def default_dtype(device: torch.device | str) -> torch.dtype:
    """The library's default (`load_model`, `LLM`): float32 on a CPU, the exact reference the tests
    compare against; bfloat16 on a GPU. The command line picks `serving_dtype` instead."""
    return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16


def has_bf16_instructions(cpuinfo: str) -> bool:
    """Whether /proc/cpuinfo's text lists bfloat16 dot-product instructions (x86 AVX512_BF16 or AMX, Arm
    BF16), which oneDNN uses for bf16 matmuls; without them bf16 is converted on the fly, no faster."""
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):
            return bool({"avx512_bf16", "amx_bf16", "bf16"} & set(value.split()))
    return False


@functools.cache
def cpu_multiplies_bf16() -> bool:
    """`has_bf16_instructions` of this machine's CPU (False where /proc/cpuinfo cannot be read)."""
    try:
        return has_bf16_instructions(Path("/proc/cpuinfo").read_text())
    except OSError:
        return False


def serving_dtype(device: torch.device | str) -> torch.dtype:
    """What `localserve serve` and `generate` load without `--dtype`: bfloat16 on a GPU, and on a CPU that
    multiplies bf16 natively (1.4-1.9x the tokens/s of float32 there, docs/BENCHMARKS.md "Serving");
    float32 on other CPUs."""
    if torch.device(device).type == "cpu" and not cpu_multiplies_bf16():
        return torch.float32
    return torch.bfloat16


def default_keep_quantized(path: Path, device: torch.device | str) -> bool:
    """--keep-quantized-weights by default: for a .gguf, or a folder of MXFP4 weights, on CUDA (on a CPU the
    kernels cannot run)."""
    if torch.device(device).type != "cuda":
        return False
    return path.suffix == ".gguf" or (path.is_dir() and has_mxfp4_weights(path))


def has_mxfp4_weights(folder: Path) -> bool:
    """Whether a Hugging Face folder's config says its weights are (partly) MXFP4 (`quant_method: mxfp4`)."""
    config = folder / "config.json"
    if not config.is_file():
        return False
    try:
        quantization = json.loads(config.read_text()).get("quantization_config") or {}
    except json.JSONDecodeError:
        return False
    return isinstance(quantization, dict) and quantization.get("quant_method") == "mxfp4"


def load_model(path: Path, dtype: torch.dtype | None = None, device: torch.device | str = "cpu",
               keep_quantized_weights: bool | None = None, loaded_apart: Collection[str] = ()) -> LoadedModel:
    """Load a Hugging Face folder or a .gguf file onto `device` in `dtype`.

    `keep_quantized_weights`: keep a GGUF's quantized linear and embedding weights in their blocks on the
    device (None: `default_keep_quantized`); a model without any is loaded as usual. `loaded_apart`: parts of
    the checkpoint that the caller loads itself (the vision encoder: localserve/llm.py), not logged as left out.
    """
    dtype = dtype or default_dtype(device)
    if keep_quantized_weights is None:
        keep_quantized_weights = default_keep_quantized(path, device)
    if keep_quantized_weights:
        _check_kernels_can_run(device)
    config, gguf_reader = read_model_config(path)
    with torch.device("meta"):
        model = family(config.family).model_class(config)
    if gguf_reader is not None:
        from localserve.loading.gguf import check_gguf_tensors, iter_gguf_weights

        expected = {name: tuple(param.shape) for name, param in model.named_parameters()}
        check_gguf_tensors(gguf_reader, config, expected, path)
        weights = iter_gguf_weights(path, config, gguf_reader, keep_quantized=keep_quantized_weights)
    else:
        weights = iter_safetensors_weights(path, config, keep_quantized=keep_quantized_weights)
    for part in (part for part in config.unloaded_parts if part not in loaded_apart):
        log.info("%s: its %s is left unloaded (served as a text model)", path.name, part)
    _stream_weights(model, weights, dtype, device, source=path)
    model.init_rope(device)
    model.eval()
    log.info("weights: %s", describe_weights(model))
    return LoadedModel(model=model, config=config, path=path, gguf_reader=gguf_reader)


def read_model_config(path: Path) -> tuple[ModelConfig, object | None]:
    """The config of the model in `path` (a Hugging Face folder or a .gguf file) from its metadata alone,
    and a .gguf's open GGUFReader (None for a folder), so its weights and tokenizer are read from it
    without parsing the file again. ModelLoadError names the file and the problem."""
    if path.is_file() and path.suffix == ".gguf":
        from localserve.loading.gguf import gguf_model_config, open_gguf

        gguf_reader = open_gguf(path)  # parsing the metadata takes seconds: once for config, weights, tokenizer
        return gguf_model_config(path, gguf_reader), gguf_reader
    if path.is_dir():
        try:
            config = config_from_hf(_read_json(path / "config.json"), name=path.name, source=str(path / "config.json"))
        except ModelConfigError as exc:
            raise ModelLoadError(str(exc)) from None
        try:
            return dataclasses.replace(config, pooling=folder_pooling(path, config.architecture)), None
        except PoolingConfigError as exc:
            raise ModelLoadError(str(exc)) from None
    raise ModelLoadError(f"{path}: not a model folder or a .gguf file")


def _check_kernels_can_run(device: torch.device | str) -> None:
    if torch.device(device).type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ModelLoadError("--keep-quantized-weights needs a CUDA device: its Triton kernels run on a CPU only "
                             "in Triton's interpreter (TRITON_INTERPRET=1, for tests)")
    try:
        import triton  # noqa: F401
    except ImportError:
        raise ModelLoadError("--keep-quantized-weights needs Triton (pip install triton)") from None


def describe_weights(model: torch.nn.Module) -> str:
    """The weights' size as held (quantized blocks at their stored size) and which layers stay quantized."""
    tensors = [*model.parameters(), *model.buffers()]
    size = sum(t.numel() * t.element_size() for t in tensors)
    kept = collections.Counter(m.format.name for m in model.modules() if isinstance(m, QuantizedLinear))
    kept.update(f"{qtype} experts" for module in model.modules() if isinstance(module, RoutedExperts)
                for qtype in module.formats.values())
    text = f"{size / 2**30:.2f} GiB"
    if kept:
        text += " (quantized blocks kept: " + ", ".join(f"{count} {name}" for name, count in sorted(kept.items())) + ")"
    return text


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise ModelLoadError(f"{path}: missing file")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path}: invalid JSON ({exc})") from None


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of a folder: the shards its index names, or its single `*.safetensors`."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(_read_json(index)["weight_map"].values()))
        files = [folder / name for name in names]
    else:
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"{folder}: missing weights (no *.safetensors file)")
    for file in files:
        if not file.is_file():
            raise ModelLoadError(f"{file}: missing file (listed in {index.name})")
    return files


def iter_safetensors_weights(folder: Path, config: ModelConfig,
                             keep_quantized: bool = False) -> Iterator[tuple[Target, torch.Tensor | QuantizedTensor]]:
    """Yield (target, tensor) one tensor at a time from every shard, each cut to where the model's family
    puts it (models/family.py's `hf_targets`). An MXFP4 pair (`<name>_blocks` with its `<name>_scales`,
    wherever the shards put them) comes once, under the blocks' name: as GGUF MXFP4 blocks with
    `keep_quantized`, else dequantized."""
    hf_targets = family(config.family).hf_targets
    files = safetensors_files(folder)
    where = {name: file for file in files for name in _tensor_names(file)}
    pairs = {scales for name in where if (scales := mxfp4.partner(name)) in where}
    for file in files:
        try:
            with safe_open(file, framework="pt") as shard:
                for name in shard.keys():  # noqa: SIM118 - safe_open is not a dict
                    if name in pairs:
                        continue  # read with its blocks
                    targets = hf_targets(name, config)
                    if targets == []:
                        continue
                    tensor = shard.get_tensor(name)
                    if mxfp4.partner(name) in pairs:
                        tensor = _mxfp4_tensor(name, tensor, where, keep_quantized)
                    if targets is None:
                        yield Target(name), tensor
                        continue
                    for target in targets:
                        yield target, take(tensor, target)
        except SafetensorError as exc:
            raise ModelLoadError(f"{file}: corrupt safetensors file ({exc})") from None


def _tensor_names(file: Path) -> list[str]:
    try:
        with safe_open(file, framework="pt") as shard:
            return list(shard.keys())
    except SafetensorError as exc:
        raise ModelLoadError(f"{file}: corrupt safetensors file ({exc})") from None


def _mxfp4_tensor(name: str, blocks: torch.Tensor, where: dict[str, Path],
                  keep_quantized: bool) -> torch.Tensor | QuantizedTensor:
    scales_name = mxfp4.partner(name)
    with safe_open(where[scales_name], framework="pt") as shard:
        scales = shard.get_tensor(scales_name)
    try:
        if keep_quantized:
            return mxfp4.to_gguf_blocks(name, blocks, scales)
        return mxfp4.dequantize(name, blocks, scales)
    except mxfp4.MXFP4Error as exc:
        raise ModelLoadError(f"{where[name]}: {exc}") from None


def _stream_weights(model: CausalLM, weights: Iterator[tuple[Target, torch.Tensor | QuantizedTensor]],
                    dtype: torch.dtype, device: torch.device | str, source: Path) -> None:
    expected = dict(model.named_parameters())
    loaded: set[str] = set()
    stacks: dict[str, _ExpertStack] = {}  # stacked expert parameters filled one expert at a time
    with tqdm(total=len(expected), desc=f"loading {source.name}", unit="tensor", leave=False) as progress:
        for target, tensor in weights:
            name = target.name
            if name.endswith(IGNORED_WEIGHT_SUFFIXES) or (name == "lm_head.weight" and name not in expected):
                continue  # recomputed buffers; an lm_head copy in a tied checkpoint, or an embedding model's
            if name not in expected and f"model.{name}" in expected:
                name = f"model.{name}"  # saved from the bare decoder (`Qwen3Model`), as embedding models are
            if name not in expected:
                raise ModelLoadError(f"{source}: unexpected tensor {name!r} for {model.config.architecture}")
            want = tuple(expected[name].shape)
            if target.expert is not None:
                stack = stacks.setdefault(name, _ExpertStack(want, dtype, device))
                tensor = stack.fill(target.expert, tensor, name, source)
                if tensor is None:
                    continue
            if isinstance(tensor, torch.Tensor) and same_values(tuple(tensor.shape), want):
                tensor = tensor.reshape(want)  # a [H] tensor for a [1, H] parameter (llama.cpp drops axes of 1)
            if tuple(tensor.shape) != want:
                raise ModelLoadError(f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                                     f"the config implies {want}")
            module_name, _, attr = name.rpartition(".")
            if isinstance(tensor, QuantizedTensor):
                _keep_quantized(model, module_name, attr, tensor, dtype, device)
            else:
                parameter = torch.nn.Parameter(tensor.to(device=device, dtype=dtype), requires_grad=False)
                setattr(model.get_submodule(module_name), attr, parameter)
            loaded.add(name)
            progress.update()
    missing = sorted(set(expected) - loaded)
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise ModelLoadError(f"{source}: missing tensors {shown}")


class _ExpertStack:
    """A stacked expert parameter [E, ...] of a checkpoint that stores one tensor per expert."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> None:
        self.data = torch.empty(shape, dtype=dtype, device=device)
        self.filled: set[int] = set()

    def fill(self, expert: int, tensor: torch.Tensor | QuantizedTensor, name: str, source: Path) -> torch.Tensor | None:
        """Put one expert's tensor in its slot; the whole stack once every slot is filled, else None."""
        if isinstance(tensor, QuantizedTensor) or not 0 <= expert < self.data.shape[0]:
            raise ModelLoadError(f"{source}: expert {expert} of {name!r} does not fit {self.data.shape[0]} "
                                 "dense experts")
        if tuple(tensor.shape) != tuple(self.data.shape[1:]):
            raise ModelLoadError(f"{source}: expert {expert} of {name!r} has shape {tuple(tensor.shape)}, the "
                                 f"config implies {tuple(self.data.shape[1:])}")
        self.data[expert] = tensor.to(self.data.dtype)
        self.filled.add(expert)
        return self.data if len(self.filled) == self.data.shape[0] else None


def _keep_quantized(model: torch.nn.Module, module_name: str, attr: str, weight: QuantizedTensor,
                    dtype: torch.dtype, device: torch.device | str) -> None:
    """Replace the linear layer or embedding `module_name` by its quantized twin holding `weight`'s blocks,
    or give a mixture of experts' projection `attr` its blocks."""
    parent_name, _, child = module_name.rpartition(".")
    old = model.get_submodule(module_name)
    on_device = QuantizedTensor(weight.blocks.to(device), weight.qtype, weight.shape)
    if hasattr(old, "keep_quantized"):  # the routed experts (models/layers/moe.py)
        old.keep_quantized(attr, on_device)
        return
    if isinstance(old, torch.nn.Embedding):
        new: torch.nn.Module = QuantizedEmbedding(on_device, dtype)
    else:
        new = QuantizedLinear(on_device, old.bias)  # the bias: still on meta, or loaded already
    setattr(model.get_submodule(parent_name), child, new)
