"""``hermes``: Qwen2.5 / Qwen3 / Hermes ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

Beyond vLLM's parser: when the output (after leading whitespace, and optionally inside a Markdown code fence such
as a json-tagged triple-backtick block) is a bare JSON object naming one of the request's tools, with arguments that
are an object valid against that tool's ``parameters`` schema, it is a call too (small Qwen models often drop the
tags, and Qwen2.5-Coder fences them; llama.cpp's generic fallback does the same). Any other JSON stays content.
"""

from __future__ import annotations

import json

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ExtractedToolCalls,
    JsonToolParser,
    ToolCall,
    ToolParserManager,
    partial_marker_len,
)
from pagedllm.entrypoints.openai.tool_parsers.json_scan import scan_call, scan_value, skip_ws
from pagedllm.entrypoints.openai.tool_parsers.schema_check import arguments_match_schema

START = "<tool_call>"
FENCE = "```"


def _bare_start(text: str, final: bool):
    """Index of the ``{`` a bare call would start at (after whitespace and an optional code-fence line), ``-1``
    while that can't be known yet, or None when the output can't be a bare call."""
    i = skip_ws(text, 0)
    if text.startswith(FENCE, i):
        nl = text.find("\n", i)
        if nl < 0:
            return None if final else -1
        i = skip_ws(text, nl + 1)
    elif i < len(text) and FENCE.startswith(text[i:]):
        return None if final else -1
    if i >= len(text):
        return None if final else -1
    return i if text[i] == "{" else None


@ToolParserManager.register_module("hermes")
class Hermes2ProToolParser(JsonToolParser):
    args_keys = ("arguments",)

    def _bare_call(self, text: str, i: int, final: bool):
        """For output whose call object would start at ``i``: ``"call"`` (a valid bare call), ``"content"`` or
        ``"pending"``."""
        end = scan_value(text, i)
        if end is None:
            return "content" if final else "pending"
        sc = scan_call(text, i, self.args_keys)
        if sc.malformed or sc.end is None or sc.name not in self.schemas:
            return "content"
        try:
            args = json.loads(text[sc.args_start:sc.args_end])
        except ValueError:
            return "content"
        if not arguments_match_schema(args, self.schemas[sc.name]):
            return "content"
        return "call"

    def _locate(self, text: str, final: bool) -> tuple[int, list[int]]:
        first = text.find(START)
        if first < 0:
            i = _bare_start(text, final) if self.schemas else None
            if i == -1:
                return 0, []  # whitespace or a fence so far: it may precede a bare call
            if i is not None:
                state = self._bare_call(text, i, final)
                if state == "call":
                    return 0, [i]
                if state == "pending":
                    return 0, []
                return len(text), []
            return len(text) - (0 if final else partial_marker_len(text, START)), []
        starts = []
        pos = first
        while pos >= 0:
            j = skip_ws(text, pos + len(START))
            if j < len(text) and text[j] == "{":
                starts.append(j)
            pos = text.find(START, pos + len(START))
        return first, starts

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        out = super().extract_tool_calls(text)
        if out.tools_called and text.find(START) < 0:
            # a bare call: there is no content around it
            return ExtractedToolCalls(True, out.tool_calls, None)
        return out


__all__ = ["Hermes2ProToolParser", "ToolCall"]
