"""A Llama-family model's decoder layers in one C call per step (``kernels/csrc/llama_stack.c``).

Why: a decode step of SmolLM2 calls ~240 C kernels through Python (4 linears, 2 norms, RoPE + cache write and
attention per layer, each ~10-20 us of dispatch, argument conversion and output allocation). ``stack_forward`` calls
the same kernels, in the same order, on the same data, through function pointers, so its output equals the Python
path's bit for bit (``tests/test_fused_stack.py``); only the per-call overhead goes.

It runs where every layer is a fast path: bf16, one process (no tensor/pipeline parallelism), every linear either a
``PackedLinear`` on a packed-kernel backend (``packed_linear.LINEAR_BACKENDS``: AMX, or dpbf16 without AMX; all on
the same one, gate_up packed gated) or an int4 ``QuantLinear`` the int4 GEMV takes as it is (GGUF Q4_0/Q4_1, GPTQ/AWQ without act-order or bias;
then only decode-only steps, or with ``batch_invariant`` off steps of <= ``INT4_GEMV_MAX_TOKENS`` tokens) or a GGUF
K-quant ``QuantLinear`` (``kquant_matmul`` on its tiled shards, a bf16 bias allowed; decode-only steps), no q/k norm (Qwen3), the C
RMSNorm/RoPE/decode-attention kernels built, one attention metadata for all layers, and for steps with prefill
tokens the AMX prefill attention kernel available (level ``amx``, head_dim % 32 == 0, <= 128; block_size % 16 == 0).
So it runs at every ISA level that has those kernels (decode steps below ``amx``). Elsewhere, and with
``KernelConfig.fused_stack`` off (``PAGEDLLM_FUSED_STACK=0``), the model's Python layer loop runs as before.
Gemma 3 has its own loop (``GemmaFusedStack``, ``gemma_stack_forward``: decode steps; bf16 packed or K-quant
linears): Gemma-3-270M Q4_K_M 15.5 -> 11.3 ms a token (Xeon AMX).
Measured (SmolLM2, interleaved, best of 40 steps): bf16 batch 1 11.7-12.7 vs 15.3-15.7 ms, batch 16 at 500-token
contexts 23.3-24.4 vs 28.3-28.9 ms; the 4-bit GGUF at batch 1 7.2-7.3 vs 10.9-16.4 ms. Qwen2.5-Coder-1.5B Q4_K_M (K-quant linears), EPYC Zen 3, batch 1,
48 tokens, three runs each: 54-61 vs 68-76 ms a token.
"""

from __future__ import annotations

import ctypes
from typing import Any, Optional

import torch

from pagedllm import kernels
from pagedllm.attention.cpu_kernels import _sync_decode_amx
from pagedllm.attention.torch_attn import AttentionMetadata
from pagedllm.layers.quantization.kernels import INT4_GEMV_MAX_TOKENS
from pagedllm.kernels.bindings import StackGroup as _Group
from pagedllm.kernels.bindings import StackLayer as _Layer
from pagedllm.kernels.bindings import StackKqShard as _KqShard
from pagedllm.kernels.bindings import StackModel as _Model
from pagedllm.kernels.bindings import StackStep as _Step


def _addr(lib: ctypes.CDLL, name: str) -> int:
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value


def _linear_kind(mod: Any) -> Optional[int]:
    """0: a ``PackedLinear`` on a packed-kernel backend; 1: an int4 ``QuantLinear`` the int4 GEMV takes as it is (no input
    permutation, bf16 scales, group % 4 == 0); 2: a GGUF K-quant ``QuantLinear`` (tiled shards); kinds 1 and 2 with
    no bias or a contiguous bf16 one; None: another layer (the fused loop doesn't run)."""
    from pagedllm.layers.packed_linear import PackedLinear
    from pagedllm.layers.quantization.kernels import INT4_OURS
    from pagedllm.layers.quantization.linear import QuantLinear

    if type(mod) is PackedLinear:
        return 0 if mod._amx is not None else None
    if type(mod) is not QuantLinear or not (
            mod.bias is None or (mod.bias.dtype == torch.bfloat16 and mod.bias.is_contiguous())):
        return None
    if (mod.kind == "int4" and mod.perm is None and mod.scales_and_zeros.dtype == torch.bfloat16
            and mod._kernel_group % 4 == 0 and mod._int4_layout == INT4_OURS):
        return 1
    if mod.kind == "kquant" and all(w.is_tiled for w in mod._kq):
        return 2
    return None


