"""The one place a request is validated: ``InputProcessor`` (vLLM's name) turns a prompt and ``SamplingParams``
into a typed, fully checked ``EngineCoreRequest`` before anything is queued. The engine thread never sees
unvalidated input; every failure is an ``InvalidRequestError`` (a ``ValueError``) whose ``param`` names the field,
which the server answers with a 400.

Why each bound exists (the README's "Request bounds" table lists them with their flags):
- integers a library consumes: ``seed`` (and ``seed + i`` for the ``n`` children) must fit ``torch.Generator
  .manual_seed``, which accepts ``[-2**63, 2**64 - 1]`` and raises on anything else *inside the engine step*;
  token ids must index the vocabulary; ``top_k`` at most the vocabulary size;
- strings must encode as UTF-8: JSON can carry a lone UTF-16 surrogate (``"\\ud800"``) that Python decodes but
  ``str.encode`` refuses; a ``cache_salt`` like that used to raise in the block hasher once the prompt filled a
  KV block;
- sizes (``n``, stop strings, ``logit_bias``, token-id lists) each have a flag, because each costs memory or
  per-step work in the engine;
- OpenAI's ranges: ``temperature`` [0, 2], ``top_p`` (0, 1], penalties [-2, 2], ``logit_bias`` [-100, 100]
  (NaN and infinities fail every range).

New request fields slot in with their own validator: ``InputProcessor.register_params_validator(fn)``, where
``fn(params, ctx)`` raises ``InvalidRequestError`` (``ctx`` is the processor: ``ctx.vocab_size``,
``ctx.limits``, ``ctx.tokenizer``...).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Optional, Sequence, Union

from pagedllm.config import InputLimits
from pagedllm.engine import fault_injection
from pagedllm.engine.exceptions import InvalidRequestError
from pagedllm.sampling_params import SamplingParams

__all__ = ["EngineCoreRequest", "InputProcessor", "ProcessedPrompt", "PromptType", "check_utf8",
           "find_unencodable"]

# A prompt: text, token ids, or vLLM's dict forms {"prompt": str} / {"prompt_token_ids": [...]}.
PromptType = Union[str, list[int], dict]

# torch.Generator.manual_seed's domain (it takes the seed as int64 or uint64).
SEED_MIN = -(1 << 63)
SEED_MAX = (1 << 64) - 1
# OpenAI's documented ranges.
TEMPERATURE_MAX = 2.0
PENALTY_RANGE = (-2.0, 2.0)
LOGIT_BIAS_RANGE = (-100.0, 100.0)
REPETITION_PENALTY_MAX = 100.0  # vLLM has no upper bound; any finite value works, this keeps it finite


@dataclass
class ProcessedPrompt:
    """A tokenized, checked prompt (the input of ``process_params`` / ``make_request``)."""

    prompt: Optional[str]
    prompt_token_ids: list[int]
    cache_salt: Optional[str] = None  # from a dict prompt's "cache_salt" (vLLM's TextPrompt/TokensPrompt field)


@dataclass
class EngineCoreRequest:
    """A request the engine may trust: every field checked by ``InputProcessor``. What crosses into the engine
    thread (or process) in place of raw input."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    cache_salt: Optional[str] = None
    fault: Optional[str] = None  # test hook (engine/fault_injection.py): "request" or "forward"


def find_unencodable(value: Any, path: str = "") -> Optional[str]:
    """The path (``a.0.b``) of the first string (value or dict key) in ``value`` that UTF-8 can't encode (a lone
    surrogate), or None. Walks dicts, lists and tuples; iterative, so deep nesting can't overflow the stack."""
    stack = [(value, path)]
    while stack:
        v, p = stack.pop()
        if isinstance(v, str):
            if not v.isascii():
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError:
                    return p or "(root)"
        elif isinstance(v, dict):
            for k, item in v.items():
                kp = f"{p}.{k}" if p else str(k)
                if isinstance(k, str) and find_unencodable(k) is not None:
                    return p or "(root)"
                stack.append((item, kp))
        elif isinstance(v, (list, tuple)):
            stack.extend((item, f"{p}.{i}" if p else str(i)) for i, item in enumerate(v))
    return None


def check_utf8(value: Any, param: str) -> None:
    """Raises ``InvalidRequestError`` naming ``param`` if a string in ``value`` is not encodable UTF-8."""
    where = find_unencodable(value, param)
    if where is not None:
        raise InvalidRequestError(f"{param} must be valid UTF-8 text: {where} holds a lone surrogate.",
                                  param=param, code="invalid_encoding")


