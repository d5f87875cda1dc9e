"""Structured outputs: grammar backends (xgrammar), per-request matchers, one token bitmask per step.

``StructuredOutputManager`` (manager.py) is the engine core's part; ``apply_grammar_bitmask`` is the model runner's
one step before sampling; ``validate_structured_outputs`` is what the front end checks (a bad spec is a 400).
"""

from __future__ import annotations

from typing import Any, Optional

from pagedllm.structured_output.backend import StructuredOutputBackend, StructuredOutputGrammar, validate_spec


def validate_structured_outputs(params, config) -> None:
    """Checks ``params`` (a ``StructuredOutputsParams``) against the backend of ``config`` (a
    ``StructuredOutputsConfig``) without a tokenizer.

    Raises:
        ValueError: naming ``structured_outputs.<kind>``.
    """
    any_ws = params.disable_any_whitespace
    if any_ws is None:
        any_ws = config.disable_any_whitespace
    try:
        validate_spec(config.backend, params.kind, params.spec, not any_ws)
    except ValueError as e:
        if params.source != "structured_outputs":
            raise ValueError(f"{params.source}: {e}") from None
        raise


def make_structured_output_manager(config, tokenizer, vocab_size: int, eos_token_ids) -> Optional[Any]:
    """The engine core's ``StructuredOutputManager`` (None without a tokenizer: grammars work on token text)."""
    if tokenizer is None:
        return None
    from pagedllm.structured_output.manager import ReasoningEnd, StructuredOutputManager

    so = config.structured_outputs

    def make_backend() -> StructuredOutputBackend:
        from pagedllm.structured_output.xgrammar_backend import XgrammarBackend

        return XgrammarBackend.from_huggingface(tokenizer, vocab_size, sorted(eos_token_ids),
                                               max_threads=so.max_compile_threads)

    reasoning = ReasoningEnd(tokenizer, so.reasoning_parser) if so.reasoning_parser else None
    return StructuredOutputManager(so, make_backend, reasoning)


def apply_grammar_bitmask(logits, grammar_bitmask, sampled_req_ids: list[str]):
    """The model runner's step before sampling: logits ``[N, V]`` of the rows that sample (request
    ``sampled_req_ids[i]`` in row ``i``), ``grammar_bitmask`` = ``(bitmask [R, ceil(V / 32)] or None, {request id:
    row}, ...)`` (a ``GrammarBitmask``) from ``SchedulerOutput.grammar_bitmask``. Returns the masked logits (see
    ``apply_bitmask``)."""
    bitmask, row_of = grammar_bitmask[0], grammar_bitmask[1]
    if bitmask is None:
        return logits
    rows, mask_rows = [], []
    for i, rid in enumerate(sampled_req_ids):
        j = row_of.get(rid)
        if j is not None:
            rows.append(i)
            mask_rows.append(j)
    if not rows:
        return logits
    from pagedllm.structured_output.xgrammar_backend import apply_bitmask

    if mask_rows != list(range(bitmask.shape[0])):
        bitmask = bitmask[mask_rows]
    return apply_bitmask(logits, bitmask, rows)


__all__ = ["StructuredOutputBackend", "StructuredOutputGrammar", "apply_grammar_bitmask",
           "make_structured_output_manager", "validate_structured_outputs"]
