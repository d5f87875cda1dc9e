"""bench serve's json-schema workload: which requests are constrained, the request bodies, the valid-output rate."""

from __future__ import annotations

import json

import pytest

from pagedllm.benchmarks.datasets import BenchRequest, load_json_schemas
from pagedllm.benchmarks.serve import RequestResult, _request_body, compute_metrics, mark_structured


def _reqs(n: int) -> list[BenchRequest]:
    items = load_json_schemas()
    return [BenchRequest(prompt=items[i % len(items)]["prompt"], prompt_token_ids=[1, 2], output_len=64,
                         messages=[{"role": "user", "content": items[i % len(items)]["prompt"]}],
                         extra={"schema": items[i % len(items)]["schema"]}) for i in range(n)]


def test_shipped_schemas_are_valid_schemas():
    import jsonschema

    items = load_json_schemas()
    assert len(items) >= 8
    for it in items:
        jsonschema.Draft202012Validator.check_schema(it["schema"])
        assert it["prompt"]


def test_ratio_and_bodies():
    reqs = _reqs(10)
    assert mark_structured(reqs, 0.3, seed=1) == 3
    constrained = [r for r in reqs if "constrain" in r.extra]
    assert len(constrained) == 3
    path, body = _request_body(constrained[0], "openai-chat", "m", ignore_eos=True, temperature=0.0,
                               use_token_ids=False)
    assert path == "/v1/chat/completions" and "ignore_eos" not in body
    assert body["response_format"]["json_schema"]["schema"] == constrained[0].extra["schema"]
    assert body["response_format"]["json_schema"]["strict"] is True
    path, body = _request_body(constrained[0], "openai", "m", ignore_eos=True, temperature=0.0, use_token_ids=False)
    assert path == "/v1/completions" and body["structured_outputs"] == {"json": constrained[0].extra["schema"]}
    plain = next(r for r in reqs if "constrain" not in r.extra)
    _, body = _request_body(plain, "openai-chat", "m", ignore_eos=True, temperature=0.0, use_token_ids=False)
    assert "response_format" not in body and body["ignore_eos"] is True
    assert mark_structured(reqs, 1.0, seed=1) == 10 and mark_structured(reqs, 0.0, seed=1) == 0


def test_valid_output_rate():
    schema = load_json_schemas()[0]["schema"]
    good = RequestResult(success=True, output_tokens=5, ttft=0.1, latency=0.5, schema=schema,
                         generated_text=json.dumps({"answer": 42, "reason": "six times seven"}))
    wrong_type = RequestResult(success=True, output_tokens=5, ttft=0.1, latency=0.5, schema=schema,
                               generated_text=json.dumps({"answer": "42", "reason": "x"}))
    cut = RequestResult(success=True, output_tokens=5, ttft=0.1, latency=0.5, schema=schema,
                        generated_text='{"answer": 42, "rea', finish_reason="length")
    plain = RequestResult(success=True, output_tokens=5, ttft=0.1, latency=0.5, generated_text="hello")
    m = compute_metrics([good, wrong_type, cut, plain], 1.0, max_concurrency=None, request_rate=float("inf"))
    assert m["structured_requests"] == 3 and m["valid_outputs"] == 1
    assert abs(m["valid_output_rate"] - 1 / 3) < 1e-9
    assert m["structured_cut_by_length"] == 1


def test_ttft_split_by_new_seen_and_unconstrained_schema():
    """The first request (by start time) of each schema counts as "new schema", later ones as "seen"."""
    a, b = load_json_schemas()[0]["schema"], load_json_schemas()[1]["schema"]
    rs = [RequestResult(success=True, output_tokens=3, ttft=t, latency=1.0, start_time=st, schema=sc,
                        generated_text="{}", itl=[t / 10, t / 5])
          for st, t, sc in ((0.0, 0.30, a), (0.1, 0.10, a), (0.2, 0.50, b), (0.3, 0.12, b), (0.4, 0.05, None))]
    m = compute_metrics(rs, 1.0, max_concurrency=None, request_rate=float("inf"))
    assert m["median_itl_ms_unconstrained"] == pytest.approx(7.5)  # the plain request's gaps: 5 and 10 ms
    assert m["median_itl_ms_new_schema"] == pytest.approx(55.0)  # 30, 60, 50, 100 ms
    assert (m["num_new_schema"], m["num_seen_schema"], m["num_unconstrained"]) == (2, 2, 1)
    assert abs(m["median_ttft_ms_new_schema"] - 400.0) < 1e-6 and abs(m["median_ttft_ms_seen_schema"] - 110.0) < 1e-6
    assert abs(m["median_ttft_ms_unconstrained"] - 50.0) < 1e-6
    assert m["request_kinds"] == ["new_schema", "seen_schema", "new_schema", "seen_schema", "unconstrained"]
    assert m["request_ttfts_ms"] == pytest.approx([300.0, 100.0, 500.0, 120.0, 50.0])


def test_fresh_tag_changes_the_schema_text_not_its_meaning():
    import jsonschema

    reqs = _reqs(4)
    mark_structured(reqs, 1.0, seed=1, fresh_tag="run-7")
    for r in reqs:
        c = r.extra["constrain"]
        assert c != r.extra["schema"] and c["$comment"] == "bench run-7"
        assert {k: v for k, v in c.items() if k != "$comment"} == r.extra["schema"]
        jsonschema.Draft202012Validator.check_schema(c)


def test_output_lens_from_an_earlier_result(tmp_path):
    from pagedllm.benchmarks.serve import apply_output_lens

    reqs = _reqs(3)
    f = tmp_path / "r.json"
    f.write_text(json.dumps({"levels": [{"request_output_tokens": [7, None, 12]}]}))
    apply_output_lens(reqs, str(f))
    assert [r.output_len for r in reqs] == [7, 64, 12]  # a request that failed there keeps its own
    with pytest.raises(ValueError, match="request_output_tokens"):
        apply_output_lens(_reqs(4), str(f))