def _bad(param: str, message: str, code: str = "invalid_value") -> InvalidRequestError:
    return InvalidRequestError(f"{param} {message}", param=param, code=code)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _in_range(v: Any, lo: float, hi: float) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and lo <= v <= hi


ParamsValidator = Callable[[SamplingParams, "InputProcessor"], None]


class InputProcessor:
    """Validates and tokenizes requests, for ``LLMEngine`` (offline) and ``AsyncLLM`` (the server), in the
    caller's thread. Reads only the frozen config and the tokenizer, so it is safe to use beside the engine.

    Args:
        config: an ``EngineConfig`` (``config.model``: ``vocab_size``, ``max_model_len``, ``max_logprobs``;
            ``config.limits``: an ``InputLimits``, default bounds if absent).
        tokenizer: encodes text prompts; None when the engine runs with ``skip_tokenizer_init``.
    """

    # Extra checks for fields other modules add (structured outputs, tools...): fn(params, processor).
    params_validators: ClassVar[list[ParamsValidator]] = []

    def __init__(self, config, tokenizer) -> None:
        mc = config.model
        self.config = config
        self.tokenizer = tokenizer
        self.vocab_size = int(mc.vocab_size)
        self.max_model_len = int(mc.max_model_len)
        self.max_logprobs = int(mc.max_logprobs)
        self.limits: InputLimits = getattr(config, "limits", None) or InputLimits()
        self._special_stop = None  # lazily: special-token text -> id (see special_stop_token_ids)

    @classmethod
    def register_params_validator(cls, fn: ParamsValidator) -> ParamsValidator:
        """Adds ``fn`` to the checks every ``SamplingParams`` passes (usable as a decorator)."""
        if fn not in cls.params_validators:
            cls.params_validators.append(fn)
        return fn

    # ------------------------------------------------------------------ prompts
    def process_prompt(self, prompt: PromptType, param: str = "prompt") -> ProcessedPrompt:
        """Tokenizes and validates one prompt.

        Raises:
            InvalidRequestError: naming ``prompt`` (empty, wrong type, not UTF-8, too long), ``prompt_token_ids``
                (ids outside the vocabulary) or ``cache_salt``.
        """
        text: Optional[str] = None
        salt = None
        if isinstance(prompt, dict):
            salt = self.check_cache_salt(prompt.get("cache_salt"))
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                text = prompt["prompt"]
                ids = None
                if not isinstance(text, str):
                    raise _bad(param, f"must be a string, got {type(text).__name__}.")
            else:
                raise _bad(param, "dict must have 'prompt' or 'prompt_token_ids'.")
        elif isinstance(prompt, str):
            text, ids = prompt, None
        elif isinstance(prompt, (list, tuple)):
            ids = prompt
        else:
            raise _bad(param, f"must be a string or a list of token ids, got {type(prompt).__name__}.")
        if text is not None:
            if self.tokenizer is None:
                raise _bad(param, "must be token ids when skip_tokenizer_init=True.")
            if not text:
                raise _bad(param, "must not be empty.")
            check_utf8(text, param)
            # A prompt longer than max_model_len tokens needs at least that many characters; far longer text is
            # refused before it costs a tokenization (a token is rarely over 64 characters).
            if len(text) > 64 * self.max_model_len:
                raise _bad(param, f"is {len(text)} characters long, far more than max_model_len="
                                  f"{self.max_model_len} tokens.", code="context_length_exceeded")
            ids = self.tokenizer.encode(text, add_special_tokens=True)
        if not isinstance(ids, (list, tuple)):
            raise _bad(param, f"prompt_token_ids must be a list of integers, got {type(ids).__name__}.")
        ids = list(ids)
        if not ids:
            raise _bad(param, "must not be empty (0 tokens).")
        if len(ids) > self.max_model_len:
            raise InvalidRequestError(
                f"{param} is {len(ids)} tokens long, more than max_model_len={self.max_model_len} tokens.",
                param=param, code="context_length_exceeded")
        vocab = self.vocab_size
        for t in ids:
            if not _is_int(t) or not 0 <= t < vocab:
                raise InvalidRequestError(
                    f"prompt_token_ids has a token id outside the vocabulary [0, {vocab}): {t!r}.", param=param)
        return ProcessedPrompt(text, ids, salt)

    def check_cache_salt(self, salt: Any) -> Optional[str]:
        if salt is None:
            return None
        if not isinstance(salt, str) or not salt:
            raise _bad("cache_salt", f"must be a non-empty string, got {salt!r}.")
        if len(salt) > self.limits.max_cache_salt_len:
            raise _bad("cache_salt", f"must be at most {self.limits.max_cache_salt_len} characters, got "
                                     f"{len(salt)}.")
        check_utf8(salt, "cache_salt")
        return salt

    # ------------------------------------------------------------------ sampling parameters
    def process_params(self, params: SamplingParams, num_prompt_tokens: int) -> None:
        """Checks ``params`` against the model and the bounds. Raises ``InvalidRequestError`` naming the field."""
        if not isinstance(params, SamplingParams):
            raise _bad("sampling_params", f"must be a SamplingParams, got {type(params).__name__}.")
        lim = self.limits
        vocab = self.vocab_size
        n = params.n
        if not _is_int(n) or not 1 <= n <= lim.max_n:
            raise _bad("n", f"must be an integer in [1, {lim.max_n}], got {n!r}.")
        if not _in_range(params.temperature, 0.0, TEMPERATURE_MAX):
            raise _bad("temperature", f"must be in [0, {TEMPERATURE_MAX:g}], got {params.temperature!r}.")
        if not (_in_range(params.top_p, 0.0, 1.0) and params.top_p > 0.0):
            raise _bad("top_p", f"must be in (0, 1], got {params.top_p!r}.")
        if not _is_int(params.top_k) or not 0 <= params.top_k <= vocab:
            raise _bad("top_k", f"must be -1, 0 (disable) or in [1, vocab_size={vocab}], got {params.top_k!r}.")
        if not _in_range(params.min_p, 0.0, 1.0):
            raise _bad("min_p", f"must be in [0, 1], got {params.min_p!r}.")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(params, name)
            if not _in_range(v, *PENALTY_RANGE):
                raise _bad(name, f"must be in [-2, 2], got {v!r}.")
        rp = params.repetition_penalty
        if not (_in_range(rp, 0.0, REPETITION_PENALTY_MAX) and rp > 0.0):
            raise _bad("repetition_penalty", f"must be in (0, {REPETITION_PENALTY_MAX:g}], got {rp!r}.")
        seed = params.seed
        if seed is not None:
            if not _is_int(seed) or not SEED_MIN <= seed or seed + n - 1 > SEED_MAX:
                hi = SEED_MAX - n + 1
                raise _bad("seed", f"must be an integer in [{SEED_MIN}, {hi}] (with n={n} the children use "
                                   f"seed + i, each within what torch.Generator accepts), got {seed!r}.")
        self._check_lengths(params, num_prompt_tokens)
        self._check_logprobs(params)
        self._check_stop(params)
        self._check_token_ids(params)
        self._check_structured_outputs(params)
        for fn in self.params_validators:
            fn(params, self)

    def _check_structured_outputs(self, params: SamplingParams) -> None:
        """The grammar must compile on the configured backend (``structured_output.validate_structured_outputs``;
        its ValueError names the request field the spec came from, e.g. ``response_format``)."""
        so = params.structured_outputs
        if so is None:
            return
        if self.tokenizer is None:
            raise _bad("structured_outputs", "needs a tokenizer (the engine runs with skip_tokenizer_init).")
        from pagedllm.config import StructuredOutputsConfig
        from pagedllm.structured_output import validate_structured_outputs

        validate_structured_outputs(so, getattr(self.config, "structured_outputs", None) or StructuredOutputsConfig())

    def _check_lengths(self, params: SamplingParams, num_prompt_tokens: int) -> None:
        max_len = self.max_model_len
        if num_prompt_tokens >= max_len:
            raise InvalidRequestError(
                f"prompt is {num_prompt_tokens} tokens long; with max_model_len={max_len} there is no room for "
                f"any output token.", param="prompt", code="context_length_exceeded")
        room = max_len - num_prompt_tokens
        mt = params.max_tokens
        if mt is not None:
            if not _is_int(mt) or mt < 1:
                raise _bad("max_tokens", f"must be at least 1, got {mt!r}.")
            if mt > room:
                raise InvalidRequestError(
                    f"max_tokens={mt} plus the prompt's {num_prompt_tokens} tokens is {num_prompt_tokens + mt} "
                    f"tokens, more than max_model_len={max_len}.", param="max_tokens",
                    code="context_length_exceeded")
        mn = params.min_tokens
        if not _is_int(mn) or not 0 <= mn <= (mt if mt is not None else room):
            raise _bad("min_tokens", f"must be in [0, max_tokens={mt if mt is not None else room}], got {mn!r}.")

    def _check_logprobs(self, params: SamplingParams) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(params, name)
            if v is not None and (not _is_int(v) or not 0 <= v <= self.max_logprobs):
                raise _bad(name, f"must be in [0, max_logprobs={self.max_logprobs}], got {v!r}.")

    def _check_stop(self, params: SamplingParams) -> None:
        lim = self.limits
        stop = params.stop or []
        if len(stop) > lim.max_num_stop_strings:
            raise _bad("stop", f"may hold at most {lim.max_num_stop_strings} strings, got {len(stop)}.")
        for s in stop:
            if not isinstance(s, str) or not s:
                raise _bad("stop", "must contain only non-empty strings.")
            if len(s) > lim.max_stop_string_len:
                raise _bad("stop", f"strings must be at most {lim.max_stop_string_len} characters, got one of "
                                   f"{len(s)}.")
        check_utf8(list(stop), "stop")

    def _check_token_ids(self, params: SamplingParams) -> None:
        lim = self.limits
        vocab = self.vocab_size
        lb = params.logit_bias or {}
        if len(lb) > lim.max_num_logit_bias:
            raise _bad("logit_bias", f"may hold at most {lim.max_num_logit_bias} entries, got {len(lb)}.")
        for t, b in lb.items():
            if not _in_range(b, *LOGIT_BIAS_RANGE):
                raise _bad("logit_bias", f"values must be in [-100, 100], got {b!r}.")
        for name, ids, cap in (("logit_bias", list(lb), None),
                               ("allowed_token_ids", params.allowed_token_ids, lim.max_num_allowed_token_ids),
                               ("stop_token_ids", params.stop_token_ids, lim.max_num_stop_token_ids)):
            if ids is None:
                continue
            if cap is not None and len(ids) > cap:
                raise _bad(name, f"may hold at most {cap} token ids, got {len(ids)}.")
            bad = [t for t in ids if not _is_int(t) or not 0 <= t < vocab]
            if bad:
                raise _bad(name, f"has token ids outside the vocabulary [0, {vocab}): {bad[:5]}.")

    # ------------------------------------------------------------------ the request
    def make_request(self, request_id: str, prompt: Union[PromptType, ProcessedPrompt], params: SamplingParams,
                     arrival_time: Optional[float] = None, cache_salt: Optional[str] = None) -> EngineCoreRequest:
        """The whole check: prompt, parameters, salt. Returns the ``EngineCoreRequest`` to queue.

        Raises:
            InvalidRequestError: naming the field; nothing is queued then.
        """
        if not isinstance(request_id, str) or not request_id:
            raise _bad("request_id", "must be a non-empty string.")
        check_utf8(request_id, "request_id")
        pp = prompt if isinstance(prompt, ProcessedPrompt) else self.process_prompt(prompt)
        self.process_params(params, len(pp.prompt_token_ids))
        salt = self.check_cache_salt(cache_salt if cache_salt is not None else pp.cache_salt)
        fault = fault_injection.fault_of(pp.prompt) if fault_injection.enabled() else None
        return EngineCoreRequest(
            request_id=request_id, prompt=pp.prompt, prompt_token_ids=pp.prompt_token_ids, sampling_params=params,
            arrival_time=time.time() if arrival_time is None else arrival_time, cache_salt=salt, fault=fault)

    # ------------------------------------------------------------------ helpers for the output side
    def special_stop_token_ids(self, stop: Sequence[str]) -> dict[int, str]:
        """Stop strings that are exactly a special token's text (``"<|im_end|>"``), by token id: with
        ``skip_special_tokens`` that token never reaches the text, so the detokenizer matches its id instead."""
        if not stop or self.tokenizer is None:
            return {}
        if self._special_stop is None:
            table: dict[str, int] = {}
            tok = self.tokenizer
            try:
                added = getattr(tok, "added_tokens_decoder", None) or {}
                for tid, t in added.items():
                    if getattr(t, "special", False):
                        table[str(t)] = int(tid)
                for s in getattr(tok, "all_special_tokens", None) or []:
                    if s not in table:
                        tid = tok.convert_tokens_to_ids(s)
                        if _is_int(tid):
                            table[s] = tid
            except Exception:  # noqa: BLE001 - a tokenizer without these tables just has no special stops
                table = {}
            self._special_stop = table
        return {self._special_stop[s]: s for s in stop if s in self._special_stop}
