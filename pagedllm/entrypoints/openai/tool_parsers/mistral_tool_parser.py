"""``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (Mistral v3 templates), and the newer
``[TOOL_CALLS]name[ARGS]{...}`` form (v11+ tokenizers; parsed when the output is complete, streamed at the end)."""

from __future__ import annotations

import json

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCalls,
    JsonToolParser,
    ToolCall,
    ToolParserManager,
    partial_marker_len,
)
from pagedllm.entrypoints.openai.tool_parsers.json_scan import array_object_starts, skip_ws

BOT = "[TOOL_CALLS]"
ARGS = "[ARGS]"


def mistral_tool_call_id() -> str:
    """Mistral's templates accept only 9-character alphanumeric ids."""
    import random
    import string

    return "".join(random.choices(string.ascii_letters + string.digits, k=9))


@ToolParserManager.register_module("mistral")
class MistralToolParser(JsonToolParser):
    args_keys = ("arguments", "parameters")

    def _locate(self, text: str, final: bool) -> tuple[int, list[int]]:
        first = text.find(BOT)
        if first < 0:
            return len(text) - (0 if final else partial_marker_len(text, BOT)), []
        i = skip_ws(text, first + len(BOT))
        starts = []
        if i < len(text) and text[i] == "[":
            starts = array_object_starts(text, i)
        elif i < len(text) and text[i] == "{":
            starts.append(i)
        return first, starts

    def _v11_calls(self, text: str) -> list[ToolCall]:
        calls = []
        for part in text.split(BOT)[1:]:
            if ARGS not in part:
                return []
            name, args = part.split(ARGS, 1)
            args = args.strip()
            try:
                if not isinstance(json.loads(args), dict):
                    return []
            except ValueError:
                return []
            calls.append(ToolCall(name.strip(), args, id=mistral_tool_call_id()))
        return calls

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        out = super().extract_tool_calls(text)
        if not out.tools_called and ARGS in text:
            calls = self._v11_calls(text)
            if calls:
                content = text[:text.find(BOT)].strip()
                return ExtractedToolCalls(True, calls, content or None)
        for c in out.tool_calls:
            c.id = mistral_tool_call_id()
        return out

    def finish_streaming(self) -> DeltaMessage:
        if not self.streamed_tool_calls and ARGS in self.text:
            calls = self._v11_calls(self.text)
            if calls:
                self._calls = [[-1, c.id, True, None] for c in calls]
                content = self.text[self._content_sent:self.text.find(BOT)]
                return DeltaMessage(content=content or None, tool_calls=[
                    DeltaToolCall(i, id=c.id, name=c.name, arguments=c.arguments) for i, c in enumerate(calls)])
        return super().finish_streaming()
