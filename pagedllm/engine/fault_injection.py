"""A test hook: makes one request's processing raise, to show that faults stay isolated.

Off unless ``enable()`` is called (``pagedllm serve --fault-injection``, a hidden flag for tests). Then a text
prompt containing ``REQUEST_FAULT_MARKER`` raises inside the engine's per-request output processing (as a bug in
detokenizing or stop checking would): only that request fails. One containing ``FORWARD_FAULT_MARKER`` raises in
the step's model forward, a fault that belongs to no single request: the engine stops and every stream ends with
an error event.
"""

from __future__ import annotations

from typing import Optional

REQUEST_FAULT_MARKER = "<<pagedllm-fault:request>>"
FORWARD_FAULT_MARKER = "<<pagedllm-fault:forward>>"

_enabled = False


class InjectedFault(RuntimeError):
    """The exception the hook raises."""


def enable(on: bool = True) -> None:
    global _enabled
    _enabled = on


def enabled() -> bool:
    return _enabled


def fault_of(prompt: Optional[str]) -> Optional[str]:
    """"request", "forward" or None for a prompt text."""
    if not prompt:
        return None
    if FORWARD_FAULT_MARKER in prompt:
        return "forward"
    if REQUEST_FAULT_MARKER in prompt:
        return "request"
    return None
