"""The model runner: owns the model, the KV cache tensors and per-request token state; runs one step.

Per step it flattens every scheduled token of every request (in ``SchedulerOutput.num_scheduled_tokens`` order)
into ``input_ids [num_tokens]``, ``positions [num_tokens]`` and ``slot_mapping [num_tokens]``, builds
``block_tables [num_reqs, max_blocks]``, ``seq_lens [num_reqs]``, ``query_start_loc [num_reqs + 1]``, runs the
model once, computes logits only where a token is sampled (or prompt logprobs were asked for) and samples.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from pagedllm.attention.torch_attn import build_attention_metadata
from pagedllm.config import EngineConfig
from pagedllm.core.output import LogprobsLists, ModelRunnerOutput, SchedulerOutput
from pagedllm.layers.sampler import (
    LogprobsTensors,
    Sampler,
    SamplerRequestState,
    SamplingMetadata,
    compute_prompt_logprobs,
)
from pagedllm.sampling_params import SamplingParams

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
    # Prompt positions whose logprobs were already returned (survives preemption: never repeated).
    num_prompt_logprobs_done: int = 0
    sampler_state: Optional[SamplerRequestState] = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.sampler_state = SamplerRequestState(
            sampling_params=self.sampling_params,
            prompt_token_ids=self.prompt_token_ids,
            output_token_ids=[],
            generator=self.generator,
            eos_token_ids=self.eos_token_ids,
        )


def kv_cache_bytes_per_block(kv_spec: list[tuple[int, int]], block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block across all layers: sum over layers of 2 (K, V) * block_size * kv_heads * head_dim."""
    elem = torch.empty((), dtype=dtype).element_size()
    return sum(2 * block_size * h * d * elem for h, d in kv_spec)


