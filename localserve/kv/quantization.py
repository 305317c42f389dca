"""The quantizers' math, shared by the codecs (kv/codecs.py) and the kernels' formats: Lloyd-Max levels, the
fixed rotation, 4-bit code packing and the searched-scale codebook quantizer."""

from __future__ import annotations

import math

import torch

ROTATION_SEED = 0x5EED
SCALE_SEARCH_RANGE = (0.6, 1.7)  # the candidate scales: the vector's RMS times 16 factors in this range


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


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Codes 0..15 [..., D] -> uint8 [..., D/2]: element 2i in the low nibble, 2i+1 in the high one."""
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., D/2] -> codes int64 [..., D]."""
    low, high = packed & 0xF, packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2).long()


def scale_search_factors(device: torch.device | str = "cpu") -> torch.Tensor:
    """The 16 factors of the vector's RMS that the 4-bit scale search tries, beside its absmax scale."""
    low, high = SCALE_SEARCH_RANGE
    return torch.exp(torch.linspace(math.log(low), math.log(high), 16, device=device))


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
    absmax_scale = absmax / levels.abs().max()
    candidates = torch.cat((rms[:, None] * scale_search_factors(y.device), absmax_scale[:, None]), 1)  # [N, 17]
    codes = torch.bucketize(y[:, None, :] / candidates.clamp_min(1e-30)[..., None], midpoints)  # [N, 17, D]
    values = levels[codes]
    dot = (values * y[:, None, :]).sum(-1)
    norm2 = values.pow(2).sum(-1).clamp_min(1e-30)
    residual = y.pow(2).sum(-1)[:, None] - dot.pow(2) / norm2  # LS residual of each candidate
    best = residual.argmin(-1)
    rows = torch.arange(y.shape[0], device=y.device)
    return codes[rows, best], (dot / norm2)[rows, best].clamp_min(0)

