"""Tool-call parsers and reasoning parsers on canned model outputs: whole and streamed (one character per delta
and in random-sized pieces), text before a call, malformed JSON, two calls; plus tool_choice planning."""

from __future__ import annotations

import json
import random

import pytest

from pagedllm.config import REASONING_PARSERS
from pagedllm.entrypoints.openai.chat_tools import ChoiceStream, merge_delta, parse_choice, plan_tools
from pagedllm.entrypoints.openai.reasoning import _PARSERS, get_reasoning_parser
from pagedllm.entrypoints.openai.tool_parsers import ToolParserManager

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
TOOLS = [WEATHER, TIME]


def pieces(text: str, mode: str) -> list[str]:
    if mode == "chars":
        return list(text)
    rng = random.Random(len(text))
    out, i = [], 0
    while i < len(text):
        k = rng.randint(1, 7)
        out.append(text[i:i + k])
        i += k
    return out


def stream(parser_name: str, text: str, mode: str):
    p = ToolParserManager.get_tool_parser(parser_name)(TOOLS)
    content = ""
    calls: dict[int, dict] = {}
    deltas = [p.extract_tool_calls_streaming(d) for d in pieces(text, mode)] + [p.finish_streaming()]
    for dm in deltas:
        content += dm.content or ""
        for tc in dm.tool_calls:
            c = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.id is not None:
                assert c["id"] is None
                c["id"] = tc.id
            if tc.name is not None:
                assert c["arguments"] == "", "name before arguments"
                c["name"] = tc.name
            c["arguments"] += tc.arguments
    return content, [calls[i] for i in sorted(calls)]


# (parser, model output, expected calls [(name, arguments)], expected content)
CASES = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     [("get_weather", '{"city": "Paris"}')], None),
    ("hermes", 'Let me look that up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
               '</tool_call>', [("get_weather", '{"city": "Paris"}')], "Let me look that up."),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
               '{"name": "get_time", "arguments": {"city": "Rome, \\"IT\\" {x}"}}\n</tool_call>',
     [("get_weather", '{"city": "Paris"}'), ("get_time", '{"city": "Rome, \\"IT\\" {x}"}')], None),
    # bare JSON naming a declared tool with valid arguments (no tags): a call
    ("hermes", '{"name": "get_weather", "arguments": {"city": "Paris"}}', [("get_weather", '{"city": "Paris"}')],
     None),
    # ... also in a Markdown code fence (what Qwen2.5-Coder-0.5B writes with tool_choice auto)
    ("hermes", '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```',
     [("get_weather", '{\n    "city": "Paris"\n  }')], None),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}',
     [("get_weather", '{"city": "Paris"}')], None),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                    '{"name": "get_time", "parameters": {}}',
     [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")], None),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                '{"name": "get_time", "arguments": {}}]',
     [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")], None),
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
     [("get_weather", '{"city": "Paris"}')], "Sure."),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', [("get_weather", '{"city": "Paris"}')], None),
    ("pythonic", '[get_weather(city="Paris"), get_time()]',
     [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")], None),
]


@pytest.mark.parametrize("name,text,calls,content", CASES)
@pytest.mark.parametrize("mode", ["chars", "pieces"])
def test_parsers_whole_and_streamed(name, text, calls, content, mode):
    parser = ToolParserManager.get_tool_parser(name)(TOOLS)
    out = parser.extract_tool_calls(text)
    assert out.tools_called
    assert [(c.name, c.arguments) for c in out.tool_calls] == calls
    assert out.content == content
    for c in out.tool_calls:
        json.loads(c.arguments)
    s_content, s_calls = stream(name, text, mode)
    assert [(c["name"], c["arguments"]) for c in s_calls] == calls
    assert all(c["id"] for c in s_calls)
    assert (s_content.strip() or None) == content


NOT_CALLS = [
    ("hermes", "The weather in Paris is sunny."),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'),  # malformed JSON
    ("hermes", '{"name": "get_weather", "arguments": {"town": "Paris"}}'),  # schema says city is required
    ("hermes", '{"name": "not_a_tool", "arguments": {}}'),
    ("hermes", '{"answer": 42}'),
    ("hermes", '```python\nprint("hi")\n```'),
    ("hermes", '```json\n{"name": "not_a_tool", "arguments": {}}\n```'),
    ("llama3_json", 'Here you go: {"name": "get_weather", "parameters": {"city": "Paris"}}'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Par'),  # truncated
    ("mistral", "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\" \"Paris\"}}]"),
    ("pythonic", "[get_weather(city=Paris)]"),  # not a literal
    ("pythonic", "I think [1, 2] is a list."),
]


@pytest.mark.parametrize("name,text", NOT_CALLS)
def test_non_calls_stay_content(name, text):
    out = ToolParserManager.get_tool_parser(name)(TOOLS).extract_tool_calls(text)
    assert not out.tools_called and out.tool_calls == [] and out.content == text
    s_content, s_calls = stream(name, text, "pieces")
    if not s_calls:  # a stream may have sent a call's name before its JSON broke; otherwise it is content
        assert s_content == text


def test_plain_text_streams_without_delay_beyond_a_partial_marker():
    p = ToolParserManager.get_tool_parser("hermes")(TOOLS)
    assert p.extract_tool_calls_streaming("Hello").content == "Hello"
    assert not p.extract_tool_calls_streaming(" <tool_").content.endswith("<tool_")
    assert p.extract_tool_calls_streaming("x>").content.endswith("<tool_x>")


def test_unknown_parser_name():
    with pytest.raises(ValueError, match="tool_call_parser"):
        ToolParserManager.get_tool_parser("nope")


def test_plan_tools():
    assert plan_tools(None, None, None, True, "hermes").mode == "none"
    assert plan_tools(TOOLS, None, None, True, "hermes").mode == "auto"
    assert plan_tools(TOOLS, None, None, False, None).mode == "none"
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "get_time"}}, None, False, None)
    assert named.mode == "named" and named.structured_outputs().json == TIME["function"]["parameters"]
    req = plan_tools(TOOLS, "required", False, False, None)
    schema = req.structured_outputs().json
    assert schema["minItems"] == 1 and schema["maxItems"] == 1
    assert "maxItems" not in plan_tools(TOOLS, "required", True, False, None).structured_outputs().json
    for tools, choice, match in [
        (TOOLS, "auto", "enable-auto-tool-choice"),
        (TOOLS, {"type": "function", "function": {"name": "x"}}, "tool_choice"),
        (None, "required", "tool_choice"),
        (TOOLS, "sometimes", "tool_choice"),
        ([{"type": "function"}], None, r"tools\[0\]"),
        ([WEATHER] * 200, None, "tools"),
    ]:
        with pytest.raises(ValueError, match=match):
            plan_tools(tools, choice, None, False, None)


