"""Hostile input against the real server (the shared ``pagedllm serve`` of conftest.py): for every bound in the
README's "Request bounds" table and every string field, the violating input. After each: the expected 4xx in
OpenAI's error shape naming the field, ``/health`` 200, and a canary request answering exactly as before.

The first two cases are the engine-killers of issue 18: a ``seed`` past what ``torch.Generator`` takes, and a
``cache_salt`` holding a lone UTF-16 surrogate with a prompt that fills a KV block; both used to pass validation
and raise inside ``engine.step()``, so every later request got 503.

Bodies are sent as raw JSON (``json.dumps``, which writes ``\\ud800`` as an escape, valid JSON that decodes to a
lone surrogate); httpx's own encoder would refuse such a string on the client side.
"""

from __future__ import annotations

import json

import httpx
import pytest

from conftest import SERVER_MAX_MODEL_LEN

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

LONE = "\ud800"  # a lone high surrogate: valid JSON (as an escape), not encodable UTF-8
LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 4  # > 16 tokens: fills a KV block
CHAT = [{"role": "user", "content": "Hi"}]
CANARY = {"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}

C, CH, TOK, DETOK = "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"

# (id, path, body, status, param). ``body`` is a dict (sent with json.dumps) or raw bytes.
HOSTILE = [
    # --- the two engine-killers of issue 18
    ("seed_2_64", C, {"prompt": "hi", "seed": 18446744073709551616}, 400, "seed"),
    ("cache_salt_lone_surrogate", C, {"prompt": LONG_PROMPT, "cache_salt": LONE, "max_tokens": 2}, 400,
     "cache_salt"),
    # --- integers a library consumes
    ("seed_below_int64", C, {"prompt": "hi", "seed": -(2 ** 63) - 1}, 400, "seed"),
    ("seed_plus_n_overflows", C, {"prompt": "hi", "seed": 2 ** 64 - 1, "n": 2, "max_tokens": 1}, 400, "seed"),
    ("seed_huge", C, {"prompt": "hi", "seed": 10 ** 40}, 400, "seed"),
    ("seed_string", C, {"prompt": "hi", "seed": "abc"}, 400, "seed"),
    ("chat_seed_2_64", CH, {"messages": CHAT, "seed": 2 ** 64}, 400, "seed"),
    ("prompt_token_oov", C, {"prompt": [1, 2, 10 ** 7]}, 400, "prompt"),
    ("prompt_token_negative", C, {"prompt": [1, -1]}, 400, "prompt"),
    ("prompt_token_huge", C, {"prompt": [2 ** 70]}, 400, "prompt"),
    ("prompt_token_float", C, {"prompt": [1.5]}, 400, "prompt"),
    ("prompt_batch_token_oov", C, {"prompt": [[1, 2], [10 ** 9]]}, 400, "prompt"),
    ("logprobs_over_max", C, {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("logprobs_huge", C, {"prompt": "hi", "logprobs": 10 ** 30}, 400, "logprobs"),
    ("prompt_logprobs_over_max", C, {"prompt": "hi", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ("chat_top_logprobs_over_max", CH, {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, 400,
     "top_logprobs"),
    ("top_k_over_vocab", C, {"prompt": "hi", "top_k": 10 ** 9}, 400, "top_k"),
    ("top_k_below", C, {"prompt": "hi", "top_k": -2}, 400, "top_k"),
    ("max_tokens_huge", C, {"prompt": "hi", "max_tokens": 10 ** 20}, 400, "max_tokens"),
    ("max_tokens_zero", C, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("min_tokens_huge", C, {"prompt": "hi", "max_tokens": 4, "min_tokens": 10 ** 20}, 400, "min_tokens"),
    ("chat_max_completion_tokens_huge", CH, {"messages": CHAT, "max_completion_tokens": 10 ** 12}, 400,
     "max_completion_tokens"),
    # --- strings that are not encodable UTF-8
    ("prompt_lone_surrogate", C, {"prompt": "hello " + LONE}, 400, "prompt"),
    ("prompt_list_lone_surrogate", C, {"prompt": ["ok", LONE]}, 400, "prompt"),
    ("stop_lone_surrogate", C, {"prompt": "hi", "stop": [LONE]}, 400, "stop"),
    ("stop_str_lone_surrogate", C, {"prompt": "hi", "stop": "\udfff"}, 400, "stop"),
    ("model_lone_surrogate", C, {"prompt": "hi", "model": LONE}, 400, "model"),
    ("user_lone_surrogate", C, {"prompt": "hi", "user": LONE}, 400, "user"),
    ("suffix_lone_surrogate", C, {"prompt": "hi", "suffix": LONE}, 400, "suffix"),
    ("logit_bias_key_lone_surrogate", C, {"prompt": "hi", "logit_bias": {LONE: 1}}, 400, "logit_bias"),
    ("chat_content_lone_surrogate", CH, {"messages": [{"role": "user", "content": LONE}]}, 400, "messages"),
    ("chat_name_lone_surrogate", CH, {"messages": [{"role": "user", "content": "x", "name": LONE}]}, 400,
     "messages"),
    ("chat_parts_lone_surrogate", CH, {"messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}]},
     400, "messages"),
    ("chat_cache_salt_lone_surrogate", CH, {"messages": CHAT, "cache_salt": LONE}, 400, "cache_salt"),
    ("chat_tools_lone_surrogate", CH, {"messages": CHAT, "tools": [{"type": "function", "function": {
        "name": LONE, "parameters": {"type": "object"}}}]}, 400, "tools"),
    ("chat_tool_choice_lone_surrogate", CH, {"messages": CHAT, "tool_choice": LONE}, 400, "tool_choice"),
    ("chat_template_kwargs_lone_surrogate", CH, {"messages": CHAT, "chat_template_kwargs": {"x": LONE}}, 400,
     "chat_template_kwargs"),
    ("tokenize_lone_surrogate", TOK, {"prompt": LONE}, 400, "prompt"),
    ("tokenize_chat_lone_surrogate", TOK, {"messages": [{"role": "user", "content": LONE}]}, 400, "messages"),
    ("low_surrogate_only", C, {"prompt": "\udc80abc"}, 400, "prompt"),
    # --- sizes
    ("n_over_cap", C, {"prompt": "hi", "n": 129, "max_tokens": 1}, 400, "n"),
    ("n_huge", C, {"prompt": "hi", "n": 10 ** 20}, 400, "n"),
    ("n_times_prompts_over_cap", C, {"prompt": ["a", "b"], "n": 65, "max_tokens": 1}, 400, "n"),
    ("chat_n_over_cap", CH, {"messages": CHAT, "n": 200}, 400, "n"),
    ("stop_too_many", C, {"prompt": "hi", "stop": [f"s{i}" for i in range(65)]}, 400, "stop"),
    ("stop_too_long", C, {"prompt": "hi", "stop": ["x" * 1025]}, 400, "stop"),
    ("stop_empty", C, {"prompt": "hi", "stop": [""]}, 400, "stop"),
    ("logit_bias_too_many", C, {"prompt": "hi", "logit_bias": {str(i): 1 for i in range(1025)}}, 400,
     "logit_bias"),
    ("allowed_token_ids_too_many", C, {"prompt": "hi", "allowed_token_ids": list(range(4097))}, 400,
     "allowed_token_ids"),
    ("allowed_token_ids_oov", C, {"prompt": "hi", "allowed_token_ids": [10 ** 8]}, 400, "allowed_token_ids"),
    ("allowed_token_ids_empty", C, {"prompt": "hi", "allowed_token_ids": []}, 400, "allowed_token_ids"),
    ("stop_token_ids_too_many", C, {"prompt": "hi", "stop_token_ids": list(range(1025))}, 400,
     "stop_token_ids"),
    ("stop_token_ids_huge", C, {"prompt": "hi", "stop_token_ids": [10 ** 12]}, 400, "stop_token_ids"),
    ("prompts_too_many", C, {"prompt": ["a"] * 1025, "max_tokens": 1}, 400, "prompt"),
    ("cache_salt_empty", C, {"prompt": "hi", "cache_salt": ""}, 400, "cache_salt"),
    ("cache_salt_too_long", C, {"prompt": "hi", "cache_salt": "s" * 1025}, 400, "cache_salt"),
    ("prompt_too_long", C, {"prompt": "hello " * 3000}, 400, "prompt"),
    ("prompt_chars_far_too_long", C, {"prompt": "x" * (64 * SERVER_MAX_MODEL_LEN + 1)}, 400, "prompt"),
    ("chat_render_too_long", CH, {"messages": [{"role": "user", "content": "y" * (1 << 20)}]}, 400, "messages"),
    ("detokenize_oov", DETOK, {"tokens": [10 ** 7]}, 400, "tokens"),
    ("detokenize_too_many", DETOK, {"tokens": [1] * (SERVER_MAX_MODEL_LEN + 1)}, 400, "tokens"),
    ("body_over_limit", C, b'{"prompt": "' + b"a" * (16 << 20) + b'"}', 413, None),
    ("deep_nesting", C, b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None),
    # --- OpenAI's ranges (and values JSON can't otherwise express)
    ("temperature_over_2", C, {"prompt": "hi", "temperature": 2.5}, 400, "temperature"),
    ("temperature_negative", C, {"prompt": "hi", "temperature": -0.1}, 400, "temperature"),
    ("temperature_inf", C, b'{"prompt": "hi", "temperature": 1e400}', 400, "temperature"),
    ("temperature_nan", C, b'{"prompt": "hi", "temperature": NaN}', 400, None),
    ("top_p_zero", C, {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("top_p_over_1", C, {"prompt": "hi", "top_p": 1.01}, 400, "top_p"),
    ("presence_penalty_over", C, {"prompt": "hi", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("frequency_penalty_under", C, {"prompt": "hi", "frequency_penalty": -3}, 400, "frequency_penalty"),
    ("repetition_penalty_zero", C, {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("repetition_penalty_huge", C, {"prompt": "hi", "repetition_penalty": 1e300}, 400, "repetition_penalty"),
    ("min_p_over_1", C, {"prompt": "hi", "min_p": 2}, 400, "min_p"),
    ("logit_bias_over_100", C, {"prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("logit_bias_key_not_id", C, {"prompt": "hi", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("logit_bias_key_oov", C, {"prompt": "hi", "logit_bias": {"10000000": 1}}, 400, "logit_bias"),
    # --- templates and chat options
    ("chat_template_untrusted", CH, {"messages": CHAT, "chat_template": "{{ messages }}"}, 400, "chat_template"),
    ("tokenize_chat_template_untrusted", TOK, {"messages": CHAT, "chat_template": "x"}, 400, "chat_template"),
    ("continue_and_add_generation_prompt", CH, {"messages": [{"role": "user", "content": "a"},
                                                             {"role": "assistant", "content": "b"}],
                                                "continue_final_message": True, "add_generation_prompt": True},
     400, "continue_final_message"),
    ("chat_template_kwargs_reserved", CH, {"messages": CHAT, "chat_template_kwargs": {"tokenize": True}}, 400,
     "chat_template_kwargs"),
    ("chat_template_kwargs_messages", CH, {"messages": CHAT, "chat_template_kwargs": {"messages": []}}, 400,
     "chat_template_kwargs"),
    # --- unsupported / malformed
    ("best_of", C, {"prompt": "hi", "best_of": 3}, 400, "best_of"),
    ("malformed_json", C, b'{"prompt": "hi",', 400, None),
    ("not_an_object", C, b"[1, 2, 3]", 400, None),
    ("invalid_utf8_bytes", C, b'{"prompt": "\xff\xfe"}', 400, None),
    ("stream_options_without_stream", C, {"prompt": "hi", "stream_options": {"continuous_usage_stats": True}},
     400, "stream_options"),
    ("stream_seed_2_64", C, {"prompt": "hi", "seed": 2 ** 64, "stream": True}, 400, "seed"),
]


def _post(c: httpx.Client, path: str, body) -> httpx.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return c.post(path, content=data, headers={"content-type": "application/json"})


@pytest.fixture(scope="module")
def canary_text(pagedllm_server):
    with httpx.Client(base_url=pagedllm_server.url, timeout=120) as c:
        r = c.post(C, json=CANARY)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]


@pytest.mark.parametrize("case", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_input_is_refused_and_nobody_notices(pagedllm_server, canary_text, case):
    _, path, body, status, param = case
    with httpx.Client(base_url=pagedllm_server.url, timeout=120) as c:
        r = _post(c, path, body)
        assert r.status_code == status, (r.status_code, r.text[:500])
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["type"], err
        if param is not None:
            assert err["param"] == param, err
        assert c.get("/health").status_code == 200
        ok = c.post(C, json=CANARY)
        assert ok.status_code == 200, ok.text
        assert ok.json()["choices"][0]["text"] == canary_text


def test_valid_neighbours_of_the_bounds_are_accepted(pagedllm_server):
    """The bounds are not off by one: the largest accepted values work."""
    with httpx.Client(base_url=pagedllm_server.url, timeout=300) as c:
        for body in ({"prompt": "hi", "seed": 2 ** 64 - 1, "max_tokens": 1},
                     {"prompt": "hi", "seed": -(2 ** 63), "max_tokens": 1},
                     {"prompt": "hi", "seed": 2 ** 64 - 3, "n": 3, "max_tokens": 1, "temperature": 1},
                     {"prompt": "hi", "temperature": 2, "max_tokens": 1},
                     {"prompt": "hi", "stop": ["x" * 1024] + [f"s{i}" for i in range(63)], "max_tokens": 1},
                     {"prompt": "hi", "logprobs": 20, "max_tokens": 1},
                     {"prompt": LONG_PROMPT, "cache_salt": "tenant-\U0001F600", "max_tokens": 1},
                     {"prompt": "emoji \U0001F600 ok", "max_tokens": 1}):
            r = _post(c, C, body)
            assert r.status_code == 200, (body, r.text[:300])
