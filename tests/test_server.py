"""The OpenAI-compatible server end to end: a real ``pagedllm serve`` process (bundled SmolLM2, see conftest.py),
the official ``openai`` client, and httpx for raw and malformed requests.

One server serves every test here (start-up dominates), so tests only send small, bounded work.
"""

from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import openai
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def server(pagedllm_server):
    return pagedllm_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(server):
    return httpx.get(server.url + "/v1/models").json()["data"][0]["id"]


def _tokenize(server, **body) -> int:
    r = httpx.post(server.url + "/tokenize", json=body)
    assert r.status_code == 200, r.text
    return r.json()["count"]


def _metrics(server) -> dict[str, float]:
    """/metrics as ``{name: value}``; labels other than model_name go in the key: ``name{k=v,...}``."""
    out = {}
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name_labels, value = line.rsplit(" ", 1)
        name = name_labels.split("{", 1)[0]
        labels = dict(re.findall(r'(\w+)="([^"]*)"', name_labels))
        extra = ",".join(f"{k}={v}" for k, v in sorted(labels.items()) if k != "model_name")
        out[f"{name}{{{extra}}}" if extra else name] = float(value)
    return out


def _sse_events(text: str) -> list:
    events = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


# ---------------------------------------------------------------------------------------------------- plain endpoints
def test_models_health_version(server, client):
    models = client.models.list().data
    assert len(models) == 1
    card = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert card["id"] == models[0].id and card["owned_by"] == "pagedllm" and card["max_model_len"] == 2048
    assert card["architecture"] == "LlamaForCausalLM"
    assert httpx.get(server.url + "/health").status_code == 200
    assert re.match(r"\d+\.\d+", httpx.get(server.url + "/version").json()["version"])


def test_tokenize_detokenize(server):
    r = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT, "return_token_strs": True}).json()
    assert r["count"] == len(r["tokens"]) == len(r["token_strs"]) and r["max_model_len"] == 2048
    d = httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}).json()
    assert d["prompt"].strip() == PROMPT
    chat = httpx.post(server.url + "/tokenize", json={"messages": CHAT}).json()
    assert chat["count"] > r["count"]  # the template adds turns
    bad = httpx.post(server.url + "/detokenize", json={"tokens": [10 ** 9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_model_root_path_is_an_alias(server, client, model):
    """The card's ``root`` (the model path the server was started with) names the model too, as in vLLM, where the
    served name defaults to that path: ``vllm bench serve`` sends it to /tokenize. Responses report the served name;
    another path is still a 404."""
    root = httpx.get(server.url + "/v1/models").json()["data"][0]["root"]
    assert root != model
    r = httpx.post(server.url + "/tokenize", json={"model": root, "prompt": PROMPT, "add_special_tokens": False})
    assert r.status_code == 200 and r.json()["count"] > 0
    c = client.completions.create(model=root, prompt=PROMPT, max_tokens=2, temperature=0)
    assert c.model == model and c.usage.completion_tokens == 2
    bad = httpx.post(server.url + "/tokenize", json={"model": root + ".other", "prompt": PROMPT})
    assert bad.status_code == 404 and bad.json()["error"]["param"] == "model"


# ---------------------------------------------------------------------------------------------------- completions
def test_completion_usage_and_finish_reason(server, client, model):
    n_prompt = _tokenize(server, prompt=PROMPT)
    for max_tokens in (1, 7):
        c = client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0)
        ch = c.choices[0]
        assert c.object == "text_completion" and c.id.startswith("cmpl-") and c.model == model
        assert c.usage.prompt_tokens == n_prompt
        assert c.usage.completion_tokens == max_tokens
        assert c.usage.total_tokens == n_prompt + max_tokens
        assert ch.finish_reason == "length" and ch.index == 0 and ch.text
    # A stop string ends it early: "stop", fewer tokens than max_tokens.
    c = client.completions.create(model=model, prompt="1, 2, 3, 4,", max_tokens=30, temperature=0, stop=["7"])
    assert c.choices[0].finish_reason == "stop" and c.usage.completion_tokens < 30
    assert "7" not in c.choices[0].text


def test_finish_reason_length_iff_max_tokens(client, model):
    for max_tokens in (3, 40, 200):
        c = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hi."}],
                                           max_completion_tokens=max_tokens, temperature=0)
        ch = c.choices[0]
        assert ch.finish_reason in ("stop", "length")
        assert (ch.finish_reason == "length") == (c.usage.completion_tokens == max_tokens), (ch, c.usage)


def _stream_completion(client, **kw):
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    return chunks


def test_completion_stream_equals_non_stream(client, model):
    kw = dict(model=model, prompt=PROMPT, max_tokens=16, temperature=0)
    full = client.completions.create(**kw)
    chunks = _stream_completion(client, **kw)
    assert len({c.id for c in chunks}) == 1
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert len(usage_chunks) == 1 and chunks[-1] is usage_chunks[0] and chunks[-1].choices == []
    assert usage_chunks[0].usage.prompt_tokens == full.usage.prompt_tokens
    assert usage_chunks[0].usage.completion_tokens == full.usage.completion_tokens
    text = "".join(ch.text for c in chunks for ch in c.choices)
    assert text == full.choices[0].text
    finishes = [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason]
    assert finishes == [full.choices[0].finish_reason]


def test_completion_prompt_forms(server, client, model):
    ids = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    by_text = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0)
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    multi = client.completions.create(model=model, prompt=[PROMPT, "Once upon a time"], max_tokens=4,
                                      temperature=0, n=2)
    assert [c.index for c in multi.choices] == [0, 1, 2, 3]
    assert multi.choices[0].text == multi.choices[1].text
    assert by_text.choices[0].text.startswith(multi.choices[0].text)
    n_prompt = len(ids) + _tokenize(server, prompt="Once upon a time")
    assert multi.usage.prompt_tokens == n_prompt and multi.usage.completion_tokens == 16
    lists = client.completions.create(model=model, prompt=[ids, ids[:3]], max_tokens=2, temperature=0)
    assert len(lists.choices) == 2 and lists.usage.prompt_tokens == len(ids) + 3


