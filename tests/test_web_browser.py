"""The playground and the dashboard in a real browser: Playwright driving headless Chromium (Debian's ``chromium``
package, since Playwright can't download its own browser here; ``make test`` installs it with apt-get when root).

Against the real ``pagedllm serve`` on SmolLM2 (the session server of conftest.py): a message streams and finishes
with the same text the API gives; Stop ends the request on the server (running count back to 0); the dashboard's
charts move while a bounded bench load runs; HTML in model output stays text. Against the fake engine of
test_async_llm.py in an in-process server with ``--api-key``: the pages ask for the key once, and a refused
``response_format`` shows the server's 400 message. With ``--update-screenshots`` (``make screenshots``) the run
writes docs/playground.png and docs/dashboard.png (the README's screenshots); otherwise into a temp dir.

Skips (with the reason) only where the browser can't be started: no playwright package or no chromium.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time

import httpx
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs")
VIEWPORT = {"width": 1280, "height": 800}
XSS_PAYLOAD = '<img src=x onerror="window.__xss=1">'
# Generous waits for anything the model computes (a shared 2-core machine can be 10x slower than idle); the work
# itself is kept small (a few dozen tokens per test).
GEN_TIMEOUT_MS = 240_000


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as e:  # pragma: no cover - the test extra installs it
        pytest.skip(f"playwright is not installed ({e}); pip install playwright")
    exe = CHROMIUM if os.access(CHROMIUM, os.X_OK) else shutil.which("chromium")
    if exe is None:
        pytest.skip(f"no Chromium at {CHROMIUM} (Debian: apt-get install chromium; `make test` does it as root)")
    with sync_playwright() as p:
        try:
            b = p.chromium.launch(executable_path=exe, args=CHROMIUM_ARGS)
        except Exception as e:  # noqa: BLE001 - a browser that can't start is a skip, with the reason
            pytest.skip(f"Chromium at {exe} doesn't start under Playwright: {e}")
        yield b
        b.close()


@pytest.fixture()
def page(browser):
    """A fresh context (empty localStorage) with console errors and page errors collected in ``page.errors``."""
    ctx = browser.new_context(viewport=VIEWPORT)
    pg = ctx.new_page()
    pg.errors = []
    pg.on("pageerror", lambda e: pg.errors.append(f"pageerror: {e}"))
    pg.on("console", lambda m: pg.errors.append(f"console: {m.text}") if m.type == "error" else None)
    yield pg
    ctx.close()


@pytest.fixture(scope="module")
def server(pagedllm_server):
    return pagedllm_server


def _stats(url: str, **kw) -> dict:
    r = httpx.get(url + "/stats", timeout=10, **kw)
    assert r.status_code == 200, r.text
    return r.json()


def _wait(cond, timeout: float, what: str, step: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(step)


@pytest.fixture(scope="module")
def shot_dir(request, tmp_path_factory) -> str:
    """docs/ with ``--update-screenshots`` (``make screenshots``), else a temp dir: a plain run leaves the tree clean."""
    return DOCS if request.config.getoption("--update-screenshots") else str(tmp_path_factory.mktemp("screenshots"))


def _screenshot(pg, out_dir: str, name: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    pg.screenshot(path=path)
    assert os.path.getsize(path) > 1000, path  # a real PNG of the page, not an empty file


def _open_playground(pg, url: str) -> None:
    pg.goto(url + "/ui")
    pg.wait_for_selector("body[data-ready=true]", timeout=15000)


def _last_assistant(pg):
    return pg.locator(".msg.assistant").last


def _stored_conversations(pg) -> list:
    return json.loads(pg.evaluate("localStorage.getItem('pagedllm.conversations')") or "[]")


# ---------------------------------------------------------------------------------------------------- real server
def test_message_streams_and_finishes_with_the_api_text(page, server, shot_dir):
    model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
    question = "Name three colors."
    _open_playground(page, server.url)
    assert page.locator("#model").input_value() == model
    page.fill("#temperature", "0")
    page.fill("#max_tokens", "16")
    page.fill("#input", question)
    page.press("#input", "Enter")
    msg = _last_assistant(page)
    # Streamed text appears while the request is still running...
    page.wait_for_function(
        "() => { const m = [...document.querySelectorAll('.msg.assistant')].pop();"
        " return m && m.dataset.state === 'streaming' && m.querySelector('.bubble').textContent.length > 0; }",
        timeout=GEN_TIMEOUT_MS)
    partial = msg.locator(".bubble").text_content()
    # ...and then it finishes, with the stats line.
    page.wait_for_selector(".msg.assistant[data-state=done]", timeout=GEN_TIMEOUT_MS)
    final = msg.locator(".bubble").text_content()
    assert final and len(final) >= len(partial) > 0
    meta = msg.locator(".meta .stats").text_content()
    assert "TTFT" in meta and "tok/s" in meta and "completion tokens" in meta, meta
    conv = _stored_conversations(page)[0]
    stored = conv["messages"][1]
    assert conv["messages"][0] == {"role": "user", "content": question}
    # The conversation's text is what the API answers to the same request (greedy; float32 server).
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                   json={"model": model, "messages": [{"role": "user", "content": question}], "temperature": 0,
                         "max_tokens": 16})
    body = r.json()
    assert stored["content"] == body["choices"][0]["message"]["content"]
    assert stored["meta"]["completion_tokens"] == body["usage"]["completion_tokens"] <= 16
    assert stored["meta"]["prompt_tokens"] == body["usage"]["prompt_tokens"]
    assert f"{body['usage']['prompt_tokens']} prompt + {body['usage']['completion_tokens']} completion tokens" in meta
    assert stored["meta"]["ttft_ms"] > 0 and stored["meta"]["tok_s"] > 0
    # Regenerate (greedy: the same text again), then the conversation survives a reload.
    msg.locator("button.regenerate").click()
    page.wait_for_selector(".msg.assistant[data-state=streaming]", timeout=GEN_TIMEOUT_MS)
    page.wait_for_selector(".msg.assistant[data-state=done]", timeout=GEN_TIMEOUT_MS)
    assert _stored_conversations(page)[0]["messages"][1]["content"] == stored["content"]
    assert page.locator(".msg").count() == 2
    page.reload()
    page.wait_for_selector("body[data-ready=true]")
    assert page.locator(".msg.user .bubble").text_content() == question
    assert page.locator("#conv-list li").count() == 1
    assert page.locator("#temperature").input_value() == "0"  # settings kept too
    assert not page.errors, page.errors
    _screenshot(page, shot_dir, "playground.png")


def test_stop_mid_stream_ends_the_request_on_the_server(page, server):
    before = _stats(server.url)["totals"]["request_success"].get("abort", 0)
    _open_playground(page, server.url)
    page.fill("#temperature", "0")
    page.fill("#max_tokens", "1500")
    page.fill("#extra_body", '{"ignore_eos": true}')
    page.fill("#input", "Count from one to one thousand.")
    page.press("#input", "Enter")
    page.wait_for_function(
        "() => { const m = [...document.querySelectorAll('.msg.assistant')].pop();"
        " return m && m.dataset.state === 'streaming' && m.querySelector('.bubble').textContent.length > 20; }",
        timeout=GEN_TIMEOUT_MS)
    assert _stats(server.url)["current"]["num_requests_running"] == 1
    page.click("#stop")
    page.wait_for_selector(".msg.assistant[data-state=stopped]", timeout=10000)
    stopped_text = _stored_conversations(page)[0]["messages"][1]["content"]

    def idle():
        s = _stats(server.url)
        return s["current"]["num_requests_running"] == 0 and s["num_requests_in_flight"] == 0 and s

    s = _wait(idle, 15, "the server's running count to return to 0")
    assert s["totals"]["request_success"].get("abort", 0) == before + 1
    time.sleep(0.5)
    assert _stored_conversations(page)[0]["messages"][1]["content"] == stopped_text  # nothing arrives after Stop
    meta = _last_assistant(page).locator(".meta .stats").text_content()
    assert "stopped" in meta and "TTFT" in meta
    assert page.locator("#send").is_visible() and not page.locator("#stop").is_visible()
    assert not page.errors, page.errors


NUM_LOAD = 4  # requests of the bench load, all at once


def _bench_load(url: str, n: int, out_len: int) -> dict:
    import asyncio

    from pagedllm.benchmarks.datasets import BenchRequest
    from pagedllm.benchmarks.serve import run_level

    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    reqs = [BenchRequest(prompt=f"Tell me a story about the number {i}.", prompt_token_ids=[0] * 10,
                         output_len=out_len) for i in range(n)]
    return asyncio.run(run_level(url, reqs, backend="openai", model=model, max_concurrency=4,
                                 request_rate=float("inf"), ignore_eos=True, use_token_ids=False, num_warmups=0,
                                 timeout_s=GEN_TIMEOUT_MS / 1000))


def test_dashboard_charts_update_while_a_bench_load_runs(page, server, shot_dir):
    page.set_viewport_size({"width": 1280, "height": 1420})  # every chart and the config in the screenshot
    page.goto(server.url + "/dashboard")
    page.wait_for_function("() => Number(document.body.dataset.polls || 0) >= 2", timeout=15000)
    cfg = {r.locator("td").first.text_content(): r.locator("td").last.text_content()
           for r in page.locator("#config tr").all()}
    stats = _stats(server.url)
    assert cfg["model"] == stats["config"]["served_model_name"] and cfg["dtype"] == "float32"
    assert cfg["max_num_seqs"] == str(stats["config"]["max_num_seqs"])
    assert cfg["long_prefill_token_threshold"] == "off" and stats["config"]["long_prefill_token_threshold"] == 0
    assert str(stats["config"]["num_kv_blocks"]) in cfg["KV blocks"]

    def last(chart: str) -> dict:
        return json.loads(page.locator(f"#chart-{chart}").get_attribute("data-last") or "{}")

    # Idle first (earlier tests' tokens are in the history, so wait for a zero point at "now").
    _wait(lambda: last("throughput").get("generation_tokens_per_s") == 0, 20, "an idle point on the chart")
    finished_before = stats["totals"]["request_success"]
    # The load runs in waves of NUM_LOAD requests until every chart has shown it (a fast machine finishes one wave
    # between two samples; a slow one needs a single wave), then stops after the current wave.
    waves, errors, stop_load = [], [], threading.Event()

    def run_load():
        try:
            while True:
                waves.append(_bench_load(server.url, n=NUM_LOAD, out_len=16))
                if stop_load.is_set() or len(waves) >= 20:
                    return
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(repr(e))

    load = threading.Thread(target=run_load)
    load.start()
    seen = {}

    def moved() -> bool:  # each chart shows the load at some poll
        for chart, key in (("throughput", "generation_tokens_per_s"), ("requests", "num_requests_running"),
                           ("kv", "kv_cache_usage_perc")):
            if (last(chart).get(key) or 0) > 0:
                seen[chart] = True
        return len(seen) == 3 or not load.is_alive()

    try:
        _wait(moved, GEN_TIMEOUT_MS / 1000, "the throughput, requests and KV charts to rise", step=0.2)
        assert len(seen) == 3, (seen, [w["completed"] for w in waves], errors)
        _screenshot(page, shot_dir, "dashboard.png")
    finally:
        stop_load.set()
        load.join(GEN_TIMEOUT_MS / 1000)
    assert not errors and waves and all(w["completed"] == NUM_LOAD for w in waves), \
        (errors, [(w["completed"], w["errors"]) for w in waves])
    assert int(page.locator("#chart-throughput").get_attribute("data-points")) > 0
    # The ITL chart has points, and the tiles count the finished requests.
    _wait(lambda: (last("itl").get("itl_p50_s") or 0) > 0, 10, "an ITL P50 point")
    n_before = sum(finished_before.values())
    _wait(lambda: int(page.locator("#tile-finished").text_content().replace(",", "")) >=
          n_before + NUM_LOAD * len(waves), 10,
          "the finished-requests tile to count the load")
    assert not page.errors, page.errors


def test_html_in_model_output_renders_as_text(browser, server):
    """A canned stream (the real page code, the server's wire format) whose deltas carry HTML and script payloads,
    cut mid-tag across chunks; the page's CSP is bypassed so only the renderer stands between them and the DOM. The
    same payload as the user's message goes to the real server."""
    ctx = browser.new_context(viewport=VIEWPORT, bypass_csp=True)
    pg = ctx.new_page()
    errors = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    text = (f"Here: {XSS_PAYLOAD} and <script>window.__xss=2</script>\n\n"
            "**bold <b>not bold</b>** and [a link](javascript:window.__xss=3) and ![pic](https://x.invalid/a.png)\n\n"
            "<svg onload=\"window.__xss=4\"></svg><iframe src=\"javascript:window.__xss=5\"></iframe>\n\n"
            "| a | b |\n|---|---|\n| <img src=y onerror=window.__xss=6> | `<i>c</i>` |\n\n"
            "```html\n<img src=z onerror=\"window.__xss=7\">\n```\n- item <u>one</u>\n- [ok](https://example.invalid/)")
    pieces = [text[i:i + 7] for i in range(0, len(text), 7)]
    chunks = [{"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
               "choices": [{"index": 0, "delta": {"role": "assistant", "content": p}, "finish_reason": None}]}
              for p in pieces]
    chunks.append({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
                   "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    chunks.append({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [],
                   "usage": {"prompt_tokens": 5, "completion_tokens": len(pieces), "total_tokens": 5 + len(pieces)}})
    sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    sent = []

    def canned(route):
        sent.append(json.loads(route.request.post_data))
        route.fulfill(status=200, headers={"Content-Type": "text/event-stream"}, body=sse)

    try:
        _open_playground(pg, server.url)
        pg.route("**/v1/chat/completions", canned)
        pg.fill("#input", XSS_PAYLOAD)
        pg.press("#input", "Enter")
        pg.wait_for_selector(".msg.assistant[data-state=done]", timeout=15000)
        assert sent and sent[0]["messages"][-1]["content"] == XSS_PAYLOAD
        assert sent[0]["stream"] is True and sent[0]["stream_options"] == {"include_usage": True}
        box = pg.locator("#messages")
        for tag in ("img", "script", "svg", "iframe", "b", "u", "i"):
            assert box.locator(tag).count() == 0, tag
        assert pg.evaluate("() => [...document.querySelectorAll('#messages *')].flatMap(e => [...e.attributes])"
                           ".filter(a => a.name.startsWith('on')).length") == 0
        hrefs = pg.evaluate("() => [...document.querySelectorAll('#messages a')].map(a => a.getAttribute('href'))")
        assert hrefs == ["https://x.invalid/a.png", "https://example.invalid/"], hrefs
        bubble = pg.locator(".msg.assistant .bubble").text_content()
        for literal in (XSS_PAYLOAD, "<script>window.__xss=2</script>", "[a link](javascript:window.__xss=3)",
                        "<img src=y onerror=window.__xss=6>", '<img src=z onerror="window.__xss=7">'):
            assert literal in bubble, literal
        assert pg.locator(".msg.user .bubble").text_content() == XSS_PAYLOAD
        # Markdown still renders: bold, a table, inline and fenced code, a list.
        assert pg.locator(".msg.assistant strong").first.text_content() == "bold <b>not bold</b>"
        assert pg.locator(".msg.assistant table td code").text_content() == "<i>c</i>"
        assert pg.locator(".msg.assistant pre code").text_content() == '<img src=z onerror="window.__xss=7">'
        assert pg.locator(".msg.assistant li").count() == 2
        # The real server, with the payload as the user's message: whatever the model answers is text too.
        pg.unroute("**/v1/chat/completions")
        pg.fill("#max_tokens", "12")
        pg.fill("#input", f"Repeat exactly: {XSS_PAYLOAD}")
        pg.press("#input", "Enter")
        pg.wait_for_function("() => document.querySelectorAll('.msg.assistant[data-state=done]').length === 2",
                             timeout=GEN_TIMEOUT_MS)
        for tag in ("img", "script", "svg", "iframe"):
            assert box.locator(tag).count() == 0, tag
        time.sleep(0.3)  # give any handler that slipped through a moment to fire
        assert pg.evaluate("() => window.__xss") is None
        assert not errors, errors
    finally:
        ctx.close()


# ---------------------------------------------------------------------------------------------------- --api-key
@pytest.fixture(scope="module")
def keyed_server():
    """The fake engine behind build_app(api_key=...) in an in-process uvicorn on a free loopback port."""
    import uvicorn
    from conftest import free_port
    from test_async_llm import FakeEngine

    from pagedllm.engine.async_llm import AsyncLLM
    from pagedllm.entrypoints.openai.api_server import build_app

    llm = AsyncLLM(FakeEngine(step_s=0.005))
    app = build_app(llm, api_key="sekret")
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False))
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    url = f"http://127.0.0.1:{port}"
    _wait(lambda: srv.started, 20, "the in-process server")
    yield url
    srv.should_exit = True
    t.join(20)