def built_stack(model: Any, cls: type) -> Optional["FusedStack"]:
    """``model``'s C layer loop (``cls.build``), built on the first call after its weights are packed or quantized
    and kept on the model; None where it can't run, or while the weights are still loading (the Python loop)."""
    stack = model.__dict__.get("_stack", False)
    if stack is False:
        from pagedllm.layers.packed_linear import PackedLinear

        qkv = getattr(getattr(model.layers[0], "self_attn", None), "qkv_proj", None)
        if not isinstance(qkv, PackedLinear) and getattr(qkv, "kind", "loading") == "loading":
            return None
        stack = model.__dict__["_stack"] = cls.build(model)
    return stack


def _uniform_layers(model: Any, layer_cls: type, layer_ok: Any) -> Optional[tuple[list, set]]:
    """``(layers, kinds)``: the model's decoder layers, where the fused loop is on, the model runs in one process,
    every layer is a ``layer_cls`` whose four linears have kinds (``_linear_kind``) that ``layer_ok(layer, kinds)``
    accepts (its attention, MLP and norms), all with the first layer's attention shape and a qkv of that shape, and
    heads the decode kernel takes; ``kinds`` is the set of their linears' kinds. None otherwise."""
    if not kernels.config().fused_stack:
        return None
    from pagedllm.distributed.parallel_state import get_pp_size, get_tp_size

    if get_tp_size() > 1 or get_pp_size() > 1:
        return None
    layers = list(getattr(model, "layers", ()))
    if not layers or any(type(layer) is not layer_cls for layer in layers):
        return None
    a0 = layers[0].self_attn
    kinds: set = set()
    for layer in layers:
        att, mlp = layer.self_attn, layer.mlp
        layer_kinds = [_linear_kind(m) for m in (att.qkv_proj, att.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        if None in layer_kinds or not layer_ok(layer, layer_kinds):
            return None
        kinds.update(layer_kinds)
        if (att.num_heads, att.num_kv_heads, att.head_dim, att.attn.scale) != (
                a0.num_heads, a0.num_kv_heads, a0.head_dim, a0.attn.scale):
            return None
        if att.qkv_proj.out_features != (att.num_heads + 2 * att.num_kv_heads) * att.head_dim:
            return None
    if (a0.num_heads % a0.num_kv_heads or a0.num_heads // a0.num_kv_heads > 64 or a0.head_dim > 512
            or a0.head_dim % 2):
        return None
    return layers, kinds


def _stack_libs(layers: list, kinds: set) -> Optional[tuple]:
    """``(cpu, stack, kquant)`` libraries for these layers (kquant None without K-quant linears), or None: one is
    missing, or the packed linears are on more than one backend."""
    from pagedllm.attention.cpu_kernels import get_lib
    from pagedllm.layers.quantization import kquant

    cpu, lib = get_lib(), kernels.lib("stack")
    backends = {m.backend for layer in layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                         layer.mlp.gate_up_proj, layer.mlp.down_proj)
                if _linear_kind(m) == 0}
    kq = kquant.get_lib() if 2 in kinds else None
    if cpu is None or lib is None or len(backends) > 1 or (2 in kinds and kq is None):
        return None
    return cpu, lib, kq


class FusedStack:
    """The C layer loop for one model; ``build`` returns None where it can't run (see the module docstring).

    ``forward(x [T, hidden] bf16, cos [T, 1, D] (the rotary view), kv_caches, meta)`` -> ``(x, residual)``, each
    ``[T, hidden]`` bf16, the last layer's output and residual stream (the final norm is the caller's), or None when
    this step can't take the fused path (the caller then runs its layer loop).
    """

    def __init__(self, model: Any, lib: ctypes.CDLL, cpu: ctypes.CDLL, amx: Optional[ctypes.CDLL],
                 int4: Optional[ctypes.CDLL], prefill_ok: bool, kq: Optional[ctypes.CDLL] = None) -> None:
        layers = list(model.layers)
        a0 = layers[0].self_attn
        self.hidden = layers[0].input_layernorm.hidden_size
        self.H, self.KVH, self.D = a0.num_heads, a0.num_kv_heads, a0.head_dim
        self.inter = layers[0].mlp.gate_up_proj.out_features // 2
        self.prefill_ok = prefill_ok
        # int4 linears run on int4_gemv_bf16, as the Python path runs decode rows (batch invariant: only steps
        # without prefill rows, which it gives the C tile kernel; else steps of <= INT4_GEMV_MAX_TOKENS tokens)
        self.any_int4 = False
        self.int4_max_tokens = None if kernels.config().batch_invariant else INT4_GEMV_MAX_TOKENS
        # K-quant linears run kquant_matmul on kquant_decode_bits(bf16) activations, the Python path's decode rows (prefill
        # rows take other widths or the bf16 tile path: steps with prefill rows take the Python loop)
        self.any_kq = False
        self._keep: list = []  # the shard arrays the C structs point into
        self.layers = layers
        self._lib, self._cpu = lib, cpu
        self._arr = (_Layer * len(layers))()
        m_linear = None
        for i, layer in enumerate(layers):
            att, mlp = layer.self_attn, layer.mlp
            s = self._arr[i]
            for field, mod in (("qkv", att.qkv_proj), ("o", att.o_proj), ("gate_up", mlp.gate_up_proj),
                               ("down", mlp.down_proj)):
                d = getattr(s, field)
                if _linear_kind(mod) == 0:
                    d.kind, d.w, d.bias = 0, mod._w_ptr, mod._b_ptr
                    m_linear = mod._amx
                elif _linear_kind(mod) == 2:  # the shards side by side
                    shards = (_KqShard * len(mod._kq))(*[(int(w.ggml_type), w.rows, w.data.data_ptr())
                                                          for w in mod._kq])
                    self._keep.append(shards)
                    d.kind, d.w, d.group = 2, ctypes.addressof(shards), len(shards)
                    self.any_kq = True
                else:
                    d.kind, d.w, d.sz = 1, mod.packed.data_ptr(), mod.scales_and_zeros.data_ptr()
                    d.group, d.n_pad = mod._kernel_group, mod.packed.shape[0]
                    self.any_int4 = True
                if d.kind:  # a bf16 bias (or NULL), added as the Python path adds it
                    d.bias = None if mod.bias is None else mod.bias.data_ptr()
            s.ln_in = layer.input_layernorm.weight.data_ptr()
            s.ln_post = layer.post_attention_layernorm.weight.data_ptr()
            s.window = int(att.attn.sliding_window or 0)
        m = self._model = _Model()
        m.num_layers, m.hidden, m.inter = len(layers), self.hidden, self.inter
        m.H, m.KVH, m.D = self.H, self.KVH, self.D
        m.eps, m.scale = layers[0].input_layernorm.eps, a0.attn.scale
        m.rms, m.rope = _addr(cpu, "add_rms_norm_bf16"), _addr(cpu, "rope_cache_bf16")
        m.decode, m.silu_mul = _addr(cpu, "paged_decode_bf16"), _addr(cpu, "silu_mul_bf16")
        if m_linear is not None:  # the packed layers' backend (one for all: checked in build)
            m.linear = ctypes.cast(m_linear, ctypes.c_void_p).value
        if amx is not None:
            m.prefill = _addr(amx, "amx_prefill_attention_bf16")
        if int4 is not None:
            m.int4 = _addr(int4, "int4_gemv_bf16")
        if kq is not None:
            m.kq_quant, m.kq_matmul = _addr(kq, "kq_quantize_act"), _addr(kq, "kq_matmul_shards")
            m.kq_act_bits = kernels.config().kquant_decode_bits(torch.bfloat16)  # the loop's activations are bf16
        self._kq_max_k = max(self.hidden, self.H * self.D, self.inter)
        self._kq_scratch = torch.empty(0, dtype=torch.uint8)
        m.layers = ctypes.cast(self._arr, ctypes.c_void_p)
        self._kv_key: Optional[tuple] = None
        self._step = _Step()
        self._scratch = torch.empty(0, dtype=torch.bfloat16)  # activations, grown to the largest step

    @classmethod
    def build(cls, model: Any) -> Optional["FusedStack"]:
        """``model``: a ``LlamaModel`` (after its weights are packed or quantized). None where the fused loop can't
        run."""
        from pagedllm.layers.layernorm import RMSNorm
        from pagedllm.layers.quantization import cpu_kernels as int4_kernels
        from pagedllm.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP

        def layer_ok(layer: Any, kinds: list) -> bool:
            att, mlp = layer.self_attn, layer.mlp
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            return (type(att) is LlamaAttention and type(mlp) is LlamaMLP and att.q_norm is None
                    and not (kinds[2] == 0 and not mlp.gate_up_proj.gated)
                    and all(type(n) is RMSNorm and n.weight.dtype == torch.bfloat16 and n.weight.is_contiguous()
                            and n.eps == model.layers[0].input_layernorm.eps for n in norms))

        found = _uniform_layers(model, LlamaDecoderLayer, layer_ok)
        libs = _stack_libs(found[0], found[1]) if found else None
        if libs is None:
            return None
        (layers, kinds), (cpu, lib, kq) = found, libs
        amx = kernels.lib("amx")  # the AMX prefill attention (level amx only)
        int4 = int4_kernels.get_lib() if 1 in kinds else None
        if 1 in kinds and (int4 is None or not int4_kernels.int4_gemv_supported()):
            return None
        a0 = layers[0].self_attn
        prefill_ok = (kernels.config().amx_attention and a0.head_dim % 32 == 0
                      and a0.head_dim <= 128 and amx is not None)
        return cls(model, lib, cpu, amx, int4, prefill_ok, kq)

    def _bind_caches(self, kv_caches: list[torch.Tensor]) -> bool:
        key = tuple(kv.data_ptr() for kv in kv_caches)
        if key == self._kv_key:
            return True
        if len(kv_caches) != len(self.layers):
            return False
        bs = None
        for s, kv in zip(self._arr, kv_caches):
            if (kv.dtype != torch.bfloat16 or not kv.is_contiguous() or kv.dim() != 5
                    or kv.shape[3:] != (self.KVH, self.D)):
                return False
            s.k_cache, s.v_cache = kv[0].data_ptr(), kv[1].data_ptr()
            bs = kv.shape[2]
        self._model.BS = bs
        self._kv_key = key
        return True

    def forward(self, x: torch.Tensor, cos: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: Any) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        if not isinstance(meta, AttentionMetadata) or x.dtype != torch.bfloat16 or not x.is_contiguous():
            return None
        if cos.dtype != torch.bfloat16 or cos.stride(2) != 1 or cos.shape[-1] != self.D:
            return None
        if not self._bind_caches(kv_caches):
            return None
        pb, dec = meta.prefill_batch, meta.decode
        if meta.prefills and (not self.prefill_ok or pb is None or self._model.BS % 16):
            return None
        slots = meta.slot_mapping
        if slots.dtype != torch.int64 or not slots.is_contiguous():
            return None
        T = x.shape[0]
        if self.any_int4 and (T > self.int4_max_tokens if self.int4_max_tokens is not None else meta.prefills):
            return None
        if self.any_kq and meta.prefills:
            return None
        s = self._step
        s.T, s.x, s.cs, s.cs_stride, s.slots = T, x.data_ptr(), cos.data_ptr(), cos.stride(0), slots.data_ptr()
        if dec is not None:
            if not dec.block_tables.is_contiguous():
                return None
            _sync_decode_amx(self._cpu)
            s.n_dec, s.dec_max_blocks = dec.block_tables.shape[0], dec.block_tables.shape[1]
            s.dec_bt, s.dec_seq_lens = dec.block_tables.data_ptr(), dec.seq_lens.data_ptr()
            s.dec_rows = None if dec.all_rows else dec.token_rows.data_ptr()
        else:
            s.n_dec = 0
        if meta.prefills:
            s.n_pre, s.pre_max_blocks = pb.q_starts.shape[0], pb.block_tables.shape[1]
            s.pre_bt, s.pre_q_starts = pb.block_tables.data_ptr(), pb.q_starts.data_ptr()
            s.pre_q_lens, s.pre_seq_lens = pb.q_lens.data_ptr(), pb.seq_lens.data_ptr()
            s.pre_ws = pb.workspace(self.KVH, self.D).data_ptr()
        else:
            s.n_pre = 0
        x_out = torch.empty_like(x)
        res_out = torch.empty_like(x)
        need = self._lib.stack_scratch_elems(ctypes.addressof(self._model), T)
        if self._scratch.numel() < need:  # kept across steps: a prefill step's ~17 MB would be new pages each time
            self._scratch = torch.empty(need, dtype=torch.bfloat16)
        s.x_out, s.res_out, s.scratch = x_out.data_ptr(), res_out.data_ptr(), self._scratch.data_ptr()
        if self.any_kq:  # the quantized activations: hi, lo [T, k] int8, xs, xs * sum [T, k / 32], sums [T, k / 16]
            kq_need = 5 * T * self._kq_max_k // 2
            if self._kq_scratch.numel() < kq_need:
                self._kq_scratch = torch.empty(kq_need, dtype=torch.uint8)
            s.kq_scratch = self._kq_scratch.data_ptr()
        self._lib.stack_forward(ctypes.addressof(self._model), ctypes.addressof(s))
        return x_out, res_out


class GemmaFusedStack(FusedStack):
    """Gemma 3's decoder layers in one C call per decode step (``gemma_stack_forward`` in ``llama_stack.c``): its six
    norms (``gemma_rms_norm_bf16``), GeGLU (``gelu_tanh_mul_bf16``), a rotary table per layer type and an attention
    metadata group per KV cache group, the same kernels in the same order as ``Gemma3DecoderLayer``'s C path, so the
    output is the Python loop's bit for bit (``tests/test_fused_stack.py``).

    ``forward(x [T, hidden] bf16 (the scaled embeddings), rope {layer type: (cos, sin)}, kv_caches, metas [one per
    layer])`` -> ``x [T, hidden]``, the last layer's output (the final norm is the caller's), or None when the step
    can't take it (prefill rows, a norm or kernel the C path doesn't take): the caller runs its layer loop.
    """

    def __init__(self, model: Any, lib: ctypes.CDLL, cpu: ctypes.CDLL, kq: Optional[ctypes.CDLL]) -> None:
        super().__init__(model, lib, cpu, None, None, False, kq)
        self.rope_types = sorted(set(model.layer_types))  # index 0 -> cs, 1 -> cs2
        for s, layer, t in zip(self._arr, self.layers, model.layer_types):
            att = layer.self_attn
            s.g_in, s.g_post_attn = layer.input_layernorm.scale.data_ptr(), layer.post_attention_layernorm.scale.data_ptr()
            s.g_pre_ff = layer.pre_feedforward_layernorm.scale.data_ptr()
            s.g_post_ff = layer.post_feedforward_layernorm.scale.data_ptr()
            s.g_q, s.g_k = att.q_norm.scale.data_ptr(), att.k_norm.scale.data_ptr()
            s.rope_sel = self.rope_types.index(t)
        m = self._model
        m.eps = model.layers[0].input_layernorm.eps
        m.gnorm, m.gelu_mul = _addr(cpu, "gemma_rms_norm_bf16"), _addr(cpu, "gelu_tanh_mul_bf16")
        self._groups = (_Group * len(self.layers))()
        self._group_of: Optional[tuple] = None
        self._step.groups = ctypes.addressof(self._groups)

    @classmethod
    def build(cls, model: Any) -> Optional["GemmaFusedStack"]:
        """``model``: a ``Gemma3Model`` (after its weights are packed or quantized). None where it can't run."""
        from pagedllm.layers.layernorm import GemmaRMSNorm
        from pagedllm.models.gemma3 import Gemma3Attention, Gemma3DecoderLayer, Gemma3MLP

        def layer_ok(layer: Any, kinds: list) -> bool:
            att, mlp = layer.self_attn, layer.mlp
            norms = (layer.input_layernorm, layer.post_attention_layernorm, layer.pre_feedforward_layernorm,
                     layer.post_feedforward_layernorm, att.q_norm, att.k_norm)
            return (type(att) is Gemma3Attention and type(mlp) is Gemma3MLP and mlp.approximate == "tanh"
                    and 1 not in kinds and not (kinds[2] == 0 and mlp.gate_up_proj.gated)
                    and all(type(n) is GemmaRMSNorm and n.scale.dtype == torch.float32 and n.scale.is_contiguous()
                            and n.eps == model.layers[0].input_layernorm.eps for n in norms))

        found = _uniform_layers(model, Gemma3DecoderLayer, layer_ok)
        libs = _stack_libs(found[0], found[1]) if found and len(set(model.layer_types)) <= 2 else None
        if libs is None:
            return None
        cpu, lib, kq = libs
        return cls(model, lib, cpu, kq)

    def forward_gemma(self, x: torch.Tensor, rope: dict, kv_caches: list[torch.Tensor],
                      metas: list) -> Optional[torch.Tensor]:
        if x.dtype != torch.bfloat16 or not x.is_contiguous() or len(metas) != len(self.layers):
            return None
        cs = []
        for t in self.rope_types:
            cos = rope[t][0]
            if cos.dtype != torch.bfloat16 or cos.stride(2) != 1 or cos.shape[-1] != self.D:
                return None
            cs.append(cos)
        if not self._bind_caches(kv_caches):
            return None
        index: dict[int, int] = {}
        for meta in metas:
            if id(meta) in index:
                continue
            if not isinstance(meta, AttentionMetadata) or meta.prefills or meta.decode is None:
                return None
            dec, slots = meta.decode, meta.slot_mapping
            if (not dec.block_tables.is_contiguous() or slots.dtype != torch.int64 or not slots.is_contiguous()):
                return None
            g = self._groups[len(index)]
            g.slots, g.n_dec, g.dec_max_blocks = slots.data_ptr(), dec.block_tables.shape[0], dec.block_tables.shape[1]
            g.dec_bt, g.dec_seq_lens = dec.block_tables.data_ptr(), dec.seq_lens.data_ptr()
            g.dec_rows = None if dec.all_rows else dec.token_rows.data_ptr()
            index[id(meta)] = len(index)
        group_of = tuple(index[id(meta)] for meta in metas)
        if group_of != self._group_of:
            for s, gi in zip(self._arr, group_of):
                s.group = gi
            self._group_of = group_of
        _sync_decode_amx(self._cpu)
        T = x.shape[0]
        s = self._step
        s.T, s.x, s.n_pre, s.n_dec = T, x.data_ptr(), 0, 0
        s.cs, s.cs_stride = cs[0].data_ptr(), cs[0].stride(0)
        s.cs2, s.cs2_stride = cs[-1].data_ptr(), cs[-1].stride(0)
        x_out = torch.empty_like(x)
        need = self._lib.stack_scratch_elems(ctypes.addressof(self._model), T)
        if self._scratch.numel() < need:
            self._scratch = torch.empty(need, dtype=torch.bfloat16)
        s.x_out, s.res_out, s.scratch = x_out.data_ptr(), None, self._scratch.data_ptr()
        if self.any_kq:
            kq_need = 5 * T * self._kq_max_k // 2
            if self._kq_scratch.numel() < kq_need:
                self._kq_scratch = torch.empty(kq_need, dtype=torch.uint8)
            s.kq_scratch = self._kq_scratch.data_ptr()
        self._lib.gemma_stack_forward(ctypes.addressof(self._model), ctypes.addressof(s))
        return x_out