def test_completion_echo_and_logprobs(client, model):
    c = client.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == c.choices[0].text
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for tok, tlp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert tlp <= 0 and 3 <= len(top) <= 4 and top[tok] == tlp
        assert tlp == pytest.approx(max(top.values()), abs=1e-5)  # greedy picks the top token
    e = client.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=1, echo=True)
    ch = e.choices[0]
    assert ch.text == PROMPT + c.choices[0].text
    n_prompt = e.usage.prompt_tokens
    assert len(ch.logprobs.tokens) == n_prompt + 5
    assert ch.logprobs.token_logprobs[0] is None and all(v is not None for v in ch.logprobs.token_logprobs[1:])
    # vLLM's prompt_logprobs extra: one entry per prompt token, the first None.
    p = client.completions.create(model=model, prompt=PROMPT, max_tokens=1, temperature=0,
                                  extra_body={"prompt_logprobs": 2})
    plp = p.model_extra.get("prompt_logprobs") or p.choices[0].model_extra["prompt_logprobs"]
    assert len(plp) == n_prompt and plp[0] is None and all(len(d) >= 1 for d in plp[1:])


def test_completion_n_and_seed(client, model):
    kw = dict(model=model, prompt="My favourite food is", max_tokens=8, temperature=1.0, n=3, seed=1234)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    chunks = list(client.completions.create(stream=True, **kw))
    finishes = {}
    for c in chunks:
        for ch in c.choices:
            if ch.finish_reason:
                finishes[ch.index] = finishes.get(ch.index, 0) + 1
    assert finishes == {0: 1, 1: 1, 2: 1}