def test_pages_ask_for_the_api_key_once(page, keyed_server):
    url = keyed_server
    assert httpx.get(url + "/stats").status_code == 401
    page.goto(url + "/ui")
    page.wait_for_selector("#api-key-dialog", timeout=10000)
    page.fill("#api-key-input", "wrong")
    page.click("#api-key-save")
    # Refused: asked again.
    page.wait_for_selector("#api-key-dialog", timeout=10000)
    assert "refused" in page.locator("#api-key-dialog").text_content()
    page.fill("#api-key-input", "sekret")
    page.click("#api-key-save")
    page.wait_for_selector("body[data-ready=true]", timeout=10000)
    assert page.locator("#model").input_value() == "fake"
    assert page.evaluate("localStorage.getItem('pagedllm.apiKey')") == "sekret"
    page.fill("#max_tokens", "6")
    page.fill("#input", "hello")
    page.press("#input", "Enter")
    page.wait_for_selector(".msg.assistant[data-state=done]", timeout=20000)
    assert "6 completion tokens" in _last_assistant(page).locator(".meta").text_content()
    # Kept: the dashboard (same browser) reads /stats with it, without asking.
    page.goto(url + "/dashboard")
    page.wait_for_function("() => Number(document.body.dataset.polls || 0) >= 1", timeout=15000)
    assert page.locator("#api-key-dialog").count() == 0
    assert page.locator("#config tr[data-key=model] td").last.text_content() == "fake"
    # Forgotten: the dashboard asks; cancelling leaves it waiting, saying why.
    page.evaluate("localStorage.removeItem('pagedllm.apiKey')")
    page.reload()
    page.wait_for_selector("#api-key-dialog", timeout=10000)
    page.click("#api-key-cancel")
    page.wait_for_function("() => document.getElementById('status').textContent.includes('API key')", timeout=10000)
    assert not [e for e in page.errors if "401" not in e], page.errors


