"""Tool calling and reasoning for ``/v1/chat/completions``: what ``tools`` / ``tool_choice`` /
``parallel_tool_calls`` mean, and turning each choice's text into ``content``, ``reasoning_content`` and
``tool_calls`` (whole, or as stream deltas).

``tool_choice``:
- ``none``: no calls; the tools still reach the chat template.
- ``auto`` (the default when tools are given and the server runs with ``--enable-auto-tool-choice``): the model
  decides; the ``--tool-call-parser`` reads its calls.
- ``required``: constrained decoding to a JSON array of ``{"name": <a declared tool>, "parameters": <its schema>}``
  (at least one; at most one without ``parallel_tool_calls``), so the calls always parse and match the schemas.
- ``{"type": "function", "function": {"name": N}}``: constrained decoding to N's parameters schema; the output is the
  arguments.
Responses carry ``message.tool_calls`` (ids ``call_...``) and ``finish_reason: "tool_calls"``. Streams send OpenAI's
tool-call deltas: a call's ``id``, ``type`` and ``function.name`` first, then ``function.arguments`` fragments that
concatenate to the non-streamed arguments.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Optional

from pagedllm.entrypoints.openai.tool_parsers import (
    DeltaMessage,
    DeltaToolCall,
    ToolCall,
    ToolParser,
    ToolParserManager,
)
from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import JsonToolParser, make_tool_call_id
from pagedllm.entrypoints.openai.tool_parsers.json_scan import array_object_starts, skip_ws
from pagedllm.sampling_params import StructuredOutputsParams

MAX_TOOLS = 128  # OpenAI's limit


class _RequiredCallsParser(JsonToolParser):
    """The output of ``tool_choice: required``: ``[{"name": ..., "parameters": {...}}, ...]``."""

    args_keys = ("parameters",)

    def _locate(self, text: str, final: bool) -> tuple[int, list[int]]:
        i = skip_ws(text, 0)
        starts = []
        if i < len(text) and text[i] == "[":
            starts = array_object_starts(text, i)
        return 0, starts


class _NamedCallParser(ToolParser):
    """The output of a named ``tool_choice``: the arguments object itself."""

    def __init__(self, name: str) -> None:
        super().__init__(None)
        self.name = name
        self.id = make_tool_call_id()
        self._started = False

    def extract_tool_calls(self, text: str):
        from pagedllm.entrypoints.openai.tool_parsers import ExtractedToolCalls

        args = text.strip()
        try:
            ok = isinstance(json.loads(args), dict)
        except ValueError:
            ok = False
        if not ok:
            return ExtractedToolCalls(False, [], text)
        return ExtractedToolCalls(True, [ToolCall(self.name, args, id=self.id)], None)

    @property
    def streamed_tool_calls(self) -> bool:
        return self._started

    def extract_tool_calls_streaming(self, delta_text: str) -> DeltaMessage:
        self.text += delta_text
        if not self._started:
            self._started = True
            return DeltaMessage(tool_calls=[DeltaToolCall(0, id=self.id, name=self.name,
                                                          arguments=delta_text.lstrip())])
        return DeltaMessage(tool_calls=[DeltaToolCall(0, arguments=delta_text)]) if delta_text else DeltaMessage()


def _check_tools(tools: Optional[list]) -> dict[str, dict]:
    """``{name: parameters}``. Raises ValueError naming ``tools``."""
    if tools is None:
        return {}
    if len(tools) > MAX_TOOLS:
        raise ValueError(f"tools has {len(tools)} entries, more than {MAX_TOOLS}.")
    out = {}
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or t.get("type", "function") != "function":
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}.")
        name = fn.get("name")
        if not isinstance(name, str) or not name or len(name) > 64:
            raise ValueError(f"tools[{i}].function.name must be a non-empty string of at most 64 characters.")
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object.")
        out[name] = params
    return out


@dataclass
class ToolPlan:
    """What one chat request does with tools."""

    mode: str = "none"  # none | auto | required | named
    tools: list = field(default_factory=list)
    schemas: dict = field(default_factory=dict)
    named: Optional[str] = None
    parser_name: Optional[str] = None
    parallel_tool_calls: bool = True

    def structured_outputs(self) -> Optional[StructuredOutputsParams]:
        """The constraint that enforces ``required`` / a named tool (None otherwise)."""
        if self.mode == "named":
            return StructuredOutputsParams(json=self.schemas[self.named])
        if self.mode == "required":
            items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [n]}, "parameters": s},
                      "required": ["name", "parameters"]} for n, s in self.schemas.items()]
            schema = {"type": "array", "minItems": 1, "items": items[0] if len(items) == 1 else {"anyOf": items}}
            if not self.parallel_tool_calls:
                schema["maxItems"] = 1
            return StructuredOutputsParams(json=schema)
        return None

    def new_parser(self) -> Optional[ToolParser]:
        if self.mode == "named":
            return _NamedCallParser(self.named)
        if self.mode == "required":
            return _RequiredCallsParser(self.tools)
        if self.mode == "auto":
            return ToolParserManager.get_tool_parser(self.parser_name)(self.tools)
        return None


def plan_tools(tools: Optional[list], tool_choice, parallel_tool_calls: Optional[bool],
               enable_auto_tool_choice: bool, tool_call_parser: Optional[str]) -> ToolPlan:
    """Raises ValueError naming ``tools`` or ``tool_choice``."""
    schemas = _check_tools(tools)
    parallel = parallel_tool_calls is not False
    if tool_choice is None:
        tool_choice = "auto" if (schemas and enable_auto_tool_choice) else "none"
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if tool_choice.get("type", "function") != "function" or not isinstance(name, str):
            raise ValueError("tool_choice must be none, auto, required or {'type': 'function', 'function': "
                             "{'name': ...}}.")
        if name not in schemas:
            raise ValueError(f"tool_choice names the function {name[:64]!r}, which is not in tools.")
        return ToolPlan("named", tools, schemas, named=name, parallel_tool_calls=parallel)
    if tool_choice not in ("none", "auto", "required"):
        raise ValueError(f"tool_choice must be none, auto, required or a named function, got {tool_choice!r}.")
    if tool_choice == "none" or not schemas:
        if tool_choice == "required":
            raise ValueError("tool_choice 'required' needs at least one tool in tools.")
        return ToolPlan("none", tools or [], schemas)
    if tool_choice == "auto":
        if not (enable_auto_tool_choice and tool_call_parser):
            raise ValueError('tool_choice "auto" needs the server to run with --enable-auto-tool-choice and '
                             "--tool-call-parser.")
        return ToolPlan("auto", tools, schemas, parser_name=tool_call_parser, parallel_tool_calls=parallel)
    return ToolPlan("required", tools, schemas, parallel_tool_calls=parallel)


def messages_for_template(msgs: list[dict]) -> list[dict]:
    """Assistant ``tool_calls`` with ``function.arguments`` as JSON text get it as an object too (chat templates
    such as Qwen2.5's write ``arguments | tojson``)."""
    out = []
    for m in msgs:
        calls = m.get("tool_calls")
        if m.get("role") == "assistant" and isinstance(calls, list):
            m = dict(m)
            fixed = []
            for c in calls:
                if isinstance(c, dict) and isinstance(c.get("function"), dict):
                    fn = dict(c["function"])
                    if isinstance(fn.get("arguments"), str):
                        try:
                            fn["arguments"] = json.loads(fn["arguments"])
                        except ValueError:
                            pass
                    c = {**c, "function": fn}
                fixed.append(c)
            m["tool_calls"] = fixed
        out.append(m)
    return out


# ---------------------------------------------------------------------------------------------------- per choice
@dataclass
class ParsedChoice:
    content: Optional[str]
    reasoning_content: Optional[str]
    tool_calls: list[dict]


def parse_choice(text: str, plan: ToolPlan, reasoning_cls=None, prompt_opens_think: bool = False) -> ParsedChoice:
    """A finished choice's text -> content, reasoning_content, tool_calls."""
    reasoning = None
    content: Optional[str] = text
    if reasoning_cls is not None:
        reasoning, content = reasoning_cls(prompt_opens_think).extract_reasoning(text)
    calls: list[dict] = []
    parser = plan.new_parser()
    if parser is not None and content:
        ext = parser.extract_tool_calls(content)
        if ext.tools_called:
            kept = ext.tool_calls if plan.parallel_tool_calls else ext.tool_calls[:1]
            calls = [c.to_openai() for c in kept]
            content = ext.content
    return ParsedChoice(content, reasoning, calls)


class ChoiceStream:
    """One streamed choice: text deltas in, ``delta`` dicts out (``reasoning_content``, ``content``,
    ``tool_calls``)."""

    def __init__(self, plan: ToolPlan, reasoning_cls=None, prompt_opens_think: bool = False) -> None:
        self.plan = plan
        self.reasoning = reasoning_cls(prompt_opens_think) if reasoning_cls is not None else None
        self.parser = plan.new_parser()

    @property
    def called(self) -> bool:
        return self.parser is not None and self.parser.streamed_tool_calls

    def _delta(self, reasoning: str, content: str, dm: Optional[DeltaMessage]) -> dict:
        d: dict = {}
        if reasoning:
            d["reasoning_content"] = reasoning
        if dm is not None:
            if dm.content:
                d["content"] = dm.content
            calls = [c for c in dm.tool_calls if self.plan.parallel_tool_calls or c.index == 0]
            if calls:
                d["tool_calls"] = [c.to_openai() for c in calls]
        elif content:
            d["content"] = content
        return d

    def feed(self, text: str) -> dict:
        reasoning, content = ("", text)
        if self.reasoning is not None:
            reasoning, content = self.reasoning.extract_reasoning_streaming(text)
        dm = self.parser.extract_tool_calls_streaming(content) if self.parser is not None and content else None
        return self._delta(reasoning, content, dm)

    def finish(self) -> dict:
        reasoning, content = "", ""
        if self.reasoning is not None:
            reasoning, content = self.reasoning.finish_streaming()
        dm = None
        if self.parser is not None:
            dm = self.parser.extract_tool_calls_streaming(content) if content else DeltaMessage()
            tail = self.parser.finish_streaming()
            dm.content = (dm.content or "") + (tail.content or "") or None
            dm.tool_calls.extend(tail.tool_calls)
        return self._delta(reasoning, content, dm)


def merge_delta(dst: dict, src: dict) -> None:
    """Appends stream delta ``src`` to ``dst`` (text fields concatenate, tool-call lists extend)."""
    for k, v in src.items():
        if k not in dst:
            dst[k] = v
        elif k == "tool_calls":
            dst[k] = dst[k] + v
        else:
            dst[k] = dst[k] + v
