"""Reasoning parsers (``--reasoning-parser``): split ``<think>...</think>`` off into ``reasoning_content``.

- ``deepseek_r1``: the model starts inside a reasoning section (R1 templates open ``<think>`` in the prompt, and
  the model may also write it); everything up to ``</think>`` is reasoning. No ``</think>`` at all: all reasoning.
- ``qwen3``: reasoning only when the output opens ``<think>`` (or the prompt left one open); otherwise all content
  (``enable_thinking=False``).

Each parser has a non-streaming ``extract_reasoning(text) -> (reasoning, content)`` and a streaming
``extract_reasoning_streaming(delta_text) -> (reasoning_delta, content_delta)`` that holds back a partial marker.
"""

from __future__ import annotations

from typing import Optional

from pagedllm.config import REASONING_PARSERS

START, END = "<think>", "</think>"


def _partial(text: str, marker: str) -> int:
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ReasoningParser:
    starts_in_reasoning = False

    def __init__(self, prompt_opens_think: bool = False) -> None:
        self.in_reasoning: Optional[bool] = True if (prompt_opens_think or self.starts_in_reasoning) else None
        self._buf = ""
        self._done = False
        self._reasoning_started = False
        self._content_started = False

    def extract_reasoning(self, text: str) -> tuple[Optional[str], Optional[str]]:
        """``(reasoning_content, content)`` of a whole output (None where empty)."""
        t = text
        lead = t.lstrip()
        opened = self.in_reasoning is True
        if lead.startswith(START):
            t = lead[len(START):]
            opened = True
        if not opened:
            return None, text or None
        if END not in t:  # the output ended inside its reasoning (e.g. max_tokens)
            return t or None, None
        reasoning, content = t.split(END, 1)
        return reasoning or None, content.lstrip("\n") or None

    def extract_reasoning_streaming(self, delta_text: str) -> tuple[str, str]:
        r, c = self._stream(delta_text)
        if r:
            self._reasoning_started = True
        if c and not self._content_started and self._done and self.in_reasoning is False:
            c = c.lstrip("\n")  # the blank line after </think>, as non-streamed
        if c:
            self._content_started = True
        return r, c

    def _stream(self, delta_text: str) -> tuple[str, str]:
        self._buf += delta_text
        r, c = "", ""
        if self._done:
            c, self._buf = self._buf, ""
            return r, c
        if self.in_reasoning is None:
            lead = self._buf.lstrip()
            if not lead:
                return r, c
            if lead.startswith(START):
                self.in_reasoning = True
                self._buf = lead[len(START):]
                self._reasoning_started = True  # the tag is consumed
            elif START.startswith(lead):
                return r, c  # maybe "<think>"
            else:
                self._done = True
                c, self._buf = self._buf, ""
                return r, c
        if self.in_reasoning:
            if not self._reasoning_started:
                lead = self._buf.lstrip()
                if lead.startswith(START):  # R1 models may still write the opening tag
                    self._buf = lead[len(START):]
                elif START.startswith(lead):
                    return r, c
            i = self._buf.find(END)
            if i >= 0:
                r = self._buf[:i]
                c = self._buf[i + len(END):]
                self._buf = ""
                self._done = True
                self.in_reasoning = False
                return r, c
            k = _partial(self._buf, END)
            r = self._buf[:len(self._buf) - k]
            self._buf = self._buf[len(self._buf) - k:]
        return r, c

    def finish_streaming(self) -> tuple[str, str]:
        """What was held back when the output ended."""
        b, self._buf = self._buf, ""
        if self.in_reasoning:
            return b, ""
        return "", b


class DeepSeekR1ReasoningParser(ReasoningParser):
    starts_in_reasoning = True


class Qwen3ReasoningParser(ReasoningParser):
    starts_in_reasoning = False


_PARSERS = {"deepseek_r1": DeepSeekR1ReasoningParser, "qwen3": Qwen3ReasoningParser}
assert tuple(_PARSERS) == REASONING_PARSERS


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """Raises ValueError naming ``reasoning_parser``."""
    try:
        return _PARSERS[name]
    except KeyError:
        raise ValueError(f"reasoning_parser must be one of {sorted(_PARSERS)}, got {name!r}.") from None


def prompt_opens_think(prompt_text: str) -> bool:
    """Whether the rendered prompt leaves a ``<think>`` open (its template started the reasoning)."""
    return prompt_text.rfind(START) > prompt_text.rfind(END)
