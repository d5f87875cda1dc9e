"""``pythonic``: calls written as a Python list of calls, ``[get_weather(city="Paris"), now()]`` (Llama 3.2/4
pythonic templates). Parsed with ``ast`` (literal arguments only); the arguments become a JSON object. Streaming
holds the text back while it can still be a call list and sends each call whole once the list closes."""

from __future__ import annotations

import ast
import json

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCalls,
    ToolCall,
    ToolParser,
    ToolParserManager,
)


def _name(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_name(node.value)}.{node.attr}"
    raise ValueError("not a function name")


def parse_pythonic(text: str) -> list[ToolCall]:
    """Raises ValueError when ``text`` is not a list of calls with literal keyword arguments."""
    s = text.strip()
    if s.startswith("<|python_start|>"):
        s = s[len("<|python_start|>"):]
    if s.endswith("<|python_end|>"):
        s = s[:-len("<|python_end|>")]
    s = s.strip()
    try:
        tree = ast.parse(s, mode="eval")
    except SyntaxError as e:
        raise ValueError(str(e)) from None
    body = tree.body
    if not isinstance(body, ast.List) or not body.elts:
        raise ValueError("not a list of calls")
    calls = []
    for el in body.elts:
        if not isinstance(el, ast.Call) or el.args:
            raise ValueError("each element must be a call with keyword arguments")
        args = {}
        for kw in el.keywords:
            if kw.arg is None:
                raise ValueError("**kwargs is not allowed")
            args[kw.arg] = ast.literal_eval(kw.value)
        calls.append(ToolCall(_name(el.func), json.dumps(args, ensure_ascii=False)))
    return calls


@ToolParserManager.register_module("pythonic")
class PythonicToolParser(ToolParser):
    def __init__(self, tools=None) -> None:
        super().__init__(tools)
        self._sent = 0
        self._holding = None  # None: undecided; True: looks like a call list; False: content
        self._called = False

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        try:
            calls = parse_pythonic(text)
        except (ValueError, SyntaxError):
            return ExtractedToolCalls(False, [], text)
        return ExtractedToolCalls(True, calls, None)

    @property
    def streamed_tool_calls(self) -> bool:
        return self._called

    def extract_tool_calls_streaming(self, delta_text: str) -> DeltaMessage:
        self.text += delta_text
        stripped = self.text.lstrip()
        if self._holding is None and stripped:
            self._holding = stripped[0] == "[" or stripped.startswith("<|python_start|>"[:len(stripped)])
        if self._holding:
            if stripped.rstrip().endswith(("]", "<|python_end|>")):
                try:
                    calls = parse_pythonic(self.text)
                except (ValueError, SyntaxError):
                    return DeltaMessage()
                return self._emit(calls)
            return DeltaMessage()
        if self._holding is False:
            out = DeltaMessage(content=self.text[self._sent:])
            self._sent = len(self.text)
            return out
        return DeltaMessage()

    def _emit(self, calls: list[ToolCall]) -> DeltaMessage:
        self._called = True
        self._sent = len(self.text)
        self._holding = "done"
        return DeltaMessage(tool_calls=[DeltaToolCall(i, id=c.id, name=c.name, arguments=c.arguments)
                                        for i, c in enumerate(calls)])

    def finish_streaming(self) -> DeltaMessage:
        if self._called or self._holding == "done":
            return DeltaMessage()
        if self._holding:
            try:
                return self._emit(parse_pythonic(self.text))
            except (ValueError, SyntaxError):
                pass
        out = DeltaMessage(content=self.text[self._sent:] or None)
        self._sent = len(self.text)
        return out