def test_cached_tokens_and_reset_prefix_cache(server, client, model):
    prompt = "Here is a long shared prefix about the history of computing. " * 6
    client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0)
    again = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= 32  # whole 16-token blocks of the prompt hit
    r = httpx.post(server.url + "/reset_prefix_cache")
    assert r.status_code == 200
    after = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0)
    assert after.usage.prompt_tokens_details.cached_tokens == 0


def test_cache_salt_isolates_prefix_cache(server, client, model):
    prompt = "Tenants must never share the cached blocks of this salted prefix text. " * 6

    def cached(salt=None):
        extra = {} if salt is None else {"cache_salt": salt}
        r = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0, extra_body=extra)
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-a") >= 32
    assert cached("tenant-b") == 0
    assert cached() == 0  # unsalted requests don't see salted blocks either
    msgs = [{"role": "user", "content": prompt}]
    chat = [client.chat.completions.create(model=model, messages=msgs, max_tokens=1, temperature=0,
                                           extra_body={"cache_salt": s}) for s in ("c", "c", "d")]
    assert [r.usage.prompt_tokens_details.cached_tokens > 0 for r in chat] == [False, True, False]
    r = httpx.post(server.url + "/v1/completions", json={"model": model, "prompt": "hi", "cache_salt": ""})
    assert r.status_code == 400 and "cache_salt" in r.text


