"""KV-cache formats: how one layer's K or V head vectors are stored in the paged pool and read back.

A format is described by a codec per (layer, K or V). A codec says which tensors one token occupies
(`storage`: name -> (shape per token, dtype)), encodes head vectors [T, Hkv, D] into them when K/V are
written, and decodes gathered blocks back to float vectors inside attention (never the whole cache).

Formats (bits per value, exactly):
- `fp32`, `fp16`, `bf16`: the values themselves (32, 16, 16).
- `q8_0`: int8 + one fp16 scale per 32 values, as llama.cpp's q8_0 (8 + 16/32 = 8.5), after the same
  fixed rotation as the 4-bit format (`q8_0:-rotation`: without it).
- `q4_rot`: 4-bit codes (two per byte) + one fp16 scale per head vector (4 + 16/D: 4.25 at D=64,
  4.125 at D=128), built from four switchable techniques (`Q4Options`):
  rotation - a fixed orthogonal rotation of each head vector (random signs, then a normalised Hadamard);
  codebook - 16 Lloyd-Max levels for a unit Gaussian, the scale chosen among 17 candidates each refitted
  by least squares (off: uniform levels, one absmax scale);
  mean - a calibrated per-layer, per-KV-head mean (for keys the mean before RoPE, rotated to each key's
  position) subtracted only where that lowers the vector's norm; the one-bit choice is the sign of the
  stored (otherwise positive) scale;
  key_transform - a calibrated per-KV-head matrix A applied to keys before the rotation; the query gets
  A^-T so that scores are unchanged.

A rotated codec decodes into its rotated domain: attention multiplies the query by the codec's query
matrix once (keys) and the output by the inverse rotation once (values) instead of un-rotating the cache.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from localserve.models.rope import apply_rope

PASSTHROUGH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
                      "fp64": torch.float64}
QUANTIZED_FORMATS = ("q8_0", "q4_rot")
FORMAT_NAMES = (*PASSTHROUGH_DTYPES, *QUANTIZED_FORMATS)
ALIASES = {"f32": "fp32", "float32": "fp32", "f16": "fp16", "float16": "fp16", "bfloat16": "bf16",
           "q4": "q4_rot", "4bit": "q4_rot"}
Q8_BLOCK = 32
ROTATION_SEED = 0x5EED

# (cos, sin) [T, D] for positions [T]: the model's rotary embedding, needed by the key mean.
RopeFn = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def canonical_format(name: str) -> str:
    """The canonical name of a format (`f16` -> `fp16`); raises ValueError for an unknown one."""
    name = ALIASES.get(name.lower(), name.lower())
    if name not in FORMAT_NAMES:
        raise ValueError(f"unknown KV cache type {name!r}; choose from {', '.join(FORMAT_NAMES)}")
    return name


def bits_per_value(name: str, head_dim: int) -> float:
    """Exact storage bits per K or V value of format `name` at `head_dim`."""
    name = canonical_format(name)
    if name in PASSTHROUGH_DTYPES:
        return 8.0 * PASSTHROUGH_DTYPES[name].itemsize
    if name == "q8_0":
        return 8 + 16 / Q8_BLOCK
    return 4 + 16 / head_dim


def lloyd_max_gaussian(levels: int = 16, iterations: int = 300) -> torch.Tensor:
    """The MSE-optimal `levels`-level quantizer of a unit Gaussian (Lloyd-Max), ascending, float64."""
    pdf = lambda x: math.exp(-x * x / 2) / math.sqrt(2 * math.pi)  # noqa: E731
    cdf = lambda x: 0.5 * (1 + math.erf(x / math.sqrt(2)))  # noqa: E731
    points = [-2.5 + 5 * (i + 0.5) / levels for i in range(levels)]
    for _ in range(iterations):
        edges = [-math.inf] + [(a + b) / 2 for a, b in zip(points, points[1:], strict=False)] + [math.inf]
        # Centroid of N(0,1) on [a, b] is (pdf(a) - pdf(b)) / (cdf(b) - cdf(a)).
        points = [(pdf(a) - pdf(b)) / (cdf(b) - cdf(a)) for a, b in zip(edges, edges[1:], strict=False)]
    return torch.tensor(points, dtype=torch.float64)


LLOYD_MAX_16 = lloyd_max_gaussian(16).float()
UNIFORM_16 = torch.arange(16, dtype=torch.float32) - 7.5


def hadamard(n: int) -> torch.Tensor:
    """The Sylvester Hadamard matrix of order n (a power of two), entries +-1."""
    if n & (n - 1):
        raise ValueError(f"no Sylvester Hadamard matrix of order {n}")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h


def rotation_matrix(head_dim: int, seed: int = ROTATION_SEED) -> torch.Tensor:
    """The fixed orthonormal rotation R = H diag(signs) / sqrt(D), float32 [D, D]; y = R x.

    A head_dim that is not a power of two gets a seeded random orthogonal matrix instead.
    """
    generator = torch.Generator().manual_seed(seed)
    if head_dim & (head_dim - 1):
        q, r = torch.linalg.qr(torch.randn(head_dim, head_dim, generator=generator, dtype=torch.float64))
        return (q * torch.sign(torch.diagonal(r))).float()
    signs = torch.randint(0, 2, (head_dim,), generator=generator).double() * 2 - 1
    return (hadamard(head_dim).double() * signs[None, :] / math.sqrt(head_dim)).float()


@dataclass(frozen=True)
class Q4Options:
    """Which techniques the 4-bit format uses; each can be switched off to measure what it buys."""

    rotation: bool = True
    codebook: bool = True  # Lloyd-Max levels, searched least-squares scale; off: uniform levels, absmax scale
    mean: bool = True
    key_transform: bool = True


@dataclass
class LayerCalibration:
    """Calibrated statistics of one layer (float32): means [Hkv, D], key transform [Hkv, D, D] or None."""

    key_mean: torch.Tensor | None = None  # before RoPE
    value_mean: torch.Tensor | None = None
    key_transform: torch.Tensor | None = None


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Codes 0..15 [..., D] -> uint8 [..., D/2]: element 2i in the low nibble, 2i+1 in the high one."""
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., D/2] -> codes int64 [..., D]."""
    low, high = packed & 0xF, packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2).long()


def quantize_codebook(y: torch.Tensor, levels: torch.Tensor,
                      search: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize vectors y [N, D] to one scale each and codes into `levels`: (codes [N, D], scales [N]).

    With `search`, ~17 candidate scales are tried (16 around the vector's RMS, one from its absmax); the
    codes of each are refitted to the least-squares scale <y,c>/<c,c> and the smallest residual wins.
    Without, the scale maps the absmax onto the outermost level and codes are the nearest levels.
    """
    levels = levels.to(y.device)
    midpoints = (levels[1:] + levels[:-1]) / 2
    absmax = y.abs().amax(-1)
    if not search:
        scale = absmax / levels.abs().max()
        codes = torch.bucketize(y / scale.clamp_min(1e-30)[:, None], midpoints)
        return codes, scale
    rms = y.pow(2).mean(-1).sqrt()
    factors = torch.exp(torch.linspace(math.log(0.6), math.log(1.7), 16, device=y.device))
    candidates = torch.cat((rms[:, None] * factors, (absmax / levels.abs().max())[:, None]), 1)  # [N, 17]
    codes = torch.bucketize(y[:, None, :] / candidates.clamp_min(1e-30)[..., None], midpoints)  # [N, 17, D]
    values = levels[codes]
    dot = (values * y[:, None, :]).sum(-1)
    norm2 = values.pow(2).sum(-1).clamp_min(1e-30)
    residual = y.pow(2).sum(-1)[:, None] - dot.pow(2) / norm2  # LS residual of each candidate
    best = residual.argmin(-1)
    rows = torch.arange(y.shape[0], device=y.device)
    return codes[rows, best], (dot / norm2)[rows, best].clamp_min(0)


