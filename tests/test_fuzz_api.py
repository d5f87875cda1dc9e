"""Fuzzing the real server (the shared ``pagedllm serve`` of conftest.py), bounded:

- schemathesis generates requests for every operation of our own ``/openapi.json`` (valid and schema-violating
  bodies, within a fixed number of examples per operation);
- hypothesis generates completions bodies biased towards the edges: integers past int64/uint64, floats at and past
  OpenAI's ranges, strings with lone surrogates, token ids past the vocabulary.

Every answer must be below 500 and in OpenAI's error shape when it is an error; afterwards ``/health`` is 200 and
a canary request still answers as before. Generation is kept short (``max_tokens`` capped at 4, ``n`` at 3) so the
examples cost milliseconds, not seconds.
"""

from __future__ import annotations

import json

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CANARY = {"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}
MAX_TOKENS_CAP = 4
N_CAP = 3


@pytest.fixture(scope="module")
def canary_text(pagedllm_server):
    r = httpx.post(pagedllm_server.url + "/v1/completions", json=CANARY, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_reference_canary(canary_text):
    """The canary's answer before any fuzzing (module-scoped; compared in test_engine_alive_after_fuzzing)."""
    assert canary_text


def _bound_cost(body) -> None:
    """Caps what a *valid* body may cost (token count, choices); out-of-range values are left for the server."""
    if not isinstance(body, dict):
        return
    for key in ("max_tokens", "max_completion_tokens"):
        v = body.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and MAX_TOKENS_CAP < v < 10 ** 6:
            body[key] = MAX_TOKENS_CAP
    if ("prompt" in body or "messages" in body) and body.get("max_tokens") is None \
            and body.get("max_completion_tokens") is None:
        body["max_tokens"] = MAX_TOKENS_CAP
    v = body.get("n")
    if isinstance(v, int) and not isinstance(v, bool) and N_CAP < v <= 128:
        body["n"] = N_CAP
    body.pop("min_tokens", None)


def _check_answer(status: int, content: bytes, what) -> None:
    assert status < 500, (what, status, content[:500])
    # A stream that started reports errors in-band: none may be a server fault.
    assert b"internal_error" not in content and b"request_failed" not in content, (what, content[-500:])
    if status >= 400 and status != 413:
        err = json.loads(content)["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], err


def test_openapi_fuzz_no_5xx(pagedllm_server):
    """Every operation of /openapi.json, 15 schemathesis examples each. (Loaded from the running server inside the
    test: schemathesis' pytest fixture loader doesn't work with pytest 9.)"""
    schema = schemathesis.openapi.from_url(pagedllm_server.url + "/openapi.json")
    ops = [op.ok() for op in schema.get_all_operations()]
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"} <= {op.path for op in ops}
    for op in ops:
        if op.path == "/reset_prefix_cache":
            continue  # a dev endpoint; its side effect (an empty prefix cache) is not under test

        @given(case=op.as_strategy())
        @settings(max_examples=15, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def check(case):
            _bound_cost(case.body)
            r = case.call(timeout=120)
            _check_answer(r.status_code, r.content, (case.method, case.path, case.body))

        check()


# ---------------------------------------------------------------------------------------------------- hypothesis
_BIG_INTS = st.sampled_from([-(2 ** 63) - 1, -(2 ** 63), -1, 0, 1, 2 ** 31, 2 ** 63, 2 ** 64 - 1, 2 ** 64,
                             10 ** 30])
_INTS = st.one_of(st.integers(-3, 5), _BIG_INTS, st.integers(-(2 ** 80), 2 ** 80))
_FLOATS = st.one_of(st.sampled_from([0.0, 1e-9, 0.5, 1.0, 2.0, 2.0000001, -2.0, -2.5, 100.0, 101.0, 1e308]),
                    st.floats(allow_nan=False, allow_infinity=False))
_TEXT = st.one_of(st.text(max_size=12),
                  st.lists(st.sampled_from(["a", " ", "\ud800", "\udfff", "\U0001F600", "<|im_end|>", "\x00"]),
                           max_size=6).map("".join))
_TOKEN = st.one_of(st.integers(0, 49151), st.integers(-5, -1), st.integers(49152, 2 ** 70))
_BODY = st.fixed_dictionaries(
    {"prompt": st.one_of(_TEXT.filter(bool), st.lists(_TOKEN, min_size=1, max_size=6),
                         st.lists(st.lists(_TOKEN, min_size=1, max_size=3), min_size=1, max_size=2))},
    optional={
        "max_tokens": st.one_of(st.integers(-2, MAX_TOKENS_CAP), _BIG_INTS),
        "n": st.one_of(st.integers(-1, N_CAP), st.sampled_from([129, 2 ** 64])),
        "seed": _INTS, "temperature": _FLOATS, "top_p": _FLOATS, "top_k": _INTS, "min_p": _FLOATS,
        "presence_penalty": _FLOATS, "frequency_penalty": _FLOATS, "repetition_penalty": _FLOATS,
        "stop": st.one_of(_TEXT, st.lists(_TEXT, max_size=3)), "stop_token_ids": st.lists(_TOKEN, max_size=3),
        "logit_bias": st.dictionaries(st.one_of(_TOKEN.map(str), _TEXT), _FLOATS, max_size=3),
        "allowed_token_ids": st.lists(_TOKEN, max_size=3), "logprobs": st.one_of(st.integers(0, 3), _BIG_INTS),
        "prompt_logprobs": st.one_of(st.integers(0, 2), _BIG_INTS), "cache_salt": _TEXT, "user": _TEXT,
        "echo": st.booleans(), "skip_special_tokens": st.booleans(), "include_stop_str_in_output": st.booleans(),
        "ignore_eos": st.booleans(), "stream": st.booleans(), "return_tokens_as_token_ids": st.booleans(),
    })


@given(body=_BODY)
@settings(max_examples=120, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
def test_hypothesis_completion_bodies_no_5xx(pagedllm_server, body):
    data = json.dumps(body).encode()  # lone surrogates go out as \\uXXXX escapes (valid JSON)
    r = httpx.post(pagedllm_server.url + "/v1/completions", content=data,
                   headers={"content-type": "application/json"}, timeout=120)
    _check_answer(r.status_code, r.content, body)


def test_engine_alive_after_fuzzing(pagedllm_server, canary_text):
    """Runs after the fuzz tests in this module (pytest keeps file order)."""
    with httpx.Client(base_url=pagedllm_server.url, timeout=120) as c:
        assert c.get("/health").status_code == 200
        r = c.post("/v1/completions", json=CANARY)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == canary_text
