"""The tool-parser interface: turn what a model wrote into OpenAI ``tool_calls``, whole or as stream deltas.

A parser is built per request with the request's ``tools``. ``extract_tool_calls(text)`` parses a finished output;
``extract_tool_calls_streaming(delta_text)`` is fed each new piece of text in order and returns what can be sent
now: content that is certainly not part of a call, and tool-call deltas (a call's ``id`` and ``name`` first, then
fragments of its ``arguments``). Arguments are the JSON text the model wrote (verbatim, checked to parse), so the
fragments of a stream concatenate to the non-streamed ``arguments``.

Parsers whose calls are JSON objects (``{"name": ..., "arguments": {...}}``) share the streaming logic here and
only say where call objects start (``_locate``).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Callable, Optional

from pagedllm.entrypoints.openai.tool_parsers.json_scan import scan_call, stable_args_end


def make_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object
    id: str = field(default_factory=make_tool_call_id)

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ExtractedToolCalls:
    tools_called: bool
    tool_calls: list[ToolCall]
    content: Optional[str]  # text outside the calls (None when there is none)


@dataclass
class DeltaToolCall:
    index: int
    id: Optional[str] = None  # first delta of a call only
    name: Optional[str] = None  # first delta of a call only
    arguments: str = ""

    def to_openai(self) -> dict:
        d: dict = {"index": self.index}
        if self.id is not None:
            d["id"] = self.id
            d["type"] = "function"
        fn: dict = {}
        if self.name is not None:
            fn["name"] = self.name
        fn["arguments"] = self.arguments
        d["function"] = fn
        return d


@dataclass
class DeltaMessage:
    content: Optional[str] = None
    tool_calls: list[DeltaToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content) or bool(self.tool_calls)


def tool_names(tools: Optional[list[dict]]) -> dict[str, dict]:
    """``{name: parameters schema}`` of the request's function tools."""
    out = {}
    for t in tools or []:
        fn = t.get("function") if isinstance(t, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            out[fn["name"]] = fn.get("parameters") or {"type": "object"}
    return out


class ToolParser:
    """Base class. Subclasses register with ``@ToolParserManager.register_module("name")``."""

    def __init__(self, tools: Optional[list[dict]] = None) -> None:
        self.tools = tools or []
        self.schemas = tool_names(tools)
        self.text = ""  # streaming: everything seen so far

    # ------------------------------------------------------------------ to implement
    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        raise NotImplementedError

    def extract_tool_calls_streaming(self, delta_text: str) -> DeltaMessage:
        raise NotImplementedError

    def finish_streaming(self) -> DeltaMessage:
        """Called once when the output ends: flushes what was held back (e.g. a partial marker that never
        completed)."""
        return DeltaMessage()

    @property
    def streamed_tool_calls(self) -> bool:
        """Whether the stream has sent any tool-call delta (then ``finish_reason`` becomes ``tool_calls``)."""
        return False


class JsonToolParser(ToolParser):
    """Calls are JSON objects ``{"name": str, <args_key>: {...}}`` at places ``_locate`` finds."""

    args_keys: tuple[str, ...] = ("arguments", "parameters")

    def __init__(self, tools: Optional[list[dict]] = None) -> None:
        super().__init__(tools)
        self._content_sent = 0
        # per call: [object start, id, name sent?, argument characters sent up to (absolute index)]
        self._calls: list[list] = []

    def _locate(self, text: str, final: bool) -> tuple[int, list[int]]:
        """``(content_end, object_starts)``: ``text[:content_end]`` is certainly content (not a call, nor the start
        of a marker); ``object_starts`` are the indices of the ``{`` of each call object found so far."""
        raise NotImplementedError

    # ------------------------------------------------------------------ whole output
    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        content_end, starts = self._locate(text, final=True)
        calls = []
        for s in starts:
            sc = scan_call(text, s, self.args_keys)
            if sc.malformed or sc.end is None or sc.name is None or sc.args_end is None:
                continue
            args = text[sc.args_start:sc.args_end]
            try:
                if not isinstance(json.loads(args), dict):
                    continue
            except ValueError:
                continue
            calls.append(ToolCall(sc.name, args))
        if not calls:
            return ExtractedToolCalls(False, [], text)
        content = text[:content_end].strip()
        return ExtractedToolCalls(True, calls, content or None)

    # ------------------------------------------------------------------ stream
    @property
    def streamed_tool_calls(self) -> bool:
        return any(c[2] for c in self._calls)

    def extract_tool_calls_streaming(self, delta_text: str) -> DeltaMessage:
        self.text += delta_text
        return self._advance(final=False)

    def finish_streaming(self) -> DeltaMessage:
        return self._advance(final=True)

    def _advance(self, final: bool) -> DeltaMessage:
        text = self.text
        content_end, starts = self._locate(text, final)
        out = DeltaMessage()
        if content_end > self._content_sent and not self._calls:
            out.content = text[self._content_sent:content_end]
            self._content_sent = content_end
        for s in starts:
            if not any(c[0] == s for c in self._calls):
                self._calls.append([s, make_tool_call_id(), False, None])
        for index, call in enumerate(self._calls):
            sc = scan_call(text, call[0], self.args_keys)
            if sc.malformed or sc.name is None:
                continue
            delta = None
            if not call[2]:
                call[2] = True
                delta = DeltaToolCall(index, id=call[1], name=sc.name)
            if sc.args_start is not None:
                if call[3] is None:
                    call[3] = sc.args_start
                upto = sc.args_end if sc.args_end is not None else stable_args_end(text, sc.args_start)
                if upto > call[3]:
                    if delta is None:
                        delta = DeltaToolCall(index)
                    delta.arguments = text[call[3]:upto]
                    call[3] = upto
            if delta is not None:
                out.tool_calls.append(delta)
        if final and not self.streamed_tool_calls and len(text) > self._content_sent:
            # No call after all (e.g. malformed JSON): what was held back is content, as non-streamed.
            out.content = (out.content or "") + text[self._content_sent:]
            self._content_sent = len(text)
        return out


class ToolParserManager:
    """Parsers by name (vLLM's ``--tool-call-parser`` names)."""

    _parsers: dict[str, type[ToolParser]] = {}

    @classmethod
    def register_module(cls, name: str) -> Callable[[type[ToolParser]], type[ToolParser]]:
        def deco(klass: type[ToolParser]) -> type[ToolParser]:
            cls._parsers[name] = klass
            return klass

        return deco

    @classmethod
    def get_tool_parser(cls, name: str) -> type[ToolParser]:
        """Raises ValueError naming ``tool_call_parser`` for an unknown name."""
        try:
            return cls._parsers[name]
        except KeyError:
            raise ValueError(f"tool_call_parser must be one of {sorted(cls._parsers)}, got {name!r}.") from None

    @classmethod
    def names(cls) -> list[str]:
        return sorted(cls._parsers)


def partial_marker_len(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker`` (text to hold back)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