def test_json_schema_box_sends_response_format_and_shows_a_refusal(page, keyed_server):
    url = keyed_server
    page.add_init_script("localStorage.setItem('pagedllm.apiKey', 'sekret')")
    page.goto(url + "/ui")
    page.wait_for_selector("body[data-ready=true]", timeout=10000)
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    page.fill("#json_schema", "{not json")
    assert "not valid JSON" in page.locator("#settings-error").text_content()
    page.fill("#json_schema", json.dumps(schema))
    assert page.locator("#settings-error").text_content() == ""
    page.fill("#max_tokens", "8")
    page.fill("#stop_strings", "END\\n\nfoo")
    page.fill("#seed", "7")
    sent = []
    page.on("request", lambda r: sent.append(json.loads(r.post_data)) if r.url.endswith("/v1/chat/completions")
            else None)
    page.fill("#input", "Give me a name.")
    page.press("#input", "Enter")
    page.wait_for_selector(".msg.assistant[data-state=done], .msg.assistant[data-state=error]", timeout=20000)
    assert sent[0]["response_format"] == {"type": "json_schema",
                                          "json_schema": {"name": "response", "schema": schema, "strict": True}}
    assert sent[0]["stop"] == ["END\n", "foo"] and sent[0]["seed"] == 7 and sent[0]["max_tokens"] == 8
    r = httpx.post(url + "/v1/chat/completions", headers={"Authorization": "Bearer sekret"},
                   json={k: v for k, v in sent[0].items() if k not in ("stream", "stream_options")})
    msg = _last_assistant(page)
    if r.status_code == 400:  # structured outputs refused by this server: its message is shown
        assert msg.get_attribute("data-state") == "error"
        assert r.json()["error"]["message"] in msg.locator(".error").text_content()
    else:  # accepted (this fake engine doesn't constrain; the real path is tests/test_structured_outputs_server.py)
        assert r.status_code == 200, r.text
        assert msg.get_attribute("data-state") == "done"
        assert msg.locator(".bubble").text_content()


