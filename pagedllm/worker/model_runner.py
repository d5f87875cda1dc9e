"""The model runner: owns the model, the KV cache tensors and per-request token state; runs one step.

Per step it flattens every scheduled token of every request (in ``SchedulerOutput.num_scheduled_tokens`` order)
into ``input_ids [num_tokens]``, ``positions [num_tokens]`` and ``slot_mapping [num_tokens]``, builds
``block_tables [num_reqs, max_blocks]``, ``seq_lens [num_reqs]``, ``query_start_loc [num_reqs + 1]``, runs the
model once, computes logits only where a token is sampled (or prompt logprobs were asked for) and samples.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch

from pagedllm import kernels
from pagedllm.attention.torch_attn import AttentionMetadata, DecodeBatch, build_attention_metadata
from pagedllm.config import EngineConfig
from pagedllm.core.output import LogprobsLists, ModelRunnerOutput, SchedulerOutput
from pagedllm.layers.packed_linear import pack_linear_weights, packing_supported
from pagedllm.layers.quantization.kernels import step_rows
from pagedllm.kv_cache_spec import KVCacheLayout, KVCacheSpec, as_kv_cache_specs, plan_kv_cache_layout
from pagedllm.layers.sampler import (
    LogprobsTensors,
    Sampler,
    SamplerRequestState,
    SamplingMetadata,
    compute_prompt_logprobs,
)
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec_decode.adaptive import StepCosts
from pagedllm.spec_decode.drafter import make_drafter
from pagedllm.spec_decode.verify import GeneratorRewind, accept, verify_rows
from pagedllm.structured_output import apply_grammar_bitmask
from pagedllm.utils.hugepages import zeroed_mapping
from pagedllm.utils.malloc import keep_step_memory

logger = logging.getLogger(__name__)


@dataclass
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # prompt + output so far
    block_ids: list[int]
    num_computed_tokens: int
    sampling_params: SamplingParams
    generator: Optional[torch.Generator]
    eos_token_ids: set[int]
    # Block tables of KV cache groups 1.. (models with sliding-window and full-attention layers).
    group_block_ids: list[list[int]] = field(default_factory=list)
    # Prompt positions whose logprobs were already returned (survives preemption: never repeated).
    num_prompt_logprobs_done: int = 0
    sampler_state: Optional[SamplerRequestState] = field(default=None, repr=False)
    # A model drafter's record of the draft K/V it left in this request's blocks (``DraftModelDrafter``): None, or
    # (first position, end position, the block ids holding them); cleared on preemption.
    draft_kv: Optional[tuple[int, int, tuple[int, ...]]] = field(default=None, repr=False)
    # How many of its first tokens a model drafter's K/V holds (``DraftModelDrafter``: it computes them lazily).
    draft_computed: int = 0

    def __post_init__(self) -> None:
        self.sampler_state = SamplerRequestState(
            sampling_params=self.sampling_params,
            prompt_token_ids=self.prompt_token_ids,
            output_token_ids=[],
            generator=self.generator,
            eos_token_ids=self.eos_token_ids,
        )


def kv_cache_bytes_per_block(kv_spec: Sequence[KVCacheSpec], block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block across all layers: sum over layers of block_size * the layer's bytes per token
    (``2 * kv_heads * head_dim`` elements for K/V, ``kv_lora_rank + qk_rope_head_dim`` for an MLA latent)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return sum(block_size * spec.bytes_per_token(elem) for spec in as_kv_cache_specs(kv_spec))


def allocate_kv_caches(kv_spec: Sequence[KVCacheSpec], num_blocks: int, block_size: int, dtype: torch.dtype,
                       device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """One zeroed cache tensor per layer, shaped by its spec (see ``pagedllm.kv_cache_spec``).

    On CPU they share one anonymous mapping (``pagedllm.utils.hugepages.zeroed_mapping``; advised for huge
    pages with ``PAGEDLLM_HUGEPAGES=1``) whose pages become resident as blocks are first written, so the budget is
    checked against the memory the OS says is available instead of being faulted in here. The check can't see what
    other processes will take later (another server's untouched KV cache included): size
    ``--kv-cache-memory-bytes`` for the machine, as a full cache is resident memory.

    Raises:
        ValueError: on CPU, if the caches need more bytes than ``MemAvailable`` (Linux ``/proc/meminfo``) holds.
    """
    shapes = [spec.cache_shape(num_blocks, block_size) for spec in as_kv_cache_specs(kv_spec)]
    if torch.device(device).type == "cpu":
        elem = torch.empty((), dtype=dtype).element_size()
        need = sum(math.prod(s) for s in shapes) * elem
        avail = _mem_available_bytes()
        if avail is not None and need > avail:
            raise ValueError(f"The KV cache needs {need / 2**30:.2f} GiB ({num_blocks} blocks of {block_size} "
                             f"tokens) but only {avail / 2**30:.2f} GiB of memory is available: lower "
                             f"--kv-cache-memory-bytes.")
        return zeroed_mapping(shapes, dtype)
    return [torch.zeros(s, dtype=dtype, device=device) for s in shapes]


def _mem_available_bytes() -> Optional[int]:
    """``MemAvailable`` from ``/proc/meminfo`` in bytes; None where there is no such file (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def determine_num_blocks(config: EngineConfig, kv_spec: Sequence[KVCacheSpec],
                         layout: Optional[KVCacheLayout] = None,
                         draft_layout: Optional[KVCacheLayout] = None) -> int:
    """Physical block count (null block included) from ``kv_cache_memory_bytes`` or the explicit override.

    With several KV cache groups (``layout``), a block is ``layout.layers_per_group`` layers deep and one request
    holds blocks in every group (fewer in sliding-window groups). A drafter with a KV cache of its own
    (``draft_layout``: the ``draft_model``'s layout, or the target's for ``self_int4``; see
    ``pagedllm.spec_decode.draft_model``) shares the budget: each block costs the target's bytes plus the draft's,
    and the draft's scratch blocks come off the top, so ``num_blocks = (budget - scratch) // (target + draft)``.

    Raises:
        ValueError: if one request of ``max_model_len`` tokens can't fit, with the numbers needed.
    """
    cc = config.cache
    layout = layout or plan_kv_cache_layout(kv_spec)
    elem = torch.empty((), dtype=config.model.dtype).element_size()
    per_block = layout.bytes_per_block(cc.block_size, elem)
    budget = cc.kv_cache_memory_bytes
    spec_cfg = getattr(config, "speculative", None)
    if draft_layout is not None and spec_cfg is not None:
        from pagedllm.spec_decode.draft_model import draft_kv_bytes

        mc = spec_cfg.draft_model_config
        draft_elem = elem if mc is None else torch.empty((), dtype=mc.dtype).element_size()
        draft_per_block, scratch = draft_kv_bytes(spec_cfg, cc.block_size, draft_layout, draft_elem)
        per_block += draft_per_block
        budget = max(0, budget - scratch)
    num_blocks = cc.num_blocks or (budget // per_block)
    max_chunk = getattr(getattr(config, "scheduler", None), "max_num_batched_tokens", config.model.max_model_len)
    needed = layout.blocks_for_one_request(config.model.max_model_len, cc.block_size, max_chunk)
    if num_blocks - 1 < needed:
        raise ValueError(
            f"KV cache too small: {num_blocks - 1} usable blocks of {cc.block_size} tokens "
            f"({per_block} bytes each, {(num_blocks) * per_block} bytes in all) can't hold one request of "
            f"max_model_len={config.model.max_model_len} tokens, which needs {needed} blocks "
            f"({(needed + 1) * per_block} bytes). Raise --kv-cache-memory-bytes (or --num-gpu-blocks-override) "
            f"or lower --max-model-len."
        )
    return int(num_blocks)


def block_tables_array(tables: Sequence[Sequence[int]], groups: int, num_reqs: int) -> np.ndarray:
    """``tables``: ``groups * num_reqs`` block id lists, group-major -> ``[groups, num_reqs, width]`` int64, each
    padded with 0 (the null block) to the longest (one conversion of a flat list: about half the time of a row
    assignment per table at 16 requests and 6 groups)."""
    width = max(len(t) for t in tables)
    flat: list[int] = []
    for t in tables:
        flat.extend(t)
        if len(t) < width:
            flat.extend([0] * (width - len(t)))
    return np.fromiter(flat, dtype=np.int64, count=len(flat)).reshape(groups, num_reqs, width)


class ModelRunner:
    def __init__(self, config: EngineConfig, model: torch.nn.Module, num_blocks: int,
                 device: torch.device | str = "cpu", layout: Optional[KVCacheLayout] = None,
                 draft_model: Optional[torch.nn.Module] = None) -> None:
        """``draft_model``: the loaded draft of ``speculative_config.method`` ``draft_model`` (default: loaded here,
        ``spec_decode.draft_model.load_draft_model``)."""
        self.config = config
        self.model = model
        self.device = torch.device(device)
        spec_cfg = getattr(config, "speculative", None)
        if spec_cfg is not None and spec_cfg.method == "self_int4":
            from pagedllm.spec_decode.self_int4 import int4_draft_model

            int4_draft_model(model)  # from the bf16 weights before packing (kept on the model)
        if packing_supported(config.model.dtype, self.device):
            pack_linear_weights(model)  # oneDNN layout once, instead of a reorder inside every matmul
        self.block_size = config.cache.block_size
        self.num_blocks = num_blocks
        self.vocab_size = config.model.vocab_size
        self.sliding_window = getattr(model, "sliding_window", None)
        # One tensor per slot; each layer uses its slot's (with one KV cache group: one tensor per layer).
        self.layout = layout or plan_kv_cache_layout(model.kv_cache_spec())
        slot_caches = allocate_kv_caches(self.layout.slot_specs, num_blocks, self.block_size, config.model.dtype,
                                         self.device)
        self.kv_caches = [slot_caches[s] for s in self.layout.layer_slot]
        self.num_groups = self.layout.num_groups
        # each group's attention window (a full-attention group: the model's, if it has one)
        self.attn_windows = [w or self.sliding_window for w in self.layout.group_windows]
        self.sampler = Sampler()
        self.requests: dict[str, CachedRequestState] = {}
        self.drafter = make_drafter(spec_cfg, self, draft_model) if spec_cfg is not None else None
        self._draft_blocks = getattr(self.drafter, "mirrors", False)  # a drafter tracking its K/V per block
        self.spec_costs = StepCosts()
        if kernels.config().malloc_keep:  # the weights and KV caches are in memory: steps reuse what they free
            keep_step_memory()

    # ------------------------------------------------------------------ state updates
    def _update_states(self, sched: SchedulerOutput) -> None:
        for rid in sched.finished_req_ids:
            self.requests.pop(rid, None)
        for nr in sched.scheduled_new_reqs:
            sp = nr.sampling_params
            gen = None
            if sp.seed is not None:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(sp.seed)
            self.requests[nr.req_id] = CachedRequestState(
                req_id=nr.req_id,
                prompt_token_ids=list(nr.prompt_token_ids),
                token_ids=list(nr.prompt_token_ids),
                block_ids=list(nr.block_ids),
                num_computed_tokens=nr.num_computed_tokens,
                sampling_params=sp,
                generator=gen,
                eos_token_ids=set(nr.eos_token_ids),
            )
            if self.num_groups > 1:
                self.requests[nr.req_id].group_block_ids = [
                    list(ids) for ids in sched.new_group_block_ids[nr.req_id]]
            if self._draft_blocks:
                self.drafter.admit(self.requests[nr.req_id], nr.num_computed_tokens)
        for cr in sched.scheduled_cached_reqs:
            st = self.requests[cr.req_id]
            st.num_computed_tokens = cr.num_computed_tokens
            group_ids = sched.new_group_block_ids.get(cr.req_id) if self.num_groups > 1 else None
            if cr.resumed_from_preemption:
                st.block_ids = list(cr.new_block_ids)
                st.draft_kv = None
                if self._draft_blocks:
                    self.drafter.admit(st, cr.num_computed_tokens)
                if self.num_groups > 1:
                    st.group_block_ids = [list(ids) for ids in group_ids]
                if cr.all_token_ids is not None and len(cr.all_token_ids) != len(st.token_ids):
                    st.token_ids = list(cr.all_token_ids)
                    st.sampler_state.output_token_ids[:] = st.token_ids[len(st.prompt_token_ids):]
            else:
                st.block_ids.extend(cr.new_block_ids)
                if self._draft_blocks and cr.new_block_ids:
                    self.drafter.forget(cr.new_block_ids)
                new_ids = cr.new_token_ids
                if new_ids:  # pipeline parallel: tokens sampled on the output rank (which has them already)
                    missing = (max(cr.num_computed_tokens, len(st.prompt_token_ids)) + len(new_ids)
                               - len(st.token_ids))
                    if missing > 0:
                        st.token_ids.extend(new_ids[-missing:])
                        st.sampler_state.output_token_ids.extend(new_ids[-missing:])
                if group_ids:
                    for table, ids in zip(st.group_block_ids, group_ids):
                        table.extend(ids)

    # ------------------------------------------------------------------ step
    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        t_start = time.perf_counter()
        self._update_states(sched)
        if sched.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        bs = self.block_size
        req_ids = list(sched.num_scheduled_tokens.keys())
        states = [self.requests[r] for r in req_ids]
        query_lens = [sched.num_scheduled_tokens[r] for r in req_ids]
        starts = [st.num_computed_tokens for st in states]
        seq_lens = [s + q for s, q in zip(starts, query_lens)]
        num_reqs = len(req_ids)
        num_tokens = sum(query_lens)

        # input_ids / positions: decode rows are one token each; prefill chunks are sliced from the token lists.
        if num_tokens == num_reqs:
            ids = [st.token_ids[s] for st, s in zip(states, starts)]
            pos_np = np.asarray(starts, dtype=np.int64)
            req_idx_np = np.arange(num_reqs, dtype=np.int64)
        else:
            ids = []
            spec = sched.scheduled_spec_decode_tokens
            for rid, st, s, q in zip(req_ids, states, starts, query_lens):
                drafts = spec.get(rid) if spec else None
                if drafts:  # the last sampled token, then the drafts to verify
                    ids.extend(st.token_ids[s:s + q - len(drafts)])
                    ids.extend(drafts)
                else:
                    ids.extend(st.token_ids[s:s + q])
            q_arr = np.asarray(query_lens, dtype=np.int64)
            req_idx_np = np.repeat(np.arange(num_reqs, dtype=np.int64), q_arr)
            offsets = np.arange(num_tokens, dtype=np.int64) - np.repeat(np.cumsum(q_arr) - q_arr, q_arr)
            pos_np = np.repeat(np.asarray(starts, dtype=np.int64), q_arr) + offsets
        # Every KV cache group's block tables [groups, num_reqs, width] and slots [groups, num_tokens] at once.
        tables = [st.block_ids for st in states]
        if self.num_groups > 1:
            tables += [st.group_block_ids[g] for g in range(self.num_groups - 1) for st in states]
        bt_np = block_tables_array(tables, self.num_groups, num_reqs)
        # (C order: numpy lays a mixed slice / fancy index result out with the indexed axis first)
        slot_np = np.ascontiguousarray(bt_np[:, req_idx_np, pos_np // bs] * bs + pos_np % bs)

        input_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
        positions = torch.from_numpy(pos_np).to(self.device)
        slot_mappings = torch.from_numpy(slot_np).to(self.device)
        all_tables = torch.from_numpy(bt_np).to(self.device)
        slot_mapping, block_tables = slot_mappings[0], all_tables[0]
        # A row's kind follows its position, however the step cut the request: the prompt's tokens but its last are
        # prefill rows; the last prompt token (whose logits give the first output token) and generated tokens are
        # decode rows (attention and int4 kernels). So a speculating request's 1 + k verify rows, and output tokens
        # recomputed after a preemption, are computed exactly as the plain decode step at their position computed
        # them, and the first output token's row is the same whether its prompt came whole, in chunks, or held back
        # a token (structured outputs prefill all but the last prompt token while their grammar compiles).
        prefill_rows = [min(max(len(st.prompt_token_ids) - 1 - s, 0), q)
                        for st, s, q in zip(states, starts, query_lens)]
        meta = build_attention_metadata(query_lens, seq_lens, block_tables, slot_mapping, bs, self.sliding_window,
                                        prefill_rows=prefill_rows)
        if self.num_groups > 1:  # each group's layers read and write through the group's own block tables
            metas = self._group_metadata(query_lens, seq_lens, all_tables, slot_mappings, prefill_rows, meta)
            meta = [metas[g] for g in self.layout.layer_group]

        with step_rows(query_lens, prefill_rows=prefill_rows):  # int4 linears' kernel per row kind
            hidden = self.model(input_ids, positions, self.kv_caches, meta)

        # Rows that sample: their last scheduled token is the last known token.
        sample_rows = [i for i, st in enumerate(states) if seq_lens[i] >= len(st.token_ids)]
        qsl = list(itertools.accumulate(query_lens, initial=0))  # query start of each request (ints)
        sampled_lists: list[list[int]] = [[] for _ in req_ids]
        logprobs_out: dict[str, LogprobsLists] = {}
        unsampled: frozenset = frozenset()
        if sample_rows:
            # Speculating requests sample len(drafts) + 1 rows each (spec_decode/verify.py).
            drafts = None
            if sched.scheduled_spec_decode_tokens:
                drafts = [sched.scheduled_spec_decode_tokens.get(req_ids[i], ()) for i in sample_rows]
                row_idx, rows = verify_rows([qsl[i + 1] for i in sample_rows],
                                            [states[i].sampler_state for i in sample_rows], drafts)
            else:
                row_idx = [qsl[i + 1] - 1 for i in sample_rows]
                rows = [states[i].sampler_state for i in sample_rows]
            if len(row_idx) == hidden.shape[0] and row_idx == list(range(len(row_idx))) and hidden.is_contiguous():
                sample_hidden = hidden  # every row samples, in order (a decode-only step): no gather
            else:
                sample_hidden = hidden.index_select(0, torch.tensor(row_idx, dtype=torch.int64, device=self.device))
            logits = self.model.compute_logits(sample_hidden)
            gb = sched.grammar_bitmask
            if gb is not None and hasattr(gb, "result"):  # filled beside the forward pass (engine/core.py)
                gb = gb.result()
            if gb is not None:  # structured outputs: disallowed tokens -> -inf (such requests get no drafts)
                row_req_ids = ([req_ids[i] for i in sample_rows] if drafts is None else
                               [req_ids[i] for i, d in zip(sample_rows, drafts) for _ in range(len(d) + 1)])
                logits = apply_grammar_bitmask(logits, gb, row_req_ids)
                unsampled = gb.unsampled
            md = SamplingMetadata.build(rows, self.vocab_size, self.device)
            rewind = GeneratorRewind([states[i].sampler_state for i in sample_rows], drafts) if drafts else None
            # A request whose grammar was still compiling draws nothing: its seeded generator is put back.
            gen_saved = [(g, g.get_state()) for i in sample_rows if req_ids[i] in unsampled
                         for g in (states[i].sampler_state.generator,) if g is not None] if unsampled else ()
            so = self.sampler(logits, md)  # None on a pipeline rank that doesn't sample (see worker.py)
            for g, state in gen_saved:
                g.set_state(state)
            sampled = so.sampled_token_ids.tolist() if so is not None else ()
            if drafts is None:
                outputs, first_row = [[t] for t in sampled], range(len(sampled))
            else:
                outputs, first_row = accept(sampled, drafts)
                if rewind.saved:
                    rewind.advance(outputs)
            for j, toks in enumerate(outputs):
                i = sample_rows[j]
                if unsampled and req_ids[i] in unsampled:
                    continue
                st = states[i]
                sampled_lists[i] = toks
                st.token_ids.extend(toks)
                st.sampler_state.output_token_ids.extend(toks)
            if so is not None and so.logprobs is not None:
                lp = so.logprobs
                tid = lp.token_ids.tolist()
                lps = lp.logprobs.tolist()
                ranks = lp.ranks.tolist()
                for j, i in enumerate(sample_rows):
                    k = states[i].sampling_params.logprobs
                    if k is None or (unsampled and req_ids[i] in unsampled):
                        continue
                    r = first_row[j]
                    m = len(outputs[j])
                    logprobs_out[req_ids[i]] = LogprobsLists([t[: k + 1] for t in tid[r:r + m]],
                                                             [x[: k + 1] for x in lps[r:r + m]], ranks[r:r + m])
        spec_token_ids = spec_cost = None
        if self.drafter is not None:
            t_target = time.perf_counter()
            lim = sched.spec_draft_limits
            limits = [lim.get(r, self.drafter.k) for r in req_ids] if lim else None
            if getattr(self.drafter, "mirrors", False):  # a draft model computes this step's kept tokens too, then drafts
                spec_token_ids = self.drafter.propose(states, sampled_lists, starts, query_lens, limits)
            else:
                spec_token_ids = self.drafter.propose(states, sampled_lists, limits)
            if num_reqs == 1 and sampled_lists[0] and starts[0] >= len(states[0].prompt_token_ids):
                # a single stream's decode step: its costs (adaptive.StepCosts), in the scheduler's next step
                drafts = sched.scheduled_spec_decode_tokens.get(req_ids[0]) if sched.scheduled_spec_decode_tokens \
                    else None
                if query_lens[0] == 1 + len(drafts or ()):
                    self.spec_costs.observe_step(query_lens[0], t_target - t_start)
                    self.spec_costs.observe_draft(len(spec_token_ids[0]), time.perf_counter() - t_target)
            spec_cost = self.spec_costs.draft_token_cost()

        prompt_lp = self._prompt_logprobs(states, starts, query_lens, qsl, hidden)
        return ModelRunnerOutput(
            req_ids=req_ids,
            sampled_token_ids=sampled_lists,
            logprobs=logprobs_out or None,
            prompt_logprobs=prompt_lp or None,
            spec_token_ids=spec_token_ids,
            unsampled_req_ids=unsampled,
            spec_token_cost=spec_cost,
        )

    def _group_metadata(self, query_lens, seq_lens, tables: torch.Tensor, slots: torch.Tensor, prefill_rows,
                        base: AttentionMetadata) -> list[AttentionMetadata]:
        """The attention metadata of every KV cache group (``base``: group 0's), from their block tables
        ``tables [groups, num_reqs, width]`` and slots ``slots [groups, num_tokens]``. A step of plain decode rows
        only (the common one) shares ``base``'s token rows and lengths with each group's tables swapped in: the
        metadata ``build_attention_metadata`` would build, without rebuilding it (Gemma 3 has 6 groups)."""
        bs = self.block_size
        d = base.decode
        if base.prefills or d is None or not d.all_rows or d.block_tables.shape[0] != tables.shape[1]:
            return [base] + [build_attention_metadata(query_lens, seq_lens, tables[g], slots[g], bs,
                                                      self.attn_windows[g], prefill_rows=prefill_rows)
                             for g in range(1, self.num_groups)]
        width = d.block_tables.shape[1]
        dec_tables = tables if width == tables.shape[2] else tables[:, :, :width].contiguous()
        return [base] + [
            AttentionMetadata(num_tokens=base.num_tokens, num_reqs=base.num_reqs, slot_mapping=slots[g],
                              query_start_loc=base.query_start_loc, seq_lens=base.seq_lens, block_tables=tables[g],
                              block_size=bs,
                              decode=DecodeBatch(token_rows=d.token_rows, block_tables=dec_tables[g],
                                                 seq_lens=d.seq_lens, block_size=bs,
                                                 sliding_window=self.attn_windows[g], all_rows=True))
            for g in range(1, self.num_groups)]

    def _prompt_logprobs(self, states, starts, query_lens, qsl, hidden) -> dict[str, LogprobsLists]:
        """Logprobs of prompt tokens 1..P-1 (position p predicts token p+1), for requests that asked for them."""
        out: dict[str, LogprobsLists] = {}
        for i, st in enumerate(states):
            k = st.sampling_params.prompt_logprobs
            if k is None:
                continue
            p_len = len(st.prompt_token_ids)
            lo = max(starts[i], st.num_prompt_logprobs_done)
            hi = min(starts[i] + query_lens[i], p_len - 1)
            if hi <= lo:
                continue
            rows = torch.arange(qsl[i] + lo - starts[i], qsl[i] + hi - starts[i], device=self.device)
            logits = self.model.compute_logits(hidden.index_select(0, rows))
            targets = torch.tensor(st.prompt_token_ids[lo + 1:hi + 1], dtype=torch.int64, device=self.device)
            lp: LogprobsTensors = compute_prompt_logprobs(logits, targets, k)
            out[st.req_id] = LogprobsLists(lp.token_ids.tolist(), lp.logprobs.tolist(), lp.ranks.tolist())
            st.num_prompt_logprobs_done = hi
        return out
