"""Typed messages across the scheduler / model-runner boundary (no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from pagedllm.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner hasn't seen (first schedule). ``block_ids`` is its whole block table."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    eos_token_ids: set[int] = field(default_factory=set)


@dataclass
class CachedRequestData:
    """A request the runner knows. ``new_block_ids`` are appended to its block table, or replace it when
    ``resumed_from_preemption`` (then ``all_token_ids`` holds its prompt and output tokens so far).

    ``new_token_ids`` (pipeline parallel only: ranks other than the output rank never see sampled tokens): the
    output tokens among this step's scheduled tokens, i.e. ``all_token_ids[max(num_computed_tokens,
    num_prompt_tokens):num_computed_tokens + num_scheduled]`` (a decode: the last sampled token)."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    resumed_from_preemption: bool = False
    all_token_ids: Optional[list[int]] = None
    new_token_ids: Optional[list[int]] = None


@dataclass
class SchedulerOutput:
    """One step's work. ``num_scheduled_tokens`` is ordered: the runner lays requests out in this order."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]
    preempted_req_ids: set[str] = field(default_factory=set)
    # Models with several KV cache groups (sliding-window layers beside full-attention ones): block ids of groups
    # 1.. allocated this step, per request, ``[group - 1][i]`` (the whole tables for a new or resumed request).
    new_group_block_ids: dict[str, list[list[int]]] = field(default_factory=dict)
    # Speculative decoding: the draft tokens scheduled after each decoding request's last token (they are the last
    # ``len(ids)`` of its ``num_scheduled_tokens``); requests without drafts are absent.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # How many draft tokens the drafter proposes after this step for each request listed (adaptive speculation:
    # the share its acceptance earns); the others get ``num_speculative_tokens``.
    spec_draft_limits: dict[str, int] = field(default_factory=dict)
    # Structured outputs: ``(bitmask int32 [R, ceil(V / 32)], {request id: row})`` of the constrained requests that
    # sample this step, set by the engine core after schedule() (see pagedllm.structured_output).
    grammar_bitmask: Optional[Any] = None

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class LogprobsLists:
    """Per token: ``token_ids[i][0]`` is the sampled/target token, then the top-k; ``ranks[i]`` its vocab rank."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]

    def head(self, n: int) -> "LogprobsLists":
        """The first ``n`` tokens' entries."""
        return LogprobsLists(self.token_ids[:n], self.logprobs[:n], self.ranks[:n])


@dataclass
class ModelRunnerOutput:
    """What the runner computed: for request ``req_ids[i]``, ``sampled_token_ids[i]`` (empty while its prompt
    is still being prefilled in chunks; with draft tokens scheduled, the accepted drafts then the token sampled
    after them, 1 to ``1 + len(drafts)`` tokens).

    ``spec_token_ids[i]`` (speculative decoding; None when off): draft tokens proposed to follow the request's
    tokens after this step, for the next one (may be empty).

    ``unsampled_req_ids``: requests whose last token was computed but not sampled (structured outputs: the grammar
    was still compiling); the scheduler counts that token as not computed, so a later step computes it again."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: Optional[dict[str, LogprobsLists]] = None  # sampled-token logprobs, for requests that asked
    prompt_logprobs: Optional[dict[str, LogprobsLists]] = None  # for prompt positions computed this step
    spec_token_ids: Optional[list[list[int]]] = None
    unsampled_req_ids: frozenset = frozenset()
    # Speculative decoding: a draft token's cost in plain decode steps on this machine (``StepCosts``; None: unknown).
    spec_token_cost: Optional[float] = None


@dataclass
class EngineCoreOutput:
    """What one step produced for one request (deltas)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: Optional[LogprobsLists] = None
    new_prompt_logprobs: Optional[LogprobsLists] = None
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort"
    stop_reason: Optional[int | str] = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
