"""``llama3_json``: Llama 3.x JSON tool calls, ``{"name": ..., "parameters": {...}}`` (optionally after
``<|python_tag|>``), several separated by ``;``. The output must start with the call (after whitespace); text
before a call makes it content, as in vLLM."""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import JsonToolParser, ToolParserManager
from pagedllm.entrypoints.openai.tool_parsers.json_scan import scan_value, skip_ws

PYTHON_TAG = "<|python_tag|>"


@ToolParserManager.register_module("llama3_json")
class Llama3JsonToolParser(JsonToolParser):
    args_keys = ("parameters", "arguments")

    def _locate(self, text: str, final: bool) -> tuple[int, list[int]]:
        i = skip_ws(text, 0)
        if text.startswith(PYTHON_TAG, i):
            i = skip_ws(text, i + len(PYTHON_TAG))
        elif not final and PYTHON_TAG.startswith(text[i:]) and i < len(text):
            return 0, []  # maybe the tag
        if i >= len(text):
            return (len(text) if final else 0), []
        if text[i] != "{":
            return len(text), []
        starts = []
        while i < len(text) and text[i] == "{":
            starts.append(i)
            end = scan_value(text, i)
            if end is None:
                break
            j = skip_ws(text, end)
            if j < len(text) and text[j] == ";":
                i = skip_ws(text, j + 1)
            else:
                break
        return 0, starts