# ---------------------------------------------------------------------------------------------------- chat
def test_chat_and_stream_equal(server, client, model):
    n_prompt = _tokenize(server, messages=CHAT)
    kw = dict(model=model, messages=CHAT, max_completion_tokens=20, temperature=0)
    full = client.chat.completions.create(**kw)
    ch = full.choices[0]
    assert full.object == "chat.completion" and full.id.startswith("chatcmpl-")
    assert ch.message.role == "assistant" and ch.message.content
    assert full.usage.prompt_tokens == n_prompt
    assert (ch.finish_reason == "length") == (full.usage.completion_tokens == 20)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert len({c.id for c in chunks}) == 1 and all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ch.message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [ch.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == n_prompt
    # max_tokens (deprecated name) works too
    old = client.chat.completions.create(model=model, messages=CHAT, max_tokens=20, temperature=0)
    assert old.choices[0].message.content == ch.message.content


def test_chat_turns_and_continue_final_message(server, client, model):
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Count to three."}]
    c = client.chat.completions.create(model=model, messages=msgs, max_completion_tokens=8, temperature=0)
    assert c.usage.prompt_tokens == _tokenize(server, messages=msgs)
    cont = [{"role": "user", "content": "Count to five."}, {"role": "assistant", "content": "1, 2,"}]
    c = client.chat.completions.create(model=model, messages=cont, max_completion_tokens=6, temperature=0,
                                       extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert c.usage.prompt_tokens == _tokenize(server, messages=cont, continue_final_message=True,
                                              add_generation_prompt=False)


def test_chat_logprobs(client, model):
    c = client.chat.completions.create(model=model, messages=CHAT, max_completion_tokens=6, temperature=0,
                                       logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 2 and item.logprob <= 0
        # greedy: the sampled token is a top one (bf16 logits tie often, so compare logprobs, not tokens)
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob, abs=1e-6)
        assert item.bytes == list(item.token.encode())
    chunks = list(client.chat.completions.create(model=model, messages=CHAT, max_completion_tokens=6,
                                                 temperature=0, logprobs=True, top_logprobs=2, stream=True))
    streamed = [x.token for c in chunks if c.choices and c.choices[0].logprobs
                for x in c.choices[0].logprobs.content]
    assert streamed == [x.token for x in content]


# ---------------------------------------------------------------------------------------------------- load
def test_32_concurrent_streams_match_solo_greedy(server, model):
    prompts = [f"Write one sentence about the number {i}." for i in range(32)]
    max_tokens = [6 + i % 7 for i in range(32)]

    solo = []
    with httpx.Client(base_url=server.url, timeout=300) as c:
        for p, m in zip(prompts, max_tokens):
            r = c.post("/v1/completions", json={"model": model, "prompt": p, "max_tokens": m, "temperature": 0})
            solo.append(r.json()["choices"][0]["text"])

    async def one(ac, p, m):
        text, finishes = "", []
        async with ac.stream("POST", "/v1/completions", json={"model": model, "prompt": p, "max_tokens": m,
                                                               "temperature": 0, "stream": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ch = json.loads(line[6:])["choices"][0]
                text += ch["text"]
                if ch["finish_reason"]:
                    finishes.append(ch["finish_reason"])
        return text, finishes

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=300,
                                     limits=httpx.Limits(max_connections=64)) as ac:
            return await asyncio.gather(*[one(ac, p, m) for p, m in zip(prompts, max_tokens)])

    results = asyncio.run(main())
    for i, ((text, finishes), ref) in enumerate(zip(results, solo)):
        assert len(finishes) == 1, (i, finishes)
        assert text == ref, (i, text, ref)
    m = _metrics(server)
    assert m["pagedllm:num_requests_running"] == 0


def test_greedy_alone_equals_among_8_concurrent_streams(server, model):
    """Batch invariance through the server (the default int4 model at this CPU's ISA level): one prompt's 48 greedy
    tokens alone, then streamed while 8 other streams of other lengths share its prefill and decode steps."""
    target = "Explain why the sky is blue."
    others = [f"List {i + 2} facts about the planet Mars." + " Be brief." * i for i in range(8)]
    body = {"model": model, "max_tokens": 48, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=server.url, timeout=300) as c:
        alone = c.post("/v1/completions", json={**body, "prompt": target}).json()["choices"][0]["text"]

    async def one(ac, prompt):
        text = ""
        async with ac.stream("POST", "/v1/completions", json={**body, "prompt": prompt, "stream": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text += json.loads(line[6:])["choices"][0]["text"]
        return text

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as ac:
            return await asyncio.gather(*[one(ac, p) for p in others[:4] + [target] + others[4:]])

    texts = asyncio.run(main())
    assert texts[4] == alone


# ---------------------------------------------------------------------------------------------------- disconnects
def _wait_idle(server, idle_kv: float, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = _metrics(server)
        if m["pagedllm:num_requests_running"] == 0 and m["pagedllm:num_requests_waiting"] == 0 and \
                m["pagedllm:kv_cache_usage_perc"] == idle_kv:
            return m
        if time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def test_stream_disconnect_aborts_and_frees_kv(server, model):
    idle = _metrics(server)
    assert idle["pagedllm:num_requests_running"] == 0
    idle_kv = idle["pagedllm:kv_cache_usage_perc"]
    aborts = idle.get("pagedllm:request_success_total{finished_reason=abort}", 0.0)
    t0 = time.monotonic()
    with httpx.Client(base_url=server.url, timeout=300) as c:
        with c.stream("POST", "/v1/completions", json={"model": model, "prompt": "Tell me a long story.",
                                                       "max_tokens": 1500, "ignore_eos": True, "stream": True}) as r:
            # Read until /metrics shows the request running (the engine thread sets the gauges before it hands a
            # step's outputs over, so the 4th event should do; a slow reader gets merged chunks), then hang up
            # mid-stream (the whole request runs for ~20 s here).
            events, busy = [], {}
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line)
                assert '"choices"' in line and line != "data: [DONE]", events[-3:]
                if len(events) >= 4:
                    busy = _metrics(server)
                    if busy["pagedllm:num_requests_running"] == 1 or len(events) >= 200:
                        break
            assert busy["pagedllm:num_requests_running"] == 1 and busy["pagedllm:kv_cache_usage_perc"] > idle_kv, \
                (len(events), round(time.monotonic() - t0, 2), busy)
    m = _wait_idle(server, idle_kv)
    assert m["pagedllm:num_requests_running"] == 0
    assert m["pagedllm:kv_cache_usage_perc"] == idle_kv
    assert m["pagedllm:request_success_total{finished_reason=abort}"] == aborts + 1


def test_non_stream_disconnect_aborts(server, model):
    idle_kv = _metrics(server)["pagedllm:kv_cache_usage_perc"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", timeout=1.5,
                   json={"model": model, "prompt": "Tell me a long story.", "max_tokens": 1500, "ignore_eos": True})
    m = _wait_idle(server, idle_kv)
    assert m["pagedllm:num_requests_running"] == 0 and m["pagedllm:kv_cache_usage_perc"] == idle_kv


# ---------------------------------------------------------------------------------------------------- errors
BAD_REQUESTS = [
    # (id, path, raw body or json, status, param)
    ("temperature", "/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("top_p", "/v1/completions", {"prompt": "hi", "top_p": 2}, 400, "top_p"),
    ("n0", "/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("max_tokens", "/v1/completions", {"prompt": "hi", "max_tokens": -5}, 400, "max_tokens"),
    ("unknown_model", "/v1/completions", {"prompt": "hi", "model": "no-such-model"}, 404, "model"),
    ("too_long", "/v1/completions", {"prompt": "hello " * 3000}, 400, "prompt"),
    ("too_long_with_output", "/v1/completions", {"prompt": "hello " * 2000, "max_tokens": 100}, 400, "max_tokens"),
    ("oov_token", "/v1/completions", {"prompt": [1, 2, 10 ** 7]}, 400, "prompt"),
    ("empty_prompt", "/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("empty_list", "/v1/completions", {"prompt": []}, 400, "prompt"),
    ("malformed_json", "/v1/completions", b'{"prompt": "hi",', 400, None),
    ("not_an_object", "/v1/completions", b"[1, 2, 3]", 400, None),
    ("wrong_type_max_tokens", "/v1/completions", {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ("wrong_type_prompt", "/v1/completions", {"prompt": {"a": 1}}, 400, "prompt"),
    ("missing_prompt", "/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("logprobs_over_max", "/v1/completions", {"prompt": "hi", "logprobs": 100}, 400, "logprobs"),
    ("stream_bad_temp", "/v1/completions", {"prompt": "hi", "temperature": -1, "stream": True}, 400, "temperature"),
    ("stream_options_without_stream", "/v1/completions",
     {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("chat_temperature", "/v1/chat/completions", {"messages": CHAT, "temperature": -1}, 400, "temperature"),
    ("chat_unknown_model", "/v1/chat/completions", {"messages": CHAT, "model": "gpt-9"}, 404, "model"),
    ("chat_empty_messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("chat_wrong_type", "/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
    ("chat_bad_role", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    ("chat_too_long", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * 3000}]}, 400,
     "messages"),
    ("chat_top_logprobs_without_logprobs", "/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400,
     "top_logprobs"),
    ("chat_n_wrong_type", "/v1/chat/completions", {"messages": CHAT, "n": "two"}, 400, "n"),
]


def _check_error(r: httpx.Response, status: int, param):
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["type"]
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.mark.parametrize("case", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_request_then_normal_request(server, model, case):
    _, path, body, status, param = case
    with httpx.Client(base_url=server.url, timeout=120) as c:
        if isinstance(body, bytes):
            r = c.post(path, content=body, headers={"content-type": "application/json"})
        else:
            r = c.post(path, json={"model": model, **body} if "model" not in body else body)
        err = _check_error(r, status, param)
        if case[0].startswith("too_long"):
            assert "2048" in err["message"] and re.search(r"\b(3001|2\d\d\d)\b", err["message"]), err
        ok = c.post("/v1/completions", json={"model": model, "prompt": "Hello", "max_tokens": 2, "temperature": 0})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_openai_client_sees_typed_errors(client, model):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="hi", temperature=-1)
    assert e.value.status_code == 400 and e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=CHAT)


def test_bad_requests_do_not_disturb_a_running_stream(server, model):
    body = {"model": model, "prompt": "The history of the printing press", "max_tokens": 24, "temperature": 0}
    ref = httpx.post(server.url + "/v1/completions", json=body, timeout=300).json()["choices"][0]["text"]

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as ac:
            async def stream():
                text = ""
                async with ac.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            text += json.loads(line[6:])["choices"][0]["text"]
                return text

            task = asyncio.create_task(stream())
            await asyncio.sleep(0.2)
            for _, path, bad, status, _ in BAD_REQUESTS:
                if isinstance(bad, bytes):
                    r = await ac.post(path, content=bad, headers={"content-type": "application/json"})
                else:
                    r = await ac.post(path, json=bad)
                assert r.status_code == status
            return await task

    assert asyncio.run(main()) == ref


# ---------------------------------------------------------------------------------------------------- metrics
def test_metrics_exposed(server, client, model):
    client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0)
    text = httpx.get(server.url + "/metrics").text
    for name in ("pagedllm:time_to_first_token_seconds_bucket", "pagedllm:inter_token_latency_seconds_bucket",
                 "pagedllm:e2e_request_latency_seconds_bucket", "pagedllm:prompt_tokens_total",
                 "pagedllm:generation_tokens_total", "pagedllm:num_requests_running",
                 "pagedllm:num_requests_waiting", "pagedllm:kv_cache_usage_perc",
                 "pagedllm:kv_cache_utilization_perc", "pagedllm:num_preemptions_total",
                 "pagedllm:prefix_cache_queries_total", "pagedllm:prefix_cache_hits_total",
                 'pagedllm:request_success_total{finished_reason="length"'):
        assert name in text, name
    m = _metrics(server)
    assert m["pagedllm:generation_tokens_total"] >= 4 and m["pagedllm:time_to_first_token_seconds_count"] >= 1
    assert m["pagedllm:prefix_cache_queries_total"] >= m["pagedllm:prefix_cache_hits_total"] > 0


# ---------------------------------------------------------------------------------------------------- conformance
def test_token_id_prompt_with_a_float_names_the_field(server, model):
    r = httpx.post(server.url + "/v1/completions", json={"model": model, "prompt": [1.5], "max_tokens": 1})
    err = _check_error(r, 400, "prompt")
    assert "prompt" in err["message"]


def test_continue_final_message_with_add_generation_prompt_is_400(server, model):
    msgs = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "1, 2,"}]
    r = httpx.post(server.url + "/v1/chat/completions", json={
        "model": model, "messages": msgs, "continue_final_message": True, "add_generation_prompt": True})
    _check_error(r, 400, "continue_final_message")


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": PROMPT}),
    ("/v1/chat/completions", {"messages": CHAT}),
])
def test_continuous_usage_stats_in_every_chunk(server, model, path, body):
    r = httpx.post(server.url + path, timeout=120, json={
        "model": model, **body, "max_tokens": 6, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    events = [e for e in _sse_events(r.text) if e != "[DONE]"]
    usages = [e["usage"] for e in events]
    assert all(u is not None for u in usages)
    prompt_tokens = usages[-1]["prompt_tokens"]
    assert prompt_tokens > 0 and all(u["prompt_tokens"] == prompt_tokens for u in usages)
    done = [u["completion_tokens"] for u in usages]
    assert done == sorted(done) and done[-1] == 6 and usages[-1]["total_tokens"] == prompt_tokens + 6


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stream_sends_a_chunk_for_a_token_that_completes_no_character(server, model, path):
    """Greedy SmolLM2 continues these emoji with byte tokens, three per emoji, the first two of which complete no
    character: each still gets its chunk (text ""), as in vLLM, so a client sees one chunk per token (vLLM's
    ``bench serve`` counts chunks as tokens for ITL). Before, such tokens went out merged into the next chunk. The
    text streamed is still the whole text."""
    prompt = "Emoji: \U0001F600\U0001F603\U0001F604\U0001F601"
    body = ({"prompt": prompt} if path == "/v1/completions"
            else {"messages": [{"role": "user", "content": prompt}]})
    req = {"model": model, **body, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    whole = httpx.post(server.url + path, json=req, timeout=120).json()["choices"][0]
    r = httpx.post(server.url + path, timeout=120, json={
        **req, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    events = [e for e in _sse_events(r.text) if e != "[DONE]" and e["choices"]]
    key = "text" if path == "/v1/completions" else "content"
    texts = [(e["choices"][0].get(key) if key == "text" else e["choices"][0]["delta"].get(key)) or "" for e in events]
    done = [e["usage"]["completion_tokens"] for e in events]
    stepped = [b - a for a, b in zip([0] + done, done) if b > a]  # chunks that carry new tokens
    assert sum(stepped) == 12
    assert "".join(texts) == (whole["text"] if key == "text" else whole["message"]["content"])
    assert "\ufffd" not in "".join(texts)
    empty = sum(1 for t, d, p in zip(texts, done, [0] + done) if not t and d > p)
    assert len(stepped) >= 9 and empty >= 4, (texts, done)  # merged (the old way): at most 4 text chunks + end


def test_stop_string_equal_to_hidden_special_token(server, model):
    """``<|im_end|>`` is hidden from the text by skip_special_tokens; as a stop string it still stops (ignore_eos
    keeps the end-of-turn token from ending the request on its own)."""
    body = {"model": model, "messages": CHAT, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    free = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=300).json()["choices"][0]
    assert free["finish_reason"] == "length"  # without the stop string the turn's end doesn't stop it
    r = httpx.post(server.url + "/v1/chat/completions", json={**body, "stop": ["<|im_end|>"]}, timeout=300)
    ch = r.json()["choices"][0]
    assert ch["finish_reason"] == "stop" and ch["stop_reason"] == "<|im_end|>", ch
    assert "<|im_end|>" not in ch["message"]["content"]
    assert free["message"]["content"].startswith(ch["message"]["content"])


def test_logprob_bytes_of_partial_utf8_tokens(server, model):
    """Each token of a character split over byte tokens reports its own bytes; together they are the character's
    UTF-8 encoding (not U+FFFD's bytes)."""
    emoji = "\U0001F44D"
    ids = httpx.post(server.url + "/tokenize", json={"prompt": emoji, "add_special_tokens": False}).json()["tokens"]
    assert len(ids) > 1  # the test needs a character split over tokens
    got = b""
    for tid in ids:
        r = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
            "model": model, "messages": CHAT, "max_tokens": 1, "allowed_token_ids": [tid], "logprobs": True})
        entry = r.json()["choices"][0]["logprobs"]["content"][0]
        got += bytes(entry["bytes"])
    assert got == emoji.encode("utf-8")


def test_return_tokens_as_token_ids(server, model):
    r = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 2,
        "return_tokens_as_token_ids": True}).json()
    toks = r["choices"][0]["logprobs"]["tokens"]
    assert len(toks) == 4 and all(re.fullmatch(r"token_id:\d+", t) for t in toks)
    ids = [int(t.split(":")[1]) for t in toks]
    text = httpx.post(server.url + "/detokenize", json={"tokens": ids}).json()["prompt"]
    assert text == r["choices"][0]["text"]
    assert all(re.fullmatch(r"token_id:\d+", k) for top in r["choices"][0]["logprobs"]["top_logprobs"] for k in top)
    c = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "model": model, "messages": CHAT, "max_tokens": 3, "temperature": 0, "logprobs": True, "top_logprobs": 1,
        "return_tokens_as_token_ids": True}).json()
    assert all(re.fullmatch(r"token_id:\d+", e["token"]) for e in c["choices"][0]["logprobs"]["content"])


def test_prompt_logprobs_with_n_one_entry_per_prompt_token(server, model):
    n_prompt = _tokenize(server, prompt=PROMPT)
    r = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "model": model, "prompt": PROMPT, "max_tokens": 2, "n": 3, "temperature": 1, "seed": 7,
        "prompt_logprobs": 1}).json()
    assert len(r["choices"]) == 3
    for ch in r["choices"]:
        assert len(ch["prompt_logprobs"]) == n_prompt and ch["prompt_logprobs"][0] is None
