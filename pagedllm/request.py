"""The engine's view of one request (one completion: a request with ``n > 1`` is fanned out into child requests)."""

from __future__ import annotations

import time
from enum import IntEnum
from typing import Optional

from pagedllm.sampling_params import SamplingParams


class RequestStatus(IntEnum):
    """Ordered: every status greater than PREEMPTED is a finished one."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finish_reason(status: "RequestStatus") -> Optional[str]:
        return _FINISH_REASON.get(status)


_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """Token-level state of one request, owned by the scheduler.

    ``num_computed_tokens`` counts tokens whose KV is in the cache (or being written this step); only the scheduler
    writes it. ``block_hashes[i]`` is the prefix hash of full block ``i`` of ``all_token_ids`` (filled lazily by the
    KV cache manager).

    ``spec_token_ids``: draft tokens proposed after the last step (speculative decoding), to follow
    ``all_token_ids``; never part of it until verified. ``spec_acceptance``: the recent share of this request's
    draft tokens that were accepted (``pagedllm.spec_decode.adaptive``).

    ``awaiting_grammar``: its structured-output grammar is still compiling; the scheduler may prefill all of its
    prompt but the last token (whose logits are sampled, under the grammar's mask), so the compile overlaps the
    prefill instead of adding to the time to first token.
    """

    __slots__ = (
        "request_id", "prompt_token_ids", "sampling_params", "eos_token_ids", "arrival_time", "output_token_ids",
        "all_token_ids", "num_computed_tokens", "status", "stop_reason", "num_cached_tokens", "block_hashes",
        "cache_salt", "max_tokens", "num_preemptions", "max_model_len", "spec_token_ids", "spec_acceptance",
        "awaiting_grammar",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: Optional[set[int]] = None,
        arrival_time: Optional[float] = None,
        cache_salt: Optional[str] = None,
        max_model_len: Optional[int] = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = set(eos_token_ids or ())
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: Optional[int | str] = None
        self.num_cached_tokens = -1  # prompt tokens found in the prefix cache when first scheduled
        self.block_hashes: list[bytes] = []
        self.cache_salt = cache_salt
        self.max_model_len = max_model_len
        mt = sampling_params.max_tokens
        if mt is None:
            mt = (max_model_len or 1 << 62) - len(self.prompt_token_ids)
        self.max_tokens = mt
        self.num_preemptions = 0
        self.spec_token_ids: list[int] = []
        self.spec_acceptance = 1.0
        self.awaiting_grammar = False

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def is_finished(self) -> bool:
        return self.status > RequestStatus.PREEMPTED

    def get_finish_reason(self) -> Optional[str]:
        return _FINISH_REASON.get(self.status)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
                f"out={self.num_output_tokens}, computed={self.num_computed_tokens})")
