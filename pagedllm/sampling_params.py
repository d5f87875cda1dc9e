"""Sampling parameters, with the same names, defaults and validation as vLLM's ``SamplingParams``.

Every out-of-range value raises ``ValueError`` naming the field, at construction time, so a bad request never
reaches the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import Optional, Union

# Temperatures below this are treated as greedy (vLLM: ``_SAMPLING_EPS``).
SAMPLING_EPS = 1e-5


# Bounds on structured-output specs (hostile input is normal input): a schema/grammar/regex text, and choices.
MAX_STRUCTURED_SPEC_CHARS = 1 << 20
MAX_NUM_CHOICES = 1024


@dataclass
class StructuredOutputsParams:
    """Constrains a completion to a JSON schema, a regex, one of several strings, an EBNF grammar, any JSON object
    or a structural tag (vLLM's ``StructuredOutputsParams``; exactly one of those six fields is set).

    Fields:
        json: a JSON schema (a dict or its JSON text).
        regex: a regular expression the whole output matches.
        choice: the output is exactly one of these strings.
        grammar: an EBNF/GBNF grammar (xgrammar's dialect: ``root ::= ...``).
        json_object: any JSON object.
        structural_tag: xgrammar's structural tag (a dict or its JSON text).
        disable_any_whitespace: JSON only. ``None`` takes the engine's default (``--structured-outputs-config``'s
            ``disable_any_whitespace``, on by default here, unlike vLLM): JSON is written compactly, with no
            whitespace between tokens, so a small model can't loop on spaces inside an answer. ``False`` allows any
            whitespace (vLLM's default).
        disable_fallback, disable_additional_properties: accepted for vLLM compatibility (one backend, so there is
            nothing to fall back to; additional properties follow the schema).

    Raises:
        ValueError: naming the field, when none or several constraints are set, or one is malformed or too large.
    """

    json: Optional[Union[str, dict]] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    structural_tag: Optional[Union[str, dict]] = None
    disable_any_whitespace: Optional[bool] = None
    disable_fallback: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: Optional[str] = None
    # The request field it came from (response_format, guided_json, ...), so a spec error names that field.
    source: str = field(default="structured_outputs", repr=False, compare=False)

    def __post_init__(self) -> None:
        set_fields = [k for k in _CONSTRAINT_FIELDS if getattr(self, k) not in (None, False)]
        if len(set_fields) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(_CONSTRAINT_FIELDS)}; got "
                             f"{set_fields or 'none'}.")
        if self.whitespace_pattern is not None:
            raise ValueError("structured_outputs.whitespace_pattern is not supported (use disable_any_whitespace).")
        import json as _json

        for name in ("json", "structural_tag"):
            v = getattr(self, name)
            if v is None:
                continue
            if isinstance(v, str):
                try:
                    v = _json.loads(v)
                except (ValueError, RecursionError) as e:
                    raise ValueError(f"structured_outputs.{name} is not valid JSON: {e}") from None
            if not isinstance(v, dict):
                raise ValueError(f"structured_outputs.{name} must be a JSON object, got {type(v).__name__}.")
            setattr(self, name, v)
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string.")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings.")
            if len(self.choice) > MAX_NUM_CHOICES:
                raise ValueError(f"structured_outputs.choice has {len(self.choice)} entries, more than "
                                 f"{MAX_NUM_CHOICES}.")
            self.choice = list(self.choice)
        if len(self.spec) > MAX_STRUCTURED_SPEC_CHARS:
            raise ValueError(f"structured_outputs.{self.kind} is {len(self.spec)} characters, more than "
                             f"{MAX_STRUCTURED_SPEC_CHARS}.")

    @property
    def kind(self) -> str:
        """Which constraint: ``json``, ``regex``, ``choice``, ``grammar``, ``json_object`` or ``structural_tag``."""
        return next(k for k in _CONSTRAINT_FIELDS if getattr(self, k) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as canonical text (the grammar cache key with ``kind`` and the whitespace option)."""
        import json as _json

        v = getattr(self, self.kind)
        if isinstance(v, (dict, list)):
            return _json.dumps(v, sort_keys=True, separators=(",", ":"))
        if v is True:
            return ""
        return v


_CONSTRAINT_FIELDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


class RequestOutputKind(IntEnum):
    """What each ``RequestOutput`` of a request carries (vLLM's ``RequestOutputKind``)."""

    CUMULATIVE = 0  # the whole output so far
    DELTA = 1  # only what is new since the last output
    FINAL_ONLY = 2  # one output, when the request finishes


@dataclass
class SamplingParams:
    """How to sample the completion of one prompt.

    Fields follow vLLM's ``SamplingParams``. Token counts are in tokens; penalties follow the OpenAI API
    (presence/frequency, additive) and the CTRL paper (repetition, multiplicative, arXiv:1909.05858).

    Raises:
        ValueError: naming the field, for any out-of-range value (see ``_verify``).
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: all tokens
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: Optional[dict[int, float]] = None
    allowed_token_ids: Optional[list[int]] = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: Optional[StructuredOutputsParams] = None
    # Filled by the engine from the tokenizer / generation config; not user-facing.
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None:
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError, AttributeError) as e:
                raise ValueError(f"logit_bias must map token ids to floats, got {self.logit_bias!r}") from e
        if self.top_k == -1:
            self.top_k = 0
        self._verify()
        if self.temperature < SAMPLING_EPS:
            # Greedy: the other truncations change nothing, so normalise them away (as vLLM does).
            self.top_p = 1.0
            self.top_k = 0
            self.min_p = 0.0
        self.all_stop_token_ids = set(self.stop_token_ids)

    # ------------------------------------------------------------------ validation
    def _verify(self) -> None:
        def check(ok: bool, name: str, msg: str) -> None:
            if not ok:
                raise ValueError(f"{name} {msg}, got {getattr(self, name)!r}.")

        check(isinstance(self.n, int) and self.n >= 1, "n", "must be an integer >= 1")
        check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]")
        check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]")
        check(self.repetition_penalty > 0.0, "repetition_penalty", "must be > 0")
        check(self.temperature >= 0.0, "temperature", "must be >= 0")
        check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", "must be -1, 0 (disable) or >= 1")
        check(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        check(self.seed is None or isinstance(self.seed, int), "seed", "must be an integer or None")
        if self.max_tokens is not None:
            check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", "must be at least 1")
        check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", "must be >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}."
            )
        if self.logprobs is not None:
            check(isinstance(self.logprobs, int) and self.logprobs >= 0, "logprobs", "must be >= 0")
        if self.prompt_logprobs is not None:
            check(
                isinstance(self.prompt_logprobs, int) and self.prompt_logprobs >= 0,
                "prompt_logprobs",
                "must be >= 0",
            )
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must contain only non-empty strings, got {self.stop!r}.")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got "
                             f"{type(self.structured_outputs).__name__}.")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or t < 0:
                raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}.")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty.")
            for t in self.allowed_token_ids:
                if not isinstance(t, int) or t < 0:
                    raise ValueError(f"allowed_token_ids must be non-negative integers, got {t!r}.")

    def verify_for_model(self, vocab_size: int, max_logprobs: int) -> None:
        """Checks that need the model: token ids inside ``[0, vocab_size)``, logprob counts <= ``max_logprobs``.

        Raises:
            ValueError: naming the field.
        """
        if self.logprobs is not None and self.logprobs > max_logprobs:
            raise ValueError(f"logprobs must be at most max_logprobs={max_logprobs}, got {self.logprobs}.")
        if self.prompt_logprobs is not None and self.prompt_logprobs > max_logprobs:
            raise ValueError(
                f"prompt_logprobs must be at most max_logprobs={max_logprobs}, got {self.prompt_logprobs}."
            )
        for name, ids in (
            ("logit_bias", list((self.logit_bias or {}).keys())),
            ("allowed_token_ids", self.allowed_token_ids or []),
            ("stop_token_ids", self.stop_token_ids),
        ):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"{name} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}.")

    # ------------------------------------------------------------------ helpers
    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    def clone(self) -> "SamplingParams":
        import copy

        return copy.deepcopy(self)
