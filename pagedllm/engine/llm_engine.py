"""LLMEngine: input processing (validation, tokenization, ``n`` fan-out) + EngineCore + OutputProcessor.

Synchronous; ``LLM`` drives it offline and ``AsyncLLM`` drives it from a background thread for the server.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

from pagedllm.config import EngineArgs, EngineConfig
from pagedllm.engine.core import EngineCore
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.engine.output_processor import ChildState, OutputProcessor, ParentState
from pagedllm.outputs import RequestOutput
from pagedllm.request import Request, RequestStatus
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

# A prompt: text, token ids, or vLLM's dict forms {"prompt": str} / {"prompt_token_ids": [...]}.
PromptType = Union[str, list[int], dict]


@dataclass
class ProcessedPrompt:
    prompt: Optional[str]
    prompt_token_ids: list[int]
    cache_salt: Optional[str] = None  # from a dict prompt's "cache_salt" (vLLM's TextPrompt/TokensPrompt field)


def _check_cache_salt(salt) -> Optional[str]:
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError(f"cache_salt must be a non-empty string, got {salt!r}.")
    return salt


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
        self._counter = itertools.count()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(args.create_engine_config())

    # ------------------------------------------------------------------ input processing
    def process_prompt(self, prompt: PromptType) -> ProcessedPrompt:
        """Tokenizes and validates one prompt.

        Raises:
            ValueError: naming ``prompt`` (empty, wrong type, too long) or ``prompt_token_ids`` (ids outside the
                vocabulary).
        """
        text: Optional[str] = None
        salt = None
        if isinstance(prompt, dict):
            salt = _check_cache_salt(prompt.get("cache_salt"))
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                text = prompt["prompt"]
                ids = None
            else:
                raise ValueError("prompt dict must have 'prompt' or 'prompt_token_ids'.")
        elif isinstance(prompt, str):
            text, ids = prompt, None
        elif isinstance(prompt, (list, tuple)):
            ids = prompt
        else:
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}.")
        if text is not None:
            if self.tokenizer is None:
                raise ValueError("prompt must be token ids when skip_tokenizer_init=True.")
            if not isinstance(text, str):
                raise ValueError("prompt must be a string.")
            if not text:
                raise ValueError("prompt must not be empty.")
            ids = self.tokenizer.encode(text, add_special_tokens=True)
        ids = list(ids)
        if not ids:
            raise ValueError("prompt must not be empty (0 tokens).")
        vocab = self.config.model.vocab_size
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise ValueError(f"prompt_token_ids has a token id outside the vocabulary [0, {vocab}): {t!r}.")
        max_len = self.config.model.max_model_len
        if len(ids) > max_len:
            raise ValueError(f"prompt is {len(ids)} tokens long, more than max_model_len={max_len} tokens.")
        return ProcessedPrompt(text, ids, salt)

    def validate_params(self, params: SamplingParams, num_prompt_tokens: int) -> None:
        """Raises ValueError naming the field (max_tokens, logprobs, token ids)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}.")
        mc = self.config.model
        params.verify_for_model(mc.vocab_size, mc.max_logprobs)
        if params.structured_outputs is not None:
            from pagedllm.structured_output import validate_structured_outputs

            if mc.skip_tokenizer_init:
                raise ValueError("structured_outputs needs a tokenizer (the engine runs with skip_tokenizer_init).")
            validate_structured_outputs(params.structured_outputs, self.config.structured_outputs)
        max_len = mc.max_model_len
        if num_prompt_tokens >= max_len:
            raise ValueError(
                f"prompt is {num_prompt_tokens} tokens long; with max_model_len={max_len} there is no room for "
                f"any output token.")
        if params.max_tokens is not None and num_prompt_tokens + params.max_tokens > max_len:
            raise ValueError(
                f"max_tokens={params.max_tokens} plus the prompt's {num_prompt_tokens} tokens is "
                f"{num_prompt_tokens + params.max_tokens} tokens, more than max_model_len={max_len}.")

    def add_request(
        self,
        request_id: str,
        prompt: PromptType | ProcessedPrompt,
        params: SamplingParams,
        arrival_time: Optional[float] = None,
        cache_salt: Optional[str] = None,
    ) -> None:
        """Validates, fans ``n > 1`` out into child requests ``"{i}_{request_id}"``, and queues them.

        ``cache_salt`` (or a dict prompt's ``"cache_salt"``) isolates the request's prefix-cache entries: only
        requests with the same salt share KV blocks.

        Raises:
            ValueError: for bad input (nothing is queued then).
        """
        if request_id in self.output_processor.parents:
            raise ValueError(f"request_id {request_id!r} is already in use.")
        pp = prompt if isinstance(prompt, ProcessedPrompt) else self.process_prompt(prompt)
        self.validate_params(params, len(pp.prompt_token_ids))
        cache_salt = _check_cache_salt(cache_salt if cache_salt is not None else pp.cache_salt)
        arrival_time = time.time() if arrival_time is None else arrival_time
        n = params.n
        children: list[ChildState] = []
        core_reqs: list[Request] = []
        for i in range(n):
            cp = params if n == 1 else params.clone()
            if n > 1:
                cp.n = 1
                if params.seed is not None:
                    cp.seed = params.seed + i
            cid = request_id if n == 1 else f"{i}_{request_id}"
            det = None
            if cp.detokenize and self.tokenizer is not None:
                det = IncrementalDetokenizer(
                    self.tokenizer, pp.prompt_token_ids, skip_special_tokens=cp.skip_special_tokens,
                    spaces_between_special_tokens=cp.spaces_between_special_tokens, stop=cp.stop,
                    include_stop_str_in_output=cp.include_stop_str_in_output)
            children.append(ChildState(request_id=cid, index=i, sampling_params=cp, detokenizer=det))
            core_reqs.append(Request(cid, pp.prompt_token_ids, cp, self.eos_token_ids, arrival_time,
                                     cache_salt=cache_salt, max_model_len=self.config.model.max_model_len))
        self.output_processor.add_request(ParentState(
            request_id=request_id, prompt=pp.prompt, prompt_token_ids=pp.prompt_token_ids,
            output_kind=params.output_kind, arrival_time=arrival_time, children=children))
        for r in core_reqs:
            self.engine_core.add_request(r)

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
        outs, to_stop = self.output_processor.process_outputs(core_outputs)
        if to_stop:
            self.engine_core.abort_requests(to_stop, RequestStatus.FINISHED_STOPPED)
        return outs

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.parents)

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def get_tokenizer(self):
        return self.tokenizer