class KVCodec(ABC):
    """Stores one layer's K or V: the storage layout, encode and decode are each format's own; the
    query and output transforms default to the identity."""

    rotated = False  # True: decode() returns a transformed domain; use transform_query / restore_output
    needs_positions = False

    def __init__(self, name: str, num_kv_heads: int, head_dim: int) -> None:
        self.name, self.num_kv_heads, self.head_dim = name, num_kv_heads, head_dim

    @property
    def bits_per_value(self) -> float:
        return bits_per_value(self.name, self.head_dim)

    @abstractmethod
    def storage(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The tensors one token occupies: name -> (shape per token, dtype)."""

    def bytes_per_token(self) -> int:
        """Bytes one token takes in this layer (all KV heads), from the storage layout."""
        return sum(math.prod(shape) * dtype.itemsize for shape, dtype in self.storage().values())

    @abstractmethod
    def encode(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Head vectors [T, Hkv, D] -> stored tensors [T, ...] per `storage`."""

    @abstractmethod
    def decode(self, stored: dict[str, torch.Tensor], positions: torch.Tensor | None = None) -> torch.Tensor:
        """Stored tensors [N, ...] -> vectors [N, Hkv, D] (in the rotated domain for a rotated codec)."""

    def transform_query(self, query: torch.Tensor) -> torch.Tensor:
        """query [T, H, D] -> the query whose dot products with decode()d keys are the true scores."""
        return query

    def restore_output(self, output: torch.Tensor) -> torch.Tensor:
        """Attention output [T, H, D] over decode()d values -> the output over the true values."""
        return output


class PassthroughCodec(KVCodec):
    """fp32 / fp16 / bf16: the values themselves."""

    def __init__(self, name: str, num_kv_heads: int, head_dim: int) -> None:
        super().__init__(name, num_kv_heads, head_dim)
        self.dtype = PASSTHROUGH_DTYPES[name]

    def storage(self):
        return {"values": ((self.num_kv_heads, self.head_dim), self.dtype)}

    def encode(self, x, positions=None):
        return {"values": x.to(self.dtype)}

    def decode(self, stored, positions=None):
        return stored["values"]


class Q8Codec(KVCodec):
    """q8_0: blocks of 32 values along the head dimension, int8 codes and an fp16 scale absmax/127.

    With `rotation` (the default) each head vector is first rotated like the 4-bit format's, which
    spreads the keys' outlier channels over all 32-value blocks; the layout is llama.cpp's q8_0 either way.
    """

    def __init__(self, name: str, num_kv_heads: int, head_dim: int, kind: str = "key",
                 rotation: bool = True) -> None:
        if head_dim % Q8_BLOCK:
            raise ValueError(f"q8_0 needs a head_dim divisible by {Q8_BLOCK}, got {head_dim}")
        super().__init__(name, num_kv_heads, head_dim)
        self.kind, self.rotated = kind, rotation
        self.rotation = rotation_matrix(head_dim) if rotation else None
        self._device_rotation: dict[torch.device, torch.Tensor] = {}

    def _rotation_on(self, device: torch.device) -> torch.Tensor:
        if device not in self._device_rotation:
            self._device_rotation[device] = self.rotation.to(device)
        return self._device_rotation[device]

    def storage(self):
        h, d = self.num_kv_heads, self.head_dim
        return {"codes": ((h, d), torch.int8), "scales": ((h, d // Q8_BLOCK), torch.float16)}

    def encode(self, x, positions=None):
        x = x.float()
        if self.rotated:
            x = x @ self._rotation_on(x.device).T
        blocks = x.unflatten(-1, (-1, Q8_BLOCK))
        scales = (blocks.abs().amax(-1) / 127).to(torch.float16)
        inverse = torch.where(scales > 0, 1 / scales.float(), torch.zeros_like(scales, dtype=torch.float32))
        codes = (blocks * inverse[..., None]).round().clamp(-127, 127).to(torch.int8)
        return {"codes": codes.flatten(-2), "scales": scales}

    def decode(self, stored, positions=None):
        blocks = stored["codes"].float().unflatten(-1, (-1, Q8_BLOCK))
        return (blocks * stored["scales"].float()[..., None]).flatten(-2)

    def transform_query(self, query):
        if self.kind != "key" or not self.rotated:
            return query
        return (query.float() @ self._rotation_on(query.device).T).to(query.dtype)

    def restore_output(self, output):
        if self.kind != "value" or not self.rotated:
            return output
        return (output.float() @ self._rotation_on(output.device)).to(output.dtype)


class Q4Codec(KVCodec):
    """The 4-bit format (see the module docstring); per-layer calibration comes in `calibration`."""

    def __init__(self, name: str, num_kv_heads: int, head_dim: int, kind: str,
                 calibration: LayerCalibration | None = None, options: Q4Options = Q4Options(),
                 rope: RopeFn | None = None) -> None:
        if head_dim % 2:
            raise ValueError(f"q4_rot needs an even head_dim, got {head_dim}")
        super().__init__(name, num_kv_heads, head_dim)
        calibration = calibration or LayerCalibration()
        self.kind, self.options, self.rope = kind, options, rope
        self.levels = LLOYD_MAX_16 if options.codebook else UNIFORM_16
        eye = torch.eye(head_dim).expand(num_kv_heads, head_dim, head_dim)
        rotation = rotation_matrix(head_dim) if options.rotation else torch.eye(head_dim)
        transform = calibration.key_transform if kind == "key" and options.key_transform else None
        # encode_matrix[g] maps a true vector of KV head g into the stored domain; query_matrix[g] maps
        # a query of that head's group so that scores are preserved: (R A^-T)^T (R A) = I.
        if transform is not None:
            self.encode_matrix = rotation @ transform.float()
            self.query_matrix = rotation @ torch.linalg.inv(transform.double()).transpose(-1, -2).float()
        else:
            self.encode_matrix = rotation @ eye
            self.query_matrix = self.encode_matrix
        self.rotated = options.rotation or transform is not None
        self.output_matrix = rotation  # values: out = R^T out', i.e. out' @ R for row vectors
        mean = calibration.key_mean if kind == "key" else calibration.value_mean
        self.mean = mean.float() if options.mean and mean is not None else None
        self.needs_positions = self.mean is not None and kind == "key"
        if self.needs_positions and rope is None:
            raise ValueError("a key mean needs the model's rotary embedding (rope)")
        self._device_cache: dict[torch.device, tuple[torch.Tensor, ...]] = {}

    def _on(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        if device not in self._device_cache:
            tensors = (self.encode_matrix, self.query_matrix, self.output_matrix, self.levels,
                       self.mean if self.mean is not None else torch.zeros(0))
            self._device_cache[device] = tuple(t.to(device) for t in tensors)
        return self._device_cache[device]

    def storage(self):
        h, d = self.num_kv_heads, self.head_dim
        return {"codes": ((h, d // 2), torch.uint8), "scales": ((h,), torch.float16)}

    def _stored_mean(self, n: int, positions: torch.Tensor | None, device: torch.device) -> torch.Tensor:
        """The mean of each of n tokens in the stored domain, [n, Hkv, D]."""
        encode_matrix, _, _, _, mean = self._on(device)
        mean = mean.expand(n, -1, -1)
        if self.kind == "key":
            if positions is None:
                raise ValueError("q4_rot keys with a mean need token positions")
            cos, sin = self.rope(positions)
            mean = apply_rope(mean, cos.float(), sin.float())
        return torch.einsum("ged,tgd->tge", encode_matrix, mean)

    def encode(self, x, positions=None):
        encode_matrix, _, _, levels, _ = self._on(x.device)
        num_tokens = x.shape[0]
        y = torch.einsum("ged,tgd->tge", encode_matrix, x.float())
        use_mean = torch.zeros(y.shape[:2], dtype=torch.bool, device=x.device)
        if self.mean is not None:
            centered = y - self._stored_mean(num_tokens, positions, x.device)
            use_mean = centered.pow(2).sum(-1) < y.pow(2).sum(-1)  # skip where the mean would not help
            y = torch.where(use_mean[..., None], centered, y)
        codes, scales = quantize_codebook(y.flatten(0, 1), levels, search=self.options.codebook)
        scales = scales.view(num_tokens, -1).to(torch.float16)
        scales = torch.where(use_mean, -scales, scales)  # the sign bit carries the mean choice
        return {"codes": pack_nibbles(codes.view_as(y)), "scales": scales}

    def decode(self, stored, positions=None):
        _, _, _, levels, _ = self._on(stored["codes"].device)
        scales = stored["scales"]
        y = levels[unpack_nibbles(stored["codes"])] * scales.float().abs()[..., None]
        if self.mean is not None:
            used = torch.signbit(scales)[..., None]
            y = y + used * self._stored_mean(y.shape[0], positions, y.device)
        return y

    def transform_query(self, query):
        if self.kind != "key" or not self.rotated:
            return query
        _, query_matrix, _, _, _ = self._on(query.device)
        grouped = query.float().unflatten(1, (self.num_kv_heads, -1))  # [T, Hkv, group, D]
        return torch.einsum("ged,tgjd->tgje", query_matrix, grouped).flatten(1, 2).to(query.dtype)

    def restore_output(self, output):
        if self.kind != "value" or not self.options.rotation:
            return output
        _, _, output_matrix, _, _ = self._on(output.device)
        return (output.float() @ output_matrix).to(output.dtype)


@dataclass
class KVFormatSpec:
    """A format name plus the 4-bit options; `parse` accepts e.g. 'q4_rot' or 'q4_rot:-mean,-rotation'."""

    name: str
    options: Q4Options = field(default_factory=Q4Options)

    @classmethod
    def parse(cls, text: str) -> KVFormatSpec:
        name, _, switches = text.partition(":")
        name = canonical_format(name)
        flags = {}
        for switch in filter(None, switches.split(",")):
            key = switch.lstrip("+-").replace("-", "_")
            allowed = {"q4_rot": Q4Options.__dataclass_fields__, "q8_0": ("rotation",)}.get(name, ())
            if key not in allowed:
                raise ValueError(f"unknown KV format option {switch!r} for {name}")
            flags[key] = not switch.startswith("-")
        return cls(name, Q4Options(**flags))


def make_codec(spec: str | KVFormatSpec, kind: str, num_kv_heads: int, head_dim: int,
               calibration: LayerCalibration | None = None, rope: RopeFn | None = None) -> KVCodec:
    """The codec of format `spec` for keys (`kind='key'`) or values (`kind='value'`) of one layer."""
    spec = KVFormatSpec.parse(spec) if isinstance(spec, str) else spec
    if spec.name in PASSTHROUGH_DTYPES:
        return PassthroughCodec(spec.name, num_kv_heads, head_dim)
    if spec.name == "q8_0":
        return Q8Codec(spec.name, num_kv_heads, head_dim, kind, spec.options.rotation)
    return Q4Codec(spec.name, num_kv_heads, head_dim, kind, calibration, spec.options, rope)


def dtype_format(dtype: torch.dtype) -> str:
    """The passthrough format storing `dtype` (the default: the model's own dtype)."""
    for name, fmt_dtype in PASSTHROUGH_DTYPES.items():
        if fmt_dtype == dtype:
            return name
    raise ValueError(f"no KV cache format stores {dtype}")