MARKDOWN_CASES = [
    # (markdown, the rendered tree as tag(children) with text in quotes)
    ("# Title\nplain *em* **strong** ~~del~~ `code`",
     'h1("Title") p("plain " em("em") " " strong("strong") " " del("del") " " code("code"))'),
    ("a_snake_case_name and _em_", 'p("a_snake_case_name and " em("em"))'),
    ("line one\nline two\n\nnext", 'p("line one" br() "line two") p("next")'),
    ("- a\n- b\n  - c\n- d", 'ul(li("a") li("b" ul(li("c"))) li("d"))'),
    ("3. x\n4. y", 'ol(li("x") li("y"))'),
    ("```py\nx = 1\n```", 'div(div(span("py") button("Copy")) pre(code("x = 1")))'),
    ("```\nunclosed <b>", 'div(div(span("code") button("Copy")) pre(code("unclosed <b>")))'),
    ("> quoted\n> more", 'blockquote(p("quoted" br() "more"))'),
    ("| a | b |\n|:--|--:|\n| 1 | 2 |", 'table(thead(tr(th("a") th("b"))) tbody(tr(td("1") td("2"))))'),
    ("[x](https://a.invalid/p?q=1) [y](javascript:alert(1)) https://b.invalid/z.",
     'p(a("x") " [y](javascript:alert(1)) " a("https://b.invalid/z") ".")'),
    ("\\*not em\\* <i>raw</i>", 'p("*not em* <i>raw</i>")'),
    ("---", "hr()"),
]


def test_markdown_renderer_cases(page, keyed_server):
    """The renderer module on its own, in the page's origin: the DOM tree it builds for each case."""
    page.goto(keyed_server + "/ui/static/style.css")  # any same-origin document lets the module be imported
    trees = page.evaluate("""async (cases) => {
        const { renderMarkdown } = await import('/ui/static/markdown.js');
        const tree = (n) => n.nodeType === 3 ? JSON.stringify(n.data)
            : n.tagName.toLowerCase() + '(' + [...n.childNodes].map(tree).join(' ') + ')';
        return cases.map((md) => [...renderMarkdown(md).childNodes].map(tree).join(' '));
    }""", [md for md, _ in MARKDOWN_CASES])
    for (md, want), got in zip(MARKDOWN_CASES, trees):
        assert got == want, (md, got)
