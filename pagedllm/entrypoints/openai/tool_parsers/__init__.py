"""Tool-call parsers, registered by name (vLLM's ``--tool-call-parser`` names): ``hermes``, ``llama3_json``,
``mistral``, ``pythonic``. See abstract_tool_parser.py for the interface."""

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCalls,
    ToolCall,
    ToolParser,
    ToolParserManager,
)
from pagedllm.entrypoints.openai.tool_parsers import (  # noqa: F401 - registers the parsers
    hermes_tool_parser,
    llama3_json_tool_parser,
    mistral_tool_parser,
    pythonic_tool_parser,
)

__all__ = ["DeltaMessage", "DeltaToolCall", "ExtractedToolCalls", "ToolCall", "ToolParser", "ToolParserManager"]
