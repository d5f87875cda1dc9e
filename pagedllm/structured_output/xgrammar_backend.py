"""The xgrammar backend (xgrammar 0.2.x: ``GrammarCompiler``, ``GrammarMatcher``, token bitmasks)."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Optional, Sequence

from pagedllm.structured_output.backend import StructuredOutputBackend, StructuredOutputGrammar
from pagedllm.utils.atomic import atomic_path


def _xgr():
    import xgrammar

    return xgrammar


def json_object_schema() -> str:
    """``json_object``: any JSON object, compiled as the schema ``{"type": "object"}`` (not xgrammar's builtin JSON
    grammar, which always allows free whitespace)."""
    return '{"type": "object"}'


def choice_regex(choices: list[str]) -> str:
    """A regex matching exactly one of ``choices`` (each escaped)."""
    import re

    return "(" + "|".join(re.escape(c) for c in choices) + ")"


def _grammar_of(kind: str, spec: str, any_whitespace: bool):
    """The tokenizer-free ``xgrammar.Grammar`` of a constraint (what validation parses)."""
    xgr = _xgr()
    if kind == "json":
        return xgr.Grammar.from_json_schema(spec, any_whitespace=any_whitespace, strict_mode=True)
    if kind == "json_object":
        return xgr.Grammar.from_json_schema(json_object_schema(), any_whitespace=any_whitespace)
    if kind == "regex":
        return xgr.Grammar.from_regex(spec)
    if kind == "choice":
        return xgr.Grammar.from_regex(choice_regex(json.loads(spec)))
    if kind == "grammar":
        return xgr.Grammar.from_ebnf(spec)
    if kind == "structural_tag":
        return xgr.Grammar.from_structural_tag(spec)
    raise ValueError(f"structured_outputs kind {kind!r} is unknown.")


def validate_xgrammar_spec(kind: str, spec: str, any_whitespace: bool) -> None:
    try:
        _grammar_of(kind, spec, any_whitespace)
    except ValueError as e:
        if str(e).startswith("structured_outputs"):
            raise
        raise ValueError(f"structured_outputs.{kind} can't be compiled by xgrammar: {e}") from None
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError and its own types for bad input
        raise ValueError(f"structured_outputs.{kind} can't be compiled by xgrammar: {e}") from None


class XgrammarGrammar(StructuredOutputGrammar):
    __slots__ = ("matcher", "num_accepted")

    def __init__(self, matcher) -> None:
        self.matcher = matcher
        self.num_accepted = 0

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        m = self.matcher
        for t in token_ids:
            if m.is_terminated():
                return False
            if not m.accept_token(int(t)):
                return False
            self.num_accepted += 1
        return True

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)
        self.num_accepted -= num_tokens

    def reset(self) -> None:
        self.matcher.reset()
        self.num_accepted = 0


def tokenizer_info(tokenizer, vocab_size: int, stop_token_ids: Optional[list[int]]):
    """``xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size, stop_token_ids)``, kept on disk under
    ``<cache_dir>/xgrammar/`` (its ``serialize_json``) and read back from there next time.

    Building it reads the whole vocabulary through Python (Gemma 3's 262k tokens: 1.1 s on 2 cores, holding the GIL,
    so a server that builds it at start-up answers nothing meanwhile); reading it back takes ~0.2 s. The key is the
    tokenizer's source on disk (``tokenizer_fingerprint``), the xgrammar version, ``vocab_size`` and the stop ids;
    where the tokenizer has no source on disk (or ``PAGEDLLM_TOKENIZER_CACHE=0``) it is built every time. A cache
    file that doesn't read back is rebuilt."""
    import importlib.metadata

    from pagedllm.model_files import cache_dir
    from pagedllm.tokenizer import tokenizer_fingerprint

    xgr = _xgr()
    source = tokenizer_fingerprint(tokenizer)
    path = None
    if source is not None:
        ident = f"{source}\0{importlib.metadata.version('xgrammar')}\0{vocab_size}\0{stop_token_ids}"
        path = os.path.join(cache_dir(), "xgrammar", hashlib.sha256(ident.encode()).hexdigest()[:24] + ".json")
        try:
            with open(path, encoding="utf-8") as f:
                return xgr.TokenizerInfo.deserialize_json(f.read())
        except Exception:  # noqa: BLE001 - absent, truncated or from another build: rebuild it below
            pass
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
    if path is not None:
        try:
            with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
                f.write(info.serialize_json())
        except OSError:
            pass  # a read-only or full cache: build it every time
    return info