def test_required_and_named_outputs_parse_and_stream():
    req = plan_tools(TOOLS, "required", True, False, None)
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'
    parsed = parse_choice(text, req)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in parsed.tool_calls] == [
        ("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
    assert parsed.content is None
    one = plan_tools(TOOLS, "auto", False, True, "hermes")
    two_calls = CASES[2][1]
    assert len(parse_choice(two_calls, one).tool_calls) == 1  # parallel_tool_calls false: the first call only
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, None, False, None)
    args = '{"city": "Paris"}'
    assert parse_choice(args, named).tool_calls[0]["function"] == {"name": "get_weather", "arguments": args}
    for plan, txt in ((req, text), (named, args), (one, two_calls)):
        cs = ChoiceStream(plan)
        delta: dict = {}
        for piece in pieces(txt, "pieces"):
            merge_delta(delta, cs.feed(piece))
        merge_delta(delta, cs.finish())
        assert cs.called
        got: dict[int, str] = {}
        for tc in delta["tool_calls"]:
            got[tc["index"]] = got.get(tc["index"], "") + tc["function"]["arguments"]
        whole = parse_choice(txt, plan).tool_calls
        assert [got[i] for i in sorted(got)] == [c["function"]["arguments"] for c in whole]


@pytest.mark.parametrize("name", REASONING_PARSERS)
@pytest.mark.parametrize("text", ["<think>Plan: 6*7.</think>\n\n42", "Plan: 6*7.</think>42", "42", "<think>long"])
def test_reasoning_parsers_whole_equals_streamed(name, text):
    cls = get_reasoning_parser(name)
    reasoning, content = cls().extract_reasoning(text)
    p = cls()
    rs = cs = ""
    for piece in pieces(text, "chars"):
        r, c = p.extract_reasoning_streaming(piece)
        rs, cs = rs + r, cs + c
    r, c = p.finish_streaming()
    rs, cs = rs + r, cs + c
    assert (rs or None, cs or None) == (reasoning, content)
    if text.startswith("<think>Plan"):
        assert (reasoning, content) == ("Plan: 6*7.", "42")
    if text == "42":
        assert (reasoning, content) == (("42", None) if name == "deepseek_r1" else (None, "42"))


def test_reasoning_then_tool_call():
    plan = plan_tools(TOOLS, "auto", True, True, "hermes")
    text = '<think>I need the weather.</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": ' \
           '{"city": "Paris"}}\n</tool_call>'
    parsed = parse_choice(text, plan, get_reasoning_parser("qwen3"))
    assert parsed.reasoning_content == "I need the weather."
    assert parsed.tool_calls[0]["function"]["arguments"] == '{"city": "Paris"}' and parsed.content is None
    assert set(_PARSERS) == set(REASONING_PARSERS)
