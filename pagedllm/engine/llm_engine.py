"""LLMEngine: ``InputProcessor`` (validation, tokenization) + ``n`` fan-out + EngineCore + OutputProcessor.

Synchronous; ``LLM`` drives it offline and ``AsyncLLM`` drives it from a background thread for the server.

Fault isolation: work that belongs to one request (its prefix hashes and detokenizer when it is added; its
detokenizing, stop strings and logprobs each step) runs under a per-request guard. If it raises, only that request
ends (its children are aborted, its final output has ``finish_reason="error"``, and ``take_request_errors``
reports it); the batch runs on. A fault in the step itself (the model forward) propagates: the caller must treat
the engine as dead.
"""

from __future__ import annotations

import itertools
import logging
from typing import Optional, Sequence

from pagedllm.config import EngineArgs, EngineConfig
from pagedllm.engine.core import EngineCore
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.engine.exceptions import InvalidRequestError, RequestFailedError
from pagedllm.engine.input_processor import EngineCoreRequest, InputProcessor, ProcessedPrompt, PromptType
from pagedllm.engine.output_processor import ChildState, OutputProcessor, ParentState
from pagedllm.outputs import RequestOutput
from pagedllm.request import Request, RequestStatus
from pagedllm.sampling_params import SamplingParams

__all__ = ["EngineCoreRequest", "LLMEngine", "ProcessedPrompt", "PromptType"]

logger = logging.getLogger(__name__)

def _eos_from_config(hf_config) -> list[int]:
    eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        return []
    return list(eos) if isinstance(eos, (list, tuple)) else [int(eos)]