class XgrammarBackend(StructuredOutputBackend):
    """Over an ``xgrammar.TokenizerInfo``; ``vocab_size`` is the model's logits width (it may exceed the tokenizer's
    vocabulary: padding ids are never allowed)."""

    def __init__(self, tokenizer_info, vocab_size: int, max_threads: int = 2) -> None:
        self.vocab_size = vocab_size
        self.tokenizer_info = tokenizer_info
        # Our manager caches compiled grammars (LRU by (kind, spec, whitespace)); xgrammar's own cache is off.
        self.compiler = _xgr().GrammarCompiler(tokenizer_info, max_threads=max_threads, cache_enabled=False)

    @classmethod
    def from_huggingface(cls, tokenizer, vocab_size: int, stop_token_ids: Sequence[int],
                         max_threads: int = 2) -> "XgrammarBackend":
        """``stop_token_ids``: the engine's EOS ids, allowed only where the grammar may end."""
        stops = sorted(int(t) for t in stop_token_ids) or None
        return cls(tokenizer_info(tokenizer, vocab_size, stops), vocab_size, max_threads)

    def compile(self, kind: str, spec: str, any_whitespace: bool) -> Any:
        try:
            c = self.compiler
            if kind == "json":
                return c.compile_json_schema(spec, any_whitespace=any_whitespace, strict_mode=True)
            if kind == "json_object":
                return c.compile_json_schema(json_object_schema(), any_whitespace=any_whitespace)
            if kind == "regex":
                return c.compile_regex(spec)
            if kind == "choice":
                return c.compile_regex(choice_regex(json.loads(spec)))
            if kind == "grammar":
                return c.compile_grammar(spec)
            if kind == "structural_tag":
                return c.compile_structural_tag(spec)
        except Exception as e:  # noqa: BLE001 - xgrammar's own error types
            raise ValueError(f"structured_outputs.{kind} can't be compiled by xgrammar: {e}") from None
        raise ValueError(f"structured_outputs kind {kind!r} is unknown.")

    def new_grammar(self, compiled: Any) -> XgrammarGrammar:
        return XgrammarGrammar(_xgr().GrammarMatcher(compiled))

    def allocate_bitmask(self, num_rows: int) -> Any:
        return _xgr().allocate_token_bitmask(num_rows, self.vocab_size)


def apply_bitmask(logits, bitmask, rows: list[int]):
    """Sets ``logits[rows[j], t] = -inf`` where bit ``t`` of ``bitmask[j]`` is 0.

    logits ``[N, V]`` (any float dtype), bitmask int32 ``[len(rows), ceil(V / 32)]``. Returns the masked logits:
    ``logits`` itself when float32 and contiguous (masked in place by our C kernel, ``cpu_ops.c``; xgrammar's CPU
    kernel where ours doesn't load), else a float32 copy
    (the sampler works in float32 anyway).
    """
    import torch

    from pagedllm.attention.cpu_kernels import apply_token_bitmask

    if logits.dtype != torch.float32 or not logits.is_contiguous():
        logits = logits.float().contiguous()
    if apply_token_bitmask(logits, bitmask.contiguous(), torch.tensor(rows, dtype=torch.int64)):
        return logits
    if len(rows) != logits.shape[0] or rows != list(range(len(rows))):
        full = torch.full((logits.shape[0], bitmask.shape[1]), -1, dtype=torch.int32)
        full[rows] = bitmask
        bitmask = full
    _xgr().apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1], indices=rows)
    return logits
