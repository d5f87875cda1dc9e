"""Reading GGUF files: metadata, and tensors under Hugging Face names, dequantized to the model dtype.

The header parser here reads the GGUF format directly (with the ``gguf`` package's enums and quant sizes) instead of
``gguf.GGUFReader``: the reader builds a numpy view per array element, which costs ~2.6 s for SmolLM2's 49k-token
vocabulary and ~100 ms here. Tensor bytes are memory-mapped; ``gguf.quants.dequantize`` expands quantized ones.

GGUF layout (little-endian): magic "GGUF", version u32, tensor_count u64, kv_count u64; kv_count entries of
(key: string, type: u32, value); tensor_count entries of (name: string, n_dims: u32, dims: u64[n_dims] fastest
first, ggml type: u32, offset: u64); then tensor data from the next ``general.alignment`` (default 32) boundary.
A string is (length: u64, utf-8 bytes); an array is (element type: u32, count: u64, elements).
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import re
import struct
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize

from pagedllm.layers.quantization.gguf import UNQUANTIZED_TYPES, GGUFWeight
from pagedllm.layers.quantization.tile_cache import gguf_span

_GGUF_MAGIC = b"GGUF"

_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}
_ARRAY_DTYPES = {t: np.dtype(f) for t, f in _SCALAR_FORMATS.items()}


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order (GGUF lists dims fastest first; this is reversed)
    ggml_type: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    nbytes: int


@dataclass(frozen=True)
class GGUFHeader:
    path: str
    version: int
    metadata: dict[str, Any]  # numbers as Python scalars, arrays as lists
    tensors: dict[str, GGUFTensorInfo]  # file order

    @property
    def architecture(self) -> str:
        return self.metadata["general.architecture"]

    def arch_key(self, key: str, default: Any = None) -> Any:
        """``metadata[f"{architecture}.{key}"]``, e.g. ``arch_key("block_count")``."""
        return self.metadata.get(f"{self.architecture}.{key}", default)


class _Cursor:
    def __init__(self, buf: Any) -> None:
        self.buf = buf
        self.pos = 0

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        vtype = GGUFValueType(vtype)
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            etype = GGUFValueType(self.unpack("<I"))
            count = self.unpack("<Q")
            if etype in _ARRAY_DTYPES:
                dt = _ARRAY_DTYPES[etype]
                arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos)
                self.pos += count * dt.itemsize
                return arr.tolist()
            if etype == GGUFValueType.STRING:
                out = []
                buf, pos = self.buf, self.pos
                for _ in range(count):
                    (n,) = struct.unpack_from("<Q", buf, pos)
                    out.append(buf[pos + 8 : pos + 8 + n].decode("utf-8", errors="replace"))
                    pos += 8 + n
                self.pos = pos
                return out
            return [self.value(etype) for _ in range(count)]
        return self.unpack(_SCALAR_FORMATS[vtype])


def _tensor_nbytes(shape: tuple[int, ...], ggml_type: GGMLQuantizationType) -> int:
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    n = int(np.prod(shape, dtype=np.int64)) if shape else 1
    return n // block_size * type_size


@lru_cache(maxsize=8)
def _read_header_cached(path: str, size: int, mtime_ns: int) -> GGUFHeader:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        if mm[:4] != _GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file (bad magic)")
        cur = _Cursor(mm)
        cur.pos = 4
        version = cur.unpack("<I")
        if version not in (2, 3):
            raise ValueError(f"{path}: unsupported GGUF version {version} (big-endian files are not supported)")
        n_tensors = cur.unpack("<Q")
        n_kv = cur.unpack("<Q")
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            metadata[key] = cur.value(cur.unpack("<I"))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.unpack("<I")
            dims = struct.unpack_from(f"<{n_dims}Q", mm, cur.pos)
            cur.pos += 8 * n_dims
            ggml_type = GGMLQuantizationType(cur.unpack("<I"))
            offset = cur.unpack("<Q")
            infos.append((name, tuple(int(d) for d in reversed(dims)), ggml_type, offset))
        alignment = int(metadata.get("general.alignment", 32))
        data_start = (cur.pos + alignment - 1) // alignment * alignment
    tensors = {
        name: GGUFTensorInfo(name, shape, t, data_start + off, _tensor_nbytes(shape, t))
        for name, shape, t, off in infos
    }
    return GGUFHeader(path=path, version=version, metadata=metadata, tensors=tensors)


def read_gguf_header(path: str) -> GGUFHeader:
    """Metadata and tensor table of a GGUF file (cached per path, size and mtime; treat as read-only).

    Raises:
        ValueError: if the file is not a little-endian GGUF v2/v3 file.
    """
    path = os.path.abspath(path)
    st = os.stat(path)
    return _read_header_cached(path, st.st_size, st.st_mtime_ns)


# Q5_0's fifth bits: byte value b -> its 8 bits, each as 0 or 16 (OR-ed onto the nibbles).
_HIGH_BITS = ((torch.arange(256)[:, None] >> torch.arange(8)[None, :]) & 1).to(torch.uint8) << 4  # [256, 8]


def _dequantize_torch(blocks: torch.Tensor, ggml_type: GGMLQuantizationType) -> Optional[torch.Tensor]:
    """float32 ``[n_blocks, 32]`` from raw ``[n_blocks, type_size]`` uint8 blocks for the simple quant types, with
    the same float32 arithmetic as ``gguf.quants`` (so the results are equal), or None for other types.

    Block layouts (ggml): Q4_0 = f16 d, 16 B nibbles (element j in the low nibble of byte j, element j + 16 in the
    high one), x = d * (q - 8); Q4_1 = f16 d, f16 m, nibbles, x = d * q + m; Q5_0 = f16 d, u32 high bits, nibbles,
    x = d * (q - 16); Q8_0 = f16 d, 32 int8, x = d * q. Written as few full passes over the output as possible
    (in-place ops, a lookup table for Q5_0's bits): loading is dominated by these for Q5_0 / Q4 files.
    """
    n = blocks.shape[0]

    def f16(col: int) -> torch.Tensor:  # [n_blocks, 1] float32 from the two bytes at `col`
        return blocks[:, col : col + 2].contiguous().view(torch.float16).float()

    def nibbles(col: int) -> torch.Tensor:  # [n_blocks, 32] uint8
        qs = blocks[:, col : col + 16]
        q = torch.empty(n, 2, 16, dtype=torch.uint8)
        torch.bitwise_and(qs, 0x0F, out=q[:, 0])
        torch.bitwise_right_shift(qs, 4, out=q[:, 1])
        return q.view(n, 32)

    t = ggml_type
    if t == GGMLQuantizationType.Q8_0:
        return blocks[:, 2:].view(torch.int8).float().mul_(f16(0))
    if t == GGMLQuantizationType.Q4_0:
        return nibbles(2).float().sub_(8).mul_(f16(0))
    if t == GGMLQuantizationType.Q4_1:
        return nibbles(4).float().mul_(f16(0)).add_(f16(2))
    if t == GGMLQuantizationType.Q5_0:
        q = nibbles(6)
        q |= _HIGH_BITS.index_select(0, blocks[:, 2:6].reshape(-1).long()).view(n, 32)
        return q.float().sub_(16).mul_(f16(0))
    return None


def _to_torch(data: np.ndarray, info: GGUFTensorInfo, dtype: torch.dtype) -> torch.Tensor:
    """Raw bytes of one tensor -> torch tensor of ``info.shape`` in ``dtype`` (may share memory with ``data``)."""
    t = info.ggml_type
    if t == GGMLQuantizationType.F32:
        out = torch.from_numpy(data.view(np.float32))
    elif t == GGMLQuantizationType.F16:
        out = torch.from_numpy(data.view(np.float16))
    elif t == GGMLQuantizationType.BF16:
        out = torch.from_numpy(data.view(np.int16)).view(torch.bfloat16)
    else:
        block_size, type_size = GGML_QUANT_SIZES[t]
        out = _dequantize_torch(torch.from_numpy(data).view(-1, type_size), t)
        if out is None:  # K-quants and the rest: gguf's numpy implementation
            row_bytes = info.shape[-1] // block_size * type_size if info.shape else type_size
            out = torch.from_numpy(dequantize(data.reshape(-1, row_bytes), t))
    return out.reshape(info.shape).to(dtype)


def dequantize_blocks(data: torch.Tensor, ggml_type: GGMLQuantizationType, shape: tuple[int, ...]) -> torch.Tensor:
    """float32 ``shape`` from a tensor's raw ggml bytes (uint8, any shape)."""
    info = GGUFTensorInfo("", tuple(shape), ggml_type, 0, data.numel())
    return _to_torch(data.reshape(-1).numpy(), info, torch.float32)


# GGUF tensor name -> HF name. "{bid}" is the layer index.
GGUF_TO_HF_NAMES: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{bid}.attn_norm.weight": "model.layers.{bid}.input_layernorm.weight",
    "blk.{bid}.ffn_norm.weight": "model.layers.{bid}.post_attention_layernorm.weight",
    "blk.{bid}.attn_q.weight": "model.layers.{bid}.self_attn.q_proj.weight",
    "blk.{bid}.attn_k.weight": "model.layers.{bid}.self_attn.k_proj.weight",
    "blk.{bid}.attn_v.weight": "model.layers.{bid}.self_attn.v_proj.weight",
    "blk.{bid}.attn_q.bias": "model.layers.{bid}.self_attn.q_proj.bias",
    "blk.{bid}.attn_k.bias": "model.layers.{bid}.self_attn.k_proj.bias",
    "blk.{bid}.attn_v.bias": "model.layers.{bid}.self_attn.v_proj.bias",
    "blk.{bid}.attn_q_norm.weight": "model.layers.{bid}.self_attn.q_norm.weight",
    "blk.{bid}.attn_k_norm.weight": "model.layers.{bid}.self_attn.k_norm.weight",
    "blk.{bid}.attn_output.weight": "model.layers.{bid}.self_attn.o_proj.weight",
    "blk.{bid}.attn_output.bias": "model.layers.{bid}.self_attn.o_proj.bias",
    "blk.{bid}.ffn_gate.weight": "model.layers.{bid}.mlp.gate_proj.weight",
    "blk.{bid}.ffn_up.weight": "model.layers.{bid}.mlp.up_proj.weight",
    "blk.{bid}.ffn_down.weight": "model.layers.{bid}.mlp.down_proj.weight",
    "blk.{bid}.ffn_gate.bias": "model.layers.{bid}.mlp.gate_proj.bias",
    "blk.{bid}.ffn_up.bias": "model.layers.{bid}.mlp.up_proj.bias",
    "blk.{bid}.ffn_down.bias": "model.layers.{bid}.mlp.down_proj.bias",
}

