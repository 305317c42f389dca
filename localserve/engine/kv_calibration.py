"""Calibrating the 4-bit KV format on a loaded model: run it once over a short built-in text (the project's
own words, never an evaluation text) with an attention backend that records each layer's queries, keys
(after RoPE) and values, and derive the statistics (kv/calibration.py holds them and their math).

The result is cached on disk per model (keyed by its shapes, a sample of its weights and the text), so a
model is calibrated once per machine.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import torch

from localserve.attention.base import AttentionInputs
from localserve.attention.torch_backend import TorchAttentionBackend
from localserve.kernels.rotary import apply_rope
from localserve.kv.cache import PagedKVCache
from localserve.kv.calibration import CALIBRATION_VERSION, SHRINKAGE, KVCalibration, layer_statistics
from localserve.loading.default_model import cache_dir
from localserve.models.protocol import CausalLM, ForwardContext

log = logging.getLogger(__name__)

CALIBRATION_TEXT = """\
A small server for language models keeps its memory in blocks of sixteen tokens. When a request \
arrives, the scheduler looks at the free blocks, takes only what the prompt needs, and leaves the rest \
for others. Every step, it gathers the sequences that are ready, runs one pass of the model over all of \
them together, and hands each one its next token. Nothing waits for the slowest request to finish.

The workshop at the end of the lane repairs bicycles, clocks and old radios. On Tuesday mornings the \
owner opens the shutters at eight, sweeps the floor, and writes the day's jobs on a chalkboard: a \
wheel that wobbles, a cuckoo that will not call, a receiver that hums but never speaks. By noon the \
board is half wiped. Customers bring coffee and stay to watch; some of them have learned to solder.

How much rain falls in a year depends on where the clouds meet the mountains. Air that rises cools, \
and cool air holds less water, so the western slopes are green while the valleys beyond them stay dry. \
Farmers there measure every drop, dig channels along the contours, and plant crops that root deeply. \
In a wet spring the river floods the lower fields; in a dry one the same fields crack in the sun.

Question: why does a quantized cache need care? Answer: every stored number is rounded, and attention \
adds up many rounded products. If the errors share a direction, they do not cancel; a fixed rotation \
spreads each vector's energy evenly across its coordinates, so that one scale fits them all. The mean \
that every key carries is removed first, because a large constant offset wastes most of the levels.

Grandmother's recipe for bread asks for flour, water, salt and patience. Mix, rest for an hour, fold \
four times, then leave the dough overnight in a cool place. In the morning shape two loaves, let them \
rise until a finger pressed into the side leaves a slow dent, and bake them hot, with steam, until the \
crust sings as it cools. The children are allowed the heels, still warm, with butter.

1. Open the settings. 2. Choose the network. 3. Enter the password twice. 4. Restart the device and \
wait for the light to turn green; if it blinks red, hold the button for ten seconds and start again.
"""


class _RecordingBackend(TorchAttentionBackend):
    """The plain backend that also keeps each layer's query, key and value (after RoPE)."""

    def __init__(self) -> None:
        self.records: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def forward(self, layer, query, key, value, kv_cache, metadata, geometry=None):
        self.records[layer] = (query.float().cpu(), key.float().cpu(), value.float().cpu())
        return super().forward(layer, query, key, value, kv_cache, metadata, geometry)


@torch.inference_mode()
def calibrate(model: CausalLM, token_ids: list[int]) -> KVCalibration:
    """Run `model` over `token_ids` once and derive the statistics."""
    config = model.config
    device = next(model.parameters()).device
    block_size = 16
    num_blocks = -(-len(token_ids) // block_size)
    cache = PagedKVCache(config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim,
                         torch.float32, device)
    backend = _RecordingBackend()
    inputs = AttentionInputs.for_prompt(len(token_ids), list(range(num_blocks)), block_size, device)
    model(torch.tensor(token_ids, device=device), inputs.positions,
          ForwardContext(backend, cache, backend.build_metadata(inputs)))
    cos, sin = model.rotary(inputs.positions, torch.float32)
    cos, sin = cos.cpu(), sin.cpu()
    scale2 = float(model.rotary.scale) ** 2
    layers = []
    for layer in range(config.num_layers):
        query, key, value = backend.records[layer]
        key_before_rope = apply_rope(key, cos, -sin) / scale2  # RoPE is a (scaled) rotation: undo it
        layers.append(layer_statistics(query, key, value, key_before_rope, lambda x: apply_rope(x, cos, sin)))
    return KVCalibration.from_layers(layers)


def _fingerprint(model: CausalLM, token_ids: list[int]) -> str:
    digest = hashlib.sha256()
    digest.update(f"v{CALIBRATION_VERSION}|{SHRINKAGE}|{model.config!r}|{token_ids}".encode())
    for weight in model.calibration_sample():
        digest.update(weight.detach().flatten()[:4096].float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def calibration_tokens(tokenizer, vocab_size: int) -> list[int]:
    """The built-in text as token ids; without a tokenizer, a fixed pseudo-random sequence instead."""
    if tokenizer is not None:
        return list(tokenizer.encode(CALIBRATION_TEXT))
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (512,), generator=generator).tolist()


def load_or_calibrate(model: CausalLM, tokenizer=None, cache_folder: Path | None = None) -> KVCalibration:
    """The model's calibration from the on-disk cache, computed and stored there the first time."""
    token_ids = calibration_tokens(tokenizer, model.config.vocab_size)
    folder = cache_folder or cache_dir() / "kv_calibration"
    path = folder / f"{model.config.name}-{_fingerprint(model, token_ids)}.pt"
    if path.is_file():
        try:
            return KVCalibration(**torch.load(path, map_location="cpu", weights_only=True))
        except Exception as exc:  # a corrupt or foreign file: recompute
            log.warning("ignoring unreadable KV calibration %s: %s", path, exc)
    log.info("calibrating the KV cache on %d tokens of built-in text", len(token_ids))
    calibration = calibrate(model, token_ids)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save(calibration.to_dict(), tmp)
        tmp.replace(path)
    except OSError as exc:
        log.warning("could not cache the KV calibration at %s: %s", path, exc)
    return calibration
