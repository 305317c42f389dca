"""KV-cache formats by name: what a -ctk / -ctv value means, parsed once into a `KVFormatSpec`. No torch here,
so that a command line is checked before torch is imported.

Formats (bits per value, exactly):
- `fp32`, `fp16`, `bf16`, `fp64`: the values themselves (32, 16, 16, 64).
- `q8_0`: int8 + one fp16 scale per 32 values, as llama.cpp's q8_0 (8 + 16/32 = 8.5), after the same
  fixed rotation as the 4-bit format (`q8_0:-rotation`: without it).
- `q4_rot`: 4-bit codes (two per byte) + one fp16 scale per head vector (4 + 16/D: 4.25 at D=64,
  4.125 at D=128), built from four switchable techniques (`Q4Options`, `q4_rot:-mean,-rotation`, ...):
  rotation - a fixed orthogonal rotation of each head vector (random signs, then a normalised Hadamard);
  codebook - 16 Lloyd-Max levels for a unit Gaussian, the scale chosen among 17 candidates each refitted
  by least squares (off: uniform levels, one absmax scale);
  mean - a calibrated per-layer, per-KV-head mean (for keys the mean before RoPE, rotated to each key's
  position) subtracted only where that lowers the vector's norm; the one-bit choice is the sign of the
  stored (otherwise positive) scale;
  key_transform - a calibrated per-KV-head matrix A applied to keys before the rotation; the query gets
  A^-T so that scores are unchanged.

How each format stores and reads its vectors is its codec's (kv/codecs.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

# name -> (the torch dtype it stores, bits per value)
PASSTHROUGH_FORMATS = {"fp32": ("float32", 32), "fp16": ("float16", 16), "bf16": ("bfloat16", 16),
                       "fp64": ("float64", 64)}
QUANTIZED_FORMATS = ("q8_0", "q4_rot")
FORMAT_NAMES = (*PASSTHROUGH_FORMATS, *QUANTIZED_FORMATS)
ALIASES = {"f32": "fp32", "float32": "fp32", "f16": "fp16", "float16": "fp16", "bfloat16": "bf16",
           "q4": "q4_rot", "4bit": "q4_rot"}
Q8_BLOCK = 32  # values per q8_0 scale


@dataclass(frozen=True)
class Q4Options:
    """Which techniques the 4-bit format uses; each can be switched off to measure what it buys. q8_0
    takes `rotation` alone."""

    rotation: bool = True
    codebook: bool = True  # Lloyd-Max levels, searched least-squares scale; off: uniform levels, absmax scale
    mean: bool = True
    key_transform: bool = True


# The switches each format takes (`name:-switch,+switch`).
FORMAT_SWITCHES = {"q4_rot": tuple(f.name for f in fields(Q4Options)), "q8_0": ("rotation",)}


@dataclass(frozen=True)
class KVFormatSpec:
    """A format by its canonical name, plus its switches; `parse` accepts e.g. 'q4_rot' or 'q4_rot:-mean,-rotation'."""

    name: str
    options: Q4Options = field(default_factory=Q4Options)

    @classmethod
    def parse(cls, text: str) -> KVFormatSpec:
        """The spec `text` names; raises ValueError, naming the valid formats, for an unknown one."""
        name, _, switches = text.partition(":")
        name = ALIASES.get(name.lower(), name.lower())
        if name not in FORMAT_NAMES:
            raise ValueError(f"unknown KV cache type {name!r}; choose from {', '.join(FORMAT_NAMES)}")
        flags = {}
        for switch in filter(None, switches.split(",")):
            key = switch.lstrip("+-").replace("-", "_")
            if key not in FORMAT_SWITCHES.get(name, ()):
                raise ValueError(f"unknown KV format option {switch!r} for {name}")
            flags[key] = not switch.startswith("-")
        return cls(name, Q4Options(**flags))

    def __str__(self) -> str:
        """The canonical text: the name and the switches turned off ('q4_rot:-mean')."""
        off = [f"-{key}" for key in FORMAT_SWITCHES.get(self.name, ()) if not getattr(self.options, key)]
        return self.name + (":" + ",".join(off) if off else "")

    @property
    def dtype_name(self) -> str | None:
        """The torch dtype a passthrough format stores (`float16`); None for a quantized format."""
        return PASSTHROUGH_FORMATS[self.name][0] if self.name in PASSTHROUGH_FORMATS else None

    @property
    def needs_calibration(self) -> bool:
        """True when the format uses the model's calibrated statistics (the 4-bit mean or key transform)."""
        return self.name == "q4_rot" and (self.options.mean or self.options.key_transform)

    def check_head_dim(self, head_dim: int) -> None:
        """Raise ValueError unless the format can store head vectors of `head_dim` values."""
        if self.name == "q8_0" and head_dim % Q8_BLOCK:
            raise ValueError(f"q8_0 needs a head_dim divisible by {Q8_BLOCK}, got {head_dim}")
        if self.name == "q4_rot" and head_dim % 2:
            raise ValueError(f"q4_rot needs an even head_dim, got {head_dim}")

    def bytes_per_vector(self, head_dim: int) -> int:
        """Bytes one head vector of `head_dim` values takes (the codec's storage layout, counted)."""
        self.check_head_dim(head_dim)
        if self.name in PASSTHROUGH_FORMATS:
            return PASSTHROUGH_FORMATS[self.name][1] // 8 * head_dim
        if self.name == "q8_0":
            return head_dim + 2 * (head_dim // Q8_BLOCK)  # int8 codes, an fp16 scale per block
        return head_dim // 2 + 2  # two 4-bit codes a byte, one fp16 scale

    def bits_per_value(self, head_dim: int) -> float:
        """Exact storage bits per K or V value at `head_dim`."""
        return 8 * self.bytes_per_vector(head_dim) / head_dim
