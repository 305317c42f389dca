"""How one layer's K or V head vectors are stored in the paged pool and read back: a codec per (layer, K or V),
made from a `KVFormatSpec` (kv/formats.py).

A codec says which tensors one token occupies (`storage`: name -> (shape per token, dtype)), encodes head
vectors [T, Hkv, D] into them when K/V are written, and decodes gathered blocks back to float vectors
inside attention (never the whole cache). It also describes its format to the Triton kernels
(`kernel_format`), which write and read the very same bytes.

A rotated codec decodes into its rotated domain: attention multiplies the query by the codec's query
matrix once (keys) and the output by the inverse rotation once (values) instead of un-rotating the cache.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from localserve.kernels.kv_format import PLAIN, Q4, Q8_0, KernelFormat, fold_key_mean, q4_midpoints
from localserve.kernels.rotary import apply_rope
from localserve.kv.calibration import LayerCalibration
from localserve.kv.formats import PASSTHROUGH_FORMATS, Q8_BLOCK, KVFormatSpec
from localserve.kv.quantization import (
    LLOYD_MAX_16,
    UNIFORM_16,
    pack_nibbles,
    quantize_codebook,
    rotation_matrix,
    scale_search_factors,
    unpack_nibbles,
)

# (cos, sin) [T, D] for positions [T], in the rotate-half layout: the model's rotary embedding, needed by
# the 4-bit key mean.
RopeFn = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def _float_on(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    return tensor.to(device=device, dtype=torch.float32).contiguous()


class KVCodec(ABC):
    """Stores one layer's K or V: the storage layout, encode and decode are each format's own; the
    query and output transforms default to the identity."""

    rotated = False  # True: decode() returns a transformed domain; use transform_query / restore_output
    needs_positions = False

    def __init__(self, spec: KVFormatSpec, num_kv_heads: int, head_dim: int) -> None:
        self.spec, self.num_kv_heads, self.head_dim = spec, num_kv_heads, head_dim

    @property
    def name(self) -> str:
        return self.spec.name

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

    @abstractmethod
    def kernel_format(self, device: torch.device) -> KernelFormat:
        """This format as the Triton kernels take it (kernels/kv_format.py), its tensors on `device`."""

    def transform_query(self, query: torch.Tensor) -> torch.Tensor:
        """query [T, H, D] -> the query whose dot products with decode()d keys are the true scores."""
        return query

    def restore_output(self, output: torch.Tensor) -> torch.Tensor:
        """Attention output [T, H, D] over decode()d values -> the output over the true values."""
        return output


class PassthroughCodec(KVCodec):
    """fp32 / fp16 / bf16 / fp64: the values themselves."""

    def __init__(self, spec: KVFormatSpec, num_kv_heads: int, head_dim: int) -> None:
        super().__init__(spec, num_kv_heads, head_dim)
        self.dtype = getattr(torch, spec.dtype_name)

    def storage(self):
        return {"values": ((self.num_kv_heads, self.head_dim), self.dtype)}

    def encode(self, x, positions=None):
        return {"values": x.to(self.dtype)}

    def decode(self, stored, positions=None):
        return stored["values"]

    def kernel_format(self, device):
        return KernelFormat(PLAIN)


class Q8Codec(KVCodec):
    """q8_0: blocks of 32 values along the head dimension, int8 codes and an fp16 scale absmax/127.

    With `rotation` (the default) each head vector is first rotated like the 4-bit format's, which
    spreads the keys' outlier channels over all 32-value blocks; the layout is llama.cpp's q8_0 either way.
    """

    def __init__(self, spec: KVFormatSpec, num_kv_heads: int, head_dim: int, kind: str = "key") -> None:
        super().__init__(spec, num_kv_heads, head_dim)
        self.kind, self.rotated = kind, spec.options.rotation
        self.rotation = rotation_matrix(head_dim) if self.rotated else None
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

    def kernel_format(self, device):
        heads, dim = self.num_kv_heads, self.head_dim
        rotation = _float_on(self.rotation, device).expand(heads, dim, dim) if self.rotated else None
        return KernelFormat(Q8_0, encode_matrix=rotation)

    def transform_query(self, query):
        if self.kind != "key" or not self.rotated:
            return query
        return (query.float() @ self._rotation_on(query.device).T).to(query.dtype)

    def restore_output(self, output):
        if self.kind != "value" or not self.rotated:
            return output
        return (output.float() @ self._rotation_on(output.device)).to(output.dtype)


class Q4Codec(KVCodec):
    """The 4-bit format (see kv/formats.py); per-layer calibration comes in `calibration`."""

    def __init__(self, spec: KVFormatSpec, num_kv_heads: int, head_dim: int, kind: str,
                 calibration: LayerCalibration | None = None, rope: RopeFn | None = None) -> None:
        super().__init__(spec, num_kv_heads, head_dim)
        calibration = calibration or LayerCalibration()
        options = spec.options
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

    def kernel_format(self, device):
        encode = _float_on(self.encode_matrix, device)
        key_mean = value_mean = None  # in the stored domain; a key's folded with its rotation (fold_key_mean)
        if self.mean is not None and self.kind == "key":
            key_mean = fold_key_mean(encode, _float_on(self.mean, device))
        elif self.mean is not None:
            value_mean = torch.einsum("ged,gd->ge", encode, _float_on(self.mean, device)).contiguous()
        levels = _float_on(self.levels, device)
        return KernelFormat(Q4, encode_matrix=encode if self.rotated else None, levels=levels,
                            midpoints=q4_midpoints(levels),
                            search_factors=scale_search_factors(device) if self.options.codebook else None,
                            key_mean=key_mean, value_mean=value_mean)

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


def make_codec(spec: KVFormatSpec, kind: str, num_kv_heads: int, head_dim: int,
               calibration: LayerCalibration | None = None, rope: RopeFn | None = None) -> KVCodec:
    """The codec of format `spec` for keys (`kind='key'`) or values (`kind='value'`) of one layer; raises
    ValueError when the format cannot store head vectors of `head_dim` values."""
    spec.check_head_dim(head_dim)
    if spec.dtype_name is not None:
        return PassthroughCodec(spec, num_kv_heads, head_dim)
    if spec.name == "q8_0":
        return Q8Codec(spec, num_kv_heads, head_dim, kind)
    return Q4Codec(spec, num_kv_heads, head_dim, kind, calibration, rope)


def dtype_format(dtype: torch.dtype) -> KVFormatSpec:
    """The passthrough format storing `dtype` (the default: the model's own dtype)."""
    for name, (dtype_name, _) in PASSTHROUGH_FORMATS.items():
        if getattr(torch, dtype_name) == dtype:
            return KVFormatSpec(name)
    raise ValueError(f"no KV cache format stores {dtype}")