# Per-architecture differences from GGUF_TO_HF_NAMES. Gemma 3 has four norms per layer: llama.cpp's ffn_norm is
# the pre-feed-forward norm there, and the post-attention norm is a separate tensor.
GGUF_TO_HF_NAMES_BY_ARCH: dict[str, dict[str, str]] = {
    "gemma3": {
        "blk.{bid}.ffn_norm.weight": "model.layers.{bid}.pre_feedforward_layernorm.weight",
        "blk.{bid}.post_attention_norm.weight": "model.layers.{bid}.post_attention_layernorm.weight",
        "blk.{bid}.post_ffw_norm.weight": "model.layers.{bid}.post_feedforward_layernorm.weight",
    },
}

# Architectures whose converter (llama.cpp's LlamaModel) permuted attn_q/attn_k rows for its RoPE layout.
PERMUTED_QK_ARCHITECTURES = frozenset({"llama", "mistral"})

# Architectures whose GGUF norm weights have 1 added (llama.cpp computes x * w; HF Gemma computes x * (1 + w)).
NORM_PLUS_ONE_ARCHITECTURES = frozenset({"gemma3"})

_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


def gguf_to_hf_name(name: str, arch: Optional[str] = None) -> Optional[str]:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; None for unknown names."""
    names = GGUF_TO_HF_NAMES
    if arch in GGUF_TO_HF_NAMES_BY_ARCH:
        names = {**GGUF_TO_HF_NAMES, **GGUF_TO_HF_NAMES_BY_ARCH[arch]}
    m = _BLOCK_RE.match(name)
    if m is None:
        return names.get(name)
    template = names.get(f"blk.{{bid}}.{m.group(2)}")
    return None if template is None else template.format(bid=m.group(1))


def unpermute_qk(t: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undoes llama.cpp's Q/K row permutation: per head, rows were reordered from HF's [first half, second half]
    of the rotary dims to interleaved pairs (``reshape(n_heads, 2, D/2).swapaxes(1, 2)``); this is the inverse.
    Works for weights ``[n_heads * D, in]`` and biases ``[n_heads * D]``."""
    rows = t.shape[0]
    rest = t.shape[1:]
    return t.reshape(n_heads, rows // n_heads // 2, 2, *rest).transpose(1, 2).reshape(rows, *rest)


def iterate_gguf_weights(
    path: str, dtype: torch.dtype = torch.float32, keep_quantized: bool = False,
    skip: Optional[Callable[[str], bool]] = None,
) -> Iterator[tuple[str, Any]]:
    """Yields ``(hf_name, tensor)`` for every tensor of a Llama/Mistral/Qwen2/Qwen3/Gemma3 GGUF, dequantized to
    ``dtype`` (Gemma's norm weights back in HF's zero-centred form: GGUF weight - 1, computed in float32).
    With ``keep_quantized``, quantized matrices come as ``GGUFWeight`` (raw blocks, Q/K rows already unpermuted).
    ``skip(hf_name)``: true for tensors not to read at all (another pipeline stage's).

    Raises:
        ValueError: for a tensor name with no HF counterpart (e.g. ``rope_freqs.weight``, llama3 rope scaling
            stored as a tensor, which is not supported).
    """
    header = read_gguf_header(path)
    arch = header.architecture
    permute = arch in PERMUTED_QK_ARCHITECTURES
    norm_plus_one = arch in NORM_PLUS_ONE_ARCHITECTURES
    n_heads = header.arch_key("attention.head_count")
    n_kv_heads = header.arch_key("attention.head_count_kv", n_heads)
    # copy-on-write mapping: writable views for torch.from_numpy (no warning), nothing is ever written back
    raw = np.memmap(header.path, dtype=np.uint8, mode="c")
    file_span = gguf_span(header.path) if keep_quantized else None
    try:
        for info in header.tensors.values():
            hf_name = gguf_to_hf_name(info.name, arch)
            if hf_name is None:
                raise ValueError(f"{path}: GGUF tensor {info.name!r} ({arch}) is not supported")
            if skip is not None and skip(hf_name):
                continue
            if keep_quantized and len(info.shape) == 2 and info.ggml_type not in UNQUANTIZED_TYPES:
                data = torch.from_numpy(raw[info.offset : info.offset + info.nbytes]).view(info.shape[0], -1)
                span = dataclasses.replace(file_span, offset=info.offset, ptr=data.data_ptr())
                tensor = GGUFWeight(info.ggml_type, info.shape, data, file_backed=True, span=span)
            elif norm_plus_one and info.name.endswith("norm.weight"):
                tensor = (_to_torch(raw[info.offset : info.offset + info.nbytes], info, torch.float32) - 1).to(dtype)
            else:
                tensor = _to_torch(raw[info.offset : info.offset + info.nbytes], info, dtype)
            if permute and (".q_proj." in hf_name or ".k_proj." in hf_name):
                heads = n_heads if ".q_proj." in hf_name else n_kv_heads
                if isinstance(tensor, GGUFWeight):  # a row permutation: whole rows of blocks move
                    tensor = GGUFWeight(tensor.ggml_type, tensor.shape, unpermute_qk(tensor.data, heads))
                else:
                    tensor = unpermute_qk(tensor, heads)
            yield hf_name, tensor
    finally:
        del raw