def determine_num_blocks(config: EngineConfig, kv_spec: list[tuple[int, int]]) -> int:
    """Physical block count (null block included) from ``kv_cache_memory_bytes`` or the explicit override.

    Raises:
        ValueError: if one request of ``max_model_len`` tokens can't fit, with the numbers needed.
    """
    cc = config.cache
    per_block = kv_cache_bytes_per_block(kv_spec, cc.block_size, config.model.dtype)
    num_blocks = cc.num_blocks or (cc.kv_cache_memory_bytes // per_block)
    needed = -(-config.model.max_model_len // cc.block_size)
    if num_blocks - 1 < needed:
        raise ValueError(
            f"KV cache too small: {num_blocks - 1} usable blocks of {cc.block_size} tokens "
            f"({per_block} bytes each, {(num_blocks) * per_block} bytes in all) can't hold one request of "
            f"max_model_len={config.model.max_model_len} tokens, which needs {needed} blocks "
            f"({(needed + 1) * per_block} bytes). Raise --kv-cache-memory-bytes (or --num-gpu-blocks-override) "
            f"or lower --max-model-len."
        )
    return int(num_blocks)


class ModelRunner:
    def __init__(self, config: EngineConfig, model: torch.nn.Module, num_blocks: int,
                 device: torch.device | str = "cpu") -> None:
        self.config = config
        self.model = model
        self.device = torch.device(device)
        self.block_size = config.cache.block_size
        self.num_blocks = num_blocks
        self.vocab_size = config.model.vocab_size
        self.sliding_window = getattr(model, "sliding_window", None)
        self.kv_caches = [
            torch.zeros(2, num_blocks, self.block_size, h, d, dtype=config.model.dtype, device=self.device)
            for h, d in model.kv_cache_spec()
        ]
        self.sampler = Sampler()
        self.requests: dict[str, CachedRequestState] = {}

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
        for cr in sched.scheduled_cached_reqs:
            st = self.requests[cr.req_id]
            st.num_computed_tokens = cr.num_computed_tokens
            if cr.resumed_from_preemption:
                st.block_ids = list(cr.new_block_ids)
                if cr.all_token_ids is not None and len(cr.all_token_ids) != len(st.token_ids):
                    st.token_ids = list(cr.all_token_ids)
                    st.sampler_state.output_token_ids[:] = st.token_ids[len(st.prompt_token_ids):]
            else:
                st.block_ids.extend(cr.new_block_ids)

    # ------------------------------------------------------------------ step
    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
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
            for st, s, q in zip(states, starts, query_lens):
                ids.extend(st.token_ids[s:s + q])
            q_arr = np.asarray(query_lens, dtype=np.int64)
            req_idx_np = np.repeat(np.arange(num_reqs, dtype=np.int64), q_arr)
            offsets = np.arange(num_tokens, dtype=np.int64) - np.repeat(np.cumsum(q_arr) - q_arr, q_arr)
            pos_np = np.repeat(np.asarray(starts, dtype=np.int64), q_arr) + offsets
        max_blocks = max(len(st.block_ids) for st in states)
        bt_np = np.zeros((num_reqs, max_blocks), dtype=np.int64)
        for i, st in enumerate(states):
            bt_np[i, : len(st.block_ids)] = st.block_ids
        slot_np = bt_np[req_idx_np, pos_np // bs] * bs + pos_np % bs

        input_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
        positions = torch.from_numpy(pos_np).to(self.device)
        slot_mapping = torch.from_numpy(slot_np).to(self.device)
        block_tables = torch.from_numpy(bt_np).to(self.device)
        meta = build_attention_metadata(query_lens, seq_lens, block_tables, slot_mapping, bs, self.sliding_window)

        hidden = self.model(input_ids, positions, self.kv_caches, meta)

        # Rows that sample: their last scheduled token is the last known token.
        sample_rows = [i for i, st in enumerate(states) if seq_lens[i] >= len(st.token_ids)]
        qsl = np.cumsum([0] + query_lens)
        sampled_lists: list[list[int]] = [[] for _ in req_ids]
        logprobs_out: dict[str, LogprobsLists] = {}
        if sample_rows:
            last_idx = torch.tensor([int(qsl[i + 1]) - 1 for i in sample_rows], dtype=torch.int64,
                                    device=self.device)
            logits = self.model.compute_logits(hidden.index_select(0, last_idx))
            rows = [states[i].sampler_state for i in sample_rows]
            md = SamplingMetadata.build(rows, self.vocab_size, self.device)
            so = self.sampler(logits, md)
            sampled = so.sampled_token_ids.tolist()
            for j, i in enumerate(sample_rows):
                st = states[i]
                tok = sampled[j]
                sampled_lists[i] = [tok]
                st.token_ids.append(tok)
                st.sampler_state.output_token_ids.append(tok)
            if so.logprobs is not None:
                lp = so.logprobs
                tid = lp.token_ids.tolist()
                lps = lp.logprobs.tolist()
                ranks = lp.ranks.tolist()
                for j, i in enumerate(sample_rows):
                    k = states[i].sampling_params.logprobs
                    if k is None:
                        continue
                    logprobs_out[req_ids[i]] = LogprobsLists([tid[j][: k + 1]], [lps[j][: k + 1]], [ranks[j]])

        prompt_lp = self._prompt_logprobs(states, starts, query_lens, qsl, hidden)
        return ModelRunnerOutput(
            req_ids=req_ids,
            sampled_token_ids=sampled_lists,
            logprobs=logprobs_out or None,
            prompt_logprobs=prompt_lp or None,
        )

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
            rows = torch.arange(int(qsl[i]) + lo - starts[i], int(qsl[i]) + hi - starts[i], device=self.device)
            logits = self.model.compute_logits(hidden.index_select(0, rows))
            targets = torch.tensor(st.prompt_token_ids[lo + 1:hi + 1], dtype=torch.int64, device=self.device)
            lp: LogprobsTensors = compute_prompt_logprobs(logits, targets, k)
            out[st.req_id] = LogprobsLists(lp.token_ids.tolist(), lp.logprobs.tolist(), lp.ranks.tolist())
            st.num_prompt_logprobs_done = hi
        return out
