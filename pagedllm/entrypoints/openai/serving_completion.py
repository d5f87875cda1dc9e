"""``POST /v1/completions``.

A request may hold several prompts (a list of strings or of token-id lists); each becomes one engine request
``{id}-{i}`` and its ``n`` choices get indices ``i * n + j``. Every prompt and parameter is validated before any
request starts, so a bad one fails the whole call with a 400 and nothing runs.

Stream chunks: ``{"id", "object": "text_completion", "created", "model", "choices": [{"index", "text", "logprobs",
"finish_reason", "stop_reason"}]}``, one choice per chunk; ``finish_reason`` is non-null in exactly one chunk per
choice; with ``stream_options.include_usage`` a last chunk has ``"choices": []`` and ``usage``; then ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator, Optional, Union

from pagedllm.engine.input_processor import ProcessedPrompt
from pagedllm.entrypoints.openai.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    UsageInfo,
    random_id,
)
from pagedllm.entrypoints.openai.serving_engine import (
    SSE_DONE,
    OpenAIServing,
    bad_request,
    completion_logprobs,
    merge_async_iterators,
    prompt_logprobs_json,
    sse,
    sse_error,
)
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams


class OpenAIServingCompletion(OpenAIServing):
    def _prompts(self, prompt) -> list[Union[str, list[int]]]:
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise ValueError("prompt must not be empty.")
        if isinstance(prompt[0], int):
            return [prompt]
        cap = self.limits.max_num_prompts
        if len(prompt) > cap:
            raise ValueError(f"prompt may hold at most {cap} prompts (--max-num-prompts), got {len(prompt)}.")
        return list(prompt)

    def prepare(self, req: CompletionRequest) -> tuple[list[ProcessedPrompt], list[SamplingParams]]:
        """Tokenizes and validates every prompt. Raises OpenAIServingError (400)."""
        try:
            processed, params = [], []
            prompts = self._prompts(req.prompt)
            if req.n * len(prompts) > self.limits.max_n:
                raise ValueError(f"n times the number of prompts must be at most {self.limits.max_n}, got "
                                 f"{req.n} x {len(prompts)}.")
            for p in prompts:
                pp = self.engine.process_prompt(p)
                sp = req.to_sampling_params(self.max_model_len, len(pp.prompt_token_ids))
                self.engine.validate_params(sp, len(pp.prompt_token_ids))
                processed.append(pp)
                params.append(sp)
        except ValueError as e:
            raise bad_request(e) from None
        return processed, params

    async def create_completion(self, req: CompletionRequest) -> Union[CompletionResponse, AsyncIterator[str]]:
        """A ``CompletionResponse``, or (``stream``) an async iterator of SSE strings.

        Raises:
            OpenAIServingError: 400 (validation), 404 (model), 503 (engine dead), before anything runs.
        """
        model = self.check_model(req.model)
        self.check_engine()
        # Tokenizing (up to --max-num-prompts prompts) runs off the event loop.
        processed, params = await asyncio.to_thread(self.prepare, req)
        request_id = random_id("cmpl")
        created = int(time.time())
        gens = self.start_requests([(pp, sp, f"{request_id}-{i}", req.cache_salt)
                                    for i, (pp, sp) in enumerate(zip(processed, params))])
        if req.stream:
            return self._stream(req, model, request_id, created, processed, gens)
        finals: list[Optional[RequestOutput]] = [None] * len(gens)
        async for i, ro in merge_async_iterators(gens):
            finals[i] = ro
        return self._response(req, model, request_id, created, processed, finals)

    def _prompt_text(self, pp: ProcessedPrompt) -> str:
        return pp.prompt if pp.prompt is not None else self.tokenizer.decode(pp.prompt_token_ids)

    @staticmethod
    def _prompt_lps(ro: RequestOutput) -> list:
        n = len(ro.prompt_token_ids)
        lps = list(ro.prompt_logprobs or [])[:n]
        return lps + [None] * (n - len(lps))

    def _response(self, req: CompletionRequest, model: str, request_id: str, created: int,
                  processed: list[ProcessedPrompt], finals: list[RequestOutput]) -> CompletionResponse:
        choices = []
        num_prompt = num_completion = num_cached = 0
        for pi, (pp, ro) in enumerate(zip(processed, finals)):
            num_prompt += len(ro.prompt_token_ids)
            num_cached += ro.num_cached_tokens
            for c in sorted(ro.outputs, key=lambda c: c.index):
                num_completion += len(c.token_ids)
                text = c.text
                token_ids, lps = c.token_ids, c.logprobs
                if req.echo:
                    text = self._prompt_text(pp) + text
                    if req.logprobs is not None:
                        token_ids = list(ro.prompt_token_ids) + list(token_ids)
                        lps = self._prompt_lps(ro) + list(lps or [])
                logprobs = None
                if req.logprobs is not None and lps is not None:
                    logprobs = CompletionLogProbs(**completion_logprobs(
                        token_ids, lps, req.logprobs, self.tokenizer, as_token_ids=req.return_tokens_as_token_ids))
                choices.append(CompletionResponseChoice(
                    index=pi * req.n + c.index, text=text, logprobs=logprobs, finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    prompt_logprobs=prompt_logprobs_json(ro.prompt_logprobs) if req.prompt_logprobs is not None
                    else None))
        return CompletionResponse(id=request_id, created=created, model=model, choices=choices,
                                  usage=UsageInfo(**self.usage(num_prompt, num_completion, num_cached)))

    async def _stream(self, req: CompletionRequest, model: str, request_id: str, created: int,
                      processed: list[ProcessedPrompt], gens: list) -> AsyncIterator[str]:
        n = req.n
        num_choices = n * len(gens)
        echo_pending = [req.echo] * num_choices
        text_offsets = [0] * num_choices
        num_prompt = [0] * len(gens)
        num_cached = [0] * len(gens)
        num_completion = 0
        try:
            async for pi, ro in merge_async_iterators(gens):
                num_prompt[pi] = len(ro.prompt_token_ids)
                num_cached[pi] = ro.num_cached_tokens
                for c in ro.outputs:
                    idx = pi * n + c.index
                    num_completion += len(c.token_ids)
                    text, token_ids, lps = c.text, c.token_ids, c.logprobs
                    if echo_pending[idx]:
                        echo_pending[idx] = False
                        text = self._prompt_text(processed[pi]) + text
                        if req.logprobs is not None:
                            token_ids = list(ro.prompt_token_ids) + list(token_ids)
                            lps = self._prompt_lps(ro) + list(lps or [])
                    logprobs = None
                    if req.logprobs is not None and lps:
                        logprobs = completion_logprobs(token_ids, lps, req.logprobs, self.tokenizer,
                                                       text_offsets[idx], req.return_tokens_as_token_ids)
                        text_offsets[idx] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
                    # A token that completes no character yet still gets its chunk (text ""), as in vLLM: one chunk
                    # per step that made tokens, which clients count as the tokens' arrival.
                    if not text and not token_ids and c.finish_reason is None and logprobs is None:
                        continue
                    event = {"id": request_id, "object": "text_completion", "created": created, "model": model,
                             "choices": [{"index": idx, "text": text, "logprobs": logprobs,
                                          "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]}
                    if req.continuous_usage:  # cumulative usage in every chunk (vLLM's continuous_usage_stats)
                        event["usage"] = self.usage(sum(num_prompt), num_completion, sum(num_cached))
                    yield sse(event)
            if req.include_usage:
                yield sse({"id": request_id, "object": "text_completion", "created": created, "model": model,
                           "choices": [], "usage": self.usage(sum(num_prompt), num_completion, sum(num_cached))})
        except Exception as e:  # noqa: BLE001 - the status line is gone; report in-band
            yield sse_error(e)
        yield SSE_DONE