class LLMEngine:
    def __init__(self, config: EngineConfig, model=None) -> None:
        """``model``: an already-loaded model to reuse (tests build engine variants around one model)."""
        from pagedllm.tokenizer import get_eos_token_ids, get_tokenizer

        self.config = config
        mc = config.model
        if mc.skip_tokenizer_init:
            self.tokenizer = None
            self.eos_token_ids: set[int] = set(_eos_from_config(mc.hf_config))
        else:
            self.tokenizer = get_tokenizer(mc.tokenizer)
            self.eos_token_ids = set(get_eos_token_ids(self.tokenizer, mc.model))
        from pagedllm.structured_output import make_structured_output_manager

        so_manager = make_structured_output_manager(config, self.tokenizer, mc.vocab_size, self.eos_token_ids)
        self.engine_core = EngineCore(config, model=model, structured_output_manager=so_manager)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.input_processor = InputProcessor(config, self.tokenizer)
        self._counter = itertools.count()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(args.create_engine_config())

    # ------------------------------------------------------------------ input processing
    def process_prompt(self, prompt: PromptType) -> ProcessedPrompt:
        """Tokenizes and validates one prompt (``InputProcessor.process_prompt``). Raises ValueError naming the
        field."""
        return self.input_processor.process_prompt(prompt)

    def validate_params(self, params: SamplingParams, num_prompt_tokens: int) -> None:
        """``InputProcessor.process_params``: raises ValueError naming the field."""
        self.input_processor.process_params(params, num_prompt_tokens)

    def add_request(
        self,
        request_id: str,
        prompt: PromptType | ProcessedPrompt,
        params: SamplingParams,
        arrival_time: Optional[float] = None,
        cache_salt: Optional[str] = None,
    ) -> None:
        """Validates (``InputProcessor``), fans ``n > 1`` out into child requests ``"{i}_{request_id}"``, and
        queues them.

        ``cache_salt`` (or a dict prompt's ``"cache_salt"``) isolates the request's prefix-cache entries: only
        requests with the same salt share KV blocks.

        Raises:
            ValueError: for bad input (nothing is queued then).
        """
        if request_id in self.output_processor.parents:
            raise InvalidRequestError(f"request_id {request_id!r} is already in use.", param="request_id")
        self.add_core_request(self.input_processor.make_request(request_id, prompt, params, arrival_time,
                                                                cache_salt))

    def add_core_request(self, req: EngineCoreRequest) -> None:
        """Queues a request the ``InputProcessor`` has checked. Everything that can fail (child ids, detokenizers,
        prefix hashes) happens before any engine state changes, so on an exception nothing is queued.

        Raises:
            InvalidRequestError: a request (or child) id already in use.
            Exception: from the request's own set-up (nothing queued; the engine is unharmed).
        """
        request_id = req.request_id
        op = self.output_processor
        if request_id in op.parents:
            raise InvalidRequestError(f"request_id {request_id!r} is already in use.", param="request_id")
        params = req.sampling_params
        n = params.n
        child_ids = [request_id] if n == 1 else [f"{i}_{request_id}" for i in range(n)]
        known = self.engine_core.scheduler.requests
        if any(c in known or c in op.child_to_parent for c in child_ids):
            raise InvalidRequestError(f"request_id {request_id!r} clashes with a request in flight.",
                                      param="request_id")
        special_stop = self.input_processor.special_stop_token_ids(params.stop) if params.stop else {}
        children: list[ChildState] = []
        core_reqs: list[Request] = []
        max_len = self.config.model.max_model_len
        for i, cid in enumerate(child_ids):
            cp = params if n == 1 else params.clone()
            if n > 1:
                cp.n = 1
                if params.seed is not None:
                    cp.seed = params.seed + i
            det = None
            if cp.detokenize and self.tokenizer is not None:
                det = IncrementalDetokenizer(
                    self.tokenizer, req.prompt_token_ids, skip_special_tokens=cp.skip_special_tokens,
                    spaces_between_special_tokens=cp.spaces_between_special_tokens, stop=cp.stop,
                    include_stop_str_in_output=cp.include_stop_str_in_output, special_stop=special_stop)
            children.append(ChildState(request_id=cid, index=i, sampling_params=cp, detokenizer=det,
                                       fault=req.fault))
            r = Request(cid, req.prompt_token_ids, cp, self.eos_token_ids, req.arrival_time,
                        cache_salt=req.cache_salt, max_model_len=max_len)
            self.engine_core.kv_cache_manager.update_block_hashes(r)  # the salt is hashed here, per request
            core_reqs.append(r)
        op.add_request(ParentState(
            request_id=request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
            output_kind=params.output_kind, arrival_time=req.arrival_time, children=children))
        for r in core_reqs:
            self.engine_core.add_request(r)
        if req.fault == "forward":
            self.engine_core.forward_fault_req_ids.update(child_ids)

    def abort_request(self, request_ids: Sequence[str] | str) -> list[RequestOutput]:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        outs = []
        for rid in request_ids:
            child_ids = self.output_processor.child_ids(rid)
            self.engine_core.abort_requests(child_ids)
            ro = self.output_processor.abort_parent(rid)
            if ro is not None:
                outs.append(ro)
        return outs

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[RequestOutput]:
        core_outputs = self.engine_core.step()
        op = self.output_processor
        outs, to_stop = op.process_outputs(core_outputs)
        if to_stop:
            self.engine_core.abort_requests(to_stop, RequestStatus.FINISHED_STOPPED)
        if op.failed_child_ids:
            failed, op.failed_child_ids = op.failed_child_ids, []
            self.engine_core.abort_requests(failed)
        return outs

    def take_request_errors(self) -> list[tuple[str, RequestFailedError]]:
        """``(request_id, error)`` for each request that failed alone since the last call (see the module note);
        its final output, with ``finish_reason="error"``, was among ``step``'s outputs."""
        errors, self.output_processor.errors = self.output_processor.errors, []
        return errors

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.parents)

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def warm_up_structured_outputs(self) -> bool:
        """Starts building the structured-output backend in its pool (no wait); False without structured outputs."""
        so = self.engine_core.structured_output_manager
        if so is None:
            return False
        so.warm_up()
        return True

    def get_tokenizer(self):
        return self.tokenizer
