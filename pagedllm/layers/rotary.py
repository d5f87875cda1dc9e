"""Rotary position embeddings (RoPE) in Hugging Face's "rotate half" layout, with HF's scaling variants.

Frequencies follow ``transformers.modeling_rope_utils`` (default, linear, dynamic, llama3, yarn), computed in
float32 the same way, so cos/sin match HF's. The model computes them once per forward pass (one gather from a
cache built at start-up) and every layer reuses them.

The cache holds, per position, ``cos = cat(c, c)`` and a signed ``sin = cat(-s, s)``, so that
``x * cos + roll(x, D/2) * sin`` equals HF's ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x2, x1)``.

Dynamic NTK: HF recomputes ``inv_freq`` from the longest position in the current forward call once it exceeds
``max_position_embeddings``. A paged engine computes each token once, so we give position ``p`` the frequencies HF
uses when ``p`` is the newest token (``seq_len = p + 1``): identical to HF for every sequence within
``max_position_embeddings`` and to HF's own token-by-token generation with a KV cache beyond it. (A single HF forward
over a prompt longer than ``max_position_embeddings`` rotates every position with the prompt-length frequencies,
which no cached decoder can reproduce.)
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


def rope_parameters(hf_config: Any, layer_type: Optional[str] = None) -> dict:
    """The RoPE parameters of a transformers config as one flat dict with ``rope_type`` and ``rope_theta``.

    transformers 5 keeps them in ``config.rope_parameters``; older configs have ``rope_theta`` plus an optional
    ``rope_scaling`` dict (whose type key may be ``type``). For llama3 and yarn, ``original_max_position_embeddings``
    defaults to ``max_position_embeddings`` as in HF. Models with per-layer-type parameters (Gemma 3:
    ``{"sliding_attention": {...}, "full_attention": {...}}``) name the ``layer_type`` to read.

    Raises:
        ValueError: for nested parameters without a matching ``layer_type``, partial rotary factors or unsupported
            rope types.
    """
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    scaling = getattr(hf_config, "rope_scaling", None)
    if not params and isinstance(scaling, dict):
        params = dict(scaling)
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError("per-layer-type rope parameters are not supported by this model family")
    params.setdefault("rope_type", params.pop("type", "default"))
    theta = getattr(hf_config, "rope_theta", None)
    params.setdefault("rope_theta", theta if theta is not None else 10000.0)
    partial = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"partial_rotary_factor={partial} is not supported")
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type in ("llama3", "yarn"):
        orig = getattr(hf_config, "original_max_position_embeddings", None)
        if orig is not None:
            params["original_max_position_embeddings"] = orig
        params.setdefault("original_max_position_embeddings", hf_config.max_position_embeddings)
    return params


def _default_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def compute_inv_freq(head_dim: int, params: dict, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """``(inv_freq [head_dim / 2] float32, attention_factor)`` for positions within ``max_position_embeddings``."""
    rope_type = params["rope_type"]
    base = float(params["rope_theta"])
    dim = head_dim
    inv_freq = _default_inv_freq(base, dim)
    if rope_type in ("default", "dynamic"):  # dynamic = default until a sequence outgrows max_position_embeddings
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / params["factor"], 1.0
    if rope_type == "llama3":
        factor = params["factor"]
        low_ff = params["low_freq_factor"]
        high_ff = params["high_freq_factor"]
        old_len = params["original_max_position_embeddings"]
        low_freq_wavelen = old_len / low_ff
        high_freq_wavelen = old_len / high_ff
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed down by `factor`, short ones kept, the band in between interpolated.
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low_ff) / (high_ff - low_ff)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(dim, base, params, max_position_embeddings)
    raise ValueError(f"rope_type {rope_type!r} is not supported")


def _yarn_inv_freq(dim: int, base: float, params: dict, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    orig = params["original_max_position_embeddings"]
    factor = params.get("factor")
    if factor is None:
        factor = max_position_embeddings / orig

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = float(mscale(factor, m) / mscale(factor, m_all)) if (m and m_all) else mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        # The dimension whose wavelength makes `num_rotations` turns over the original context.
        return (dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, attention_factor


def _dynamic_inv_freq(
    head_dim: int, params: dict, max_position_embeddings: int, seq_lens: torch.Tensor
) -> torch.Tensor:
    """``[len(seq_lens), head_dim / 2]``: HF's dynamic-NTK frequencies for each sequence length (all > max)."""
    dim = head_dim
    factor = params["factor"]
    base = float(params["rope_theta"])
    bases = base * ((factor * seq_lens / max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (bases[:, None] ** exponents[None, :])


def default_max_positions(params: dict, max_position_embeddings: int) -> int:
    """Positions to cache: ``max_position_embeddings``, times ``factor`` for linear and dynamic scaling (whose
    configs keep the pre-scaling length there; llama3 and yarn configs already state the extended one)."""
    if params["rope_type"] in ("linear", "dynamic"):
        return int(max_position_embeddings * params["factor"])
    return max_position_embeddings


class RotaryEmbedding(nn.Module):
    """forward(positions [T] int64) -> (cos [T, 1, D], sin [T, 1, D]) in the model dtype, for ``apply_rotary``."""

    def __init__(
        self,
        head_dim: int,
        max_position_embeddings: int,
        params: dict,
        max_positions: Optional[int] = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.params = params
        default = default_max_positions(params, max_position_embeddings)
        self.max_positions = max(max_positions or 0, default)
        inv_freq, attention_factor = compute_inv_freq(head_dim, params, max_position_embeddings)
        self.attention_factor = attention_factor
        pos = torch.arange(self.max_positions, dtype=torch.int64)
        if params["rope_type"] == "dynamic" and self.max_positions > max_position_embeddings:
            short = pos[:max_position_embeddings].float()[:, None] * inv_freq[None, :]
            long_pos = pos[max_position_embeddings:]
            long_inv = _dynamic_inv_freq(head_dim, params, max_position_embeddings, long_pos + 1)
            freqs = torch.cat([short, long_pos.float()[:, None] * long_inv])
        else:
            freqs = pos.float()[:, None] * inv_freq[None, :]  # [P, D/2]
        cos = freqs.cos() * attention_factor
        sin = freqs.sin() * attention_factor
        cache = torch.stack([torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)], dim=1)  # [P, 2, D]
        self.register_buffer("cos_sin_cache", cache.to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cs = self.cos_sin_cache.index_select(0, positions)  # [T, 2, D]
        return cs[:, 0:1], cs[:, 1:2]

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, max_positions={self.max_positions}, rope_type={self.params['rope_type']}"


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, N, D] (N heads, any strides with a contiguous last dim), cos/sin [T, 1, D] -> rotated [T, N, D]."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)
