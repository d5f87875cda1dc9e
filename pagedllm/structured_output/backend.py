"""The grammar-backend interface: compile a constraint once, then one matcher per request.

A backend compiles ``(kind, spec)`` (see ``StructuredOutputsParams.kind`` / ``spec``) against the tokenizer's
vocabulary into a compiled grammar that any number of requests share; each request gets its own ``Grammar`` (the
matcher state). Bitmasks are int32 ``[num_rows, ceil(vocab_size / 32)]``; bit ``t % 32`` of word ``t // 32`` is 1
when token ``t`` is allowed. xgrammar is the first backend; llguidance would be a second one behind the same
interface.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Sequence


class StructuredOutputGrammar(ABC):
    """One request's matcher."""

    @abstractmethod
    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        """Advances over ``token_ids``; False (and the state stops at the first bad one) if one isn't allowed."""

    @abstractmethod
    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        """Writes the allowed next tokens into ``bitmask[row]`` (EOS only where the grammar may end)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once a stop token was accepted (the grammar is done)."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undoes the last ``num_tokens`` accepted tokens."""

    @abstractmethod
    def reset(self) -> None:
        """Back to the start state."""


class StructuredOutputBackend(ABC):
    """Compiles constraints for one tokenizer and vocabulary size. Compiling must be safe from worker threads."""

    vocab_size: int

    @abstractmethod
    def compile(self, kind: str, spec: str, any_whitespace: bool) -> Any:
        """A compiled grammar (shared by requests). Raises ValueError for a spec it can't compile."""

    @abstractmethod
    def new_grammar(self, compiled: Any) -> StructuredOutputGrammar:
        """A fresh matcher over a compiled grammar."""

    @abstractmethod
    def allocate_bitmask(self, num_rows: int) -> Any:
        """An int32 ``[num_rows, ceil(vocab_size / 32)]`` tensor."""


def validate_spec(backend_name: str, kind: str, spec: str, any_whitespace: bool) -> None:
    """Checks that ``spec`` parses for ``backend_name`` without a tokenizer (cheap; the front end calls this so a
    bad schema is a 400, not a failed request later).

    Raises:
        ValueError: naming ``structured_outputs.<kind>``, with the backend's message.
    """
    if backend_name == "xgrammar":
        from pagedllm.structured_output.xgrammar_backend import validate_xgrammar_spec

        validate_xgrammar_spec(kind, spec, any_whitespace)
        return
    raise ValueError(f"structured_outputs backend {backend_name!r} is not available.")
