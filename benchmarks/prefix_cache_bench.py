"""Prefix caching and KV memory efficiency, offline through ``LLM`` (one model load; the caching-off engine is a
variant on the same weights).

(a) TTFT: a shared ``--system-tokens`` system prompt + ``--num-questions`` distinct questions, all submitted at once,
    caching on vs off: mean time to first token per request (``metrics.first_token_time - arrival_time``) and the
    total prefill time (last first token - first arrival).
(b) Throughput on fully random prompts, caching on vs off (nothing to hit: the cost of hashing). Runs alternate
    off/on ``--repeats`` times; the best of each is compared. The scheduler + KV manager time per run is reported too:
    on a busy machine wall-clock noise swamps a few percent, the core's own time does not.
(c) KV utilization (share of slots in held blocks that hold a computed token) under a steady mixed workload:
    ``--mixed-concurrency`` requests in flight, prompts 32-768 tokens, outputs 16-256 tokens, sampled every step
    after a warm-up.

    nice -n 10 python benchmarks/prefix_cache_bench.py                   # bf16 ("auto"), bundled SmolLM2
    python benchmarks/prefix_cache_bench.py --only a --num-questions 16  # a quick look
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from pagedllm.entrypoints.llm import LLM
from pagedllm.sampling_params import SamplingParams

WORDS = ("the of and to in is was that for on with as by at from his her they this which be are have had one an "
         "not but all were when we there can more if out so what up its about into than them only other new some "
         "time could these two may first then do any like my now over such our man me even most made after also "
         "did many before must through back years where much your way well down should because each just those "
         "people how too little state good very make world still own see men work long get here between both life "
         "river mountain city garden history music science engine window market summer winter story paper").split()


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def timed_core(llm: LLM) -> list[float]:
    """Wraps the scheduler's schedule/update_from_output of this engine with a timer; returns the accumulator."""
    sched = llm.llm_engine.engine_core.scheduler
    acc = [0.0]
    for name in ("schedule", "update_from_output"):
        fn = getattr(sched, name)

        def wrapped(*a, _fn=fn, **kw):
            t = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                acc[0] += time.perf_counter() - t

        setattr(sched, name, wrapped)
    return acc


def bench_ttft(llm_on: LLM, llm_off: LLM, args) -> dict:
    tok = llm_on.get_tokenizer()
    rng = random.Random(1)
    sys_ids = tok.encode("You are a helpful assistant. Here is the background you must use:\n" + words(rng, 1500))
    sys_ids = sys_ids[:args.system_tokens]
    prompts = []
    for i in range(args.num_questions):
        q = tok.encode(f"\nQuestion {i}: {words(rng, 12)}?\nAnswer:", add_special_tokens=False)
        prompts.append({"prompt_token_ids": sys_ids + q})
    sp = SamplingParams(temperature=0.0, max_tokens=args.ttft_max_tokens, ignore_eos=True)
    res = {}
    for name, llm in (("off", llm_off), ("on", llm_on)):
        llm.reset_prefix_cache()
        eng = llm.llm_engine.engine_core
        eng.make_stats()  # clear the prefix-cache counters
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        wall = time.perf_counter() - t0
        ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
        stats = eng.make_stats()
        res[name] = dict(
            mean_ttft=statistics.mean(ttft), p50_ttft=statistics.median(ttft),
            prefill=max(o.metrics.first_token_time for o in outs) - min(o.metrics.arrival_time for o in outs),
            wall=wall, hit_rate=stats.prefix_cache_hits / max(stats.prefix_cache_queries, 1),
            cached=sum(o.num_cached_tokens for o in outs), prompt_tokens=sum(len(o.prompt_token_ids) for o in outs))
    return res


def bench_throughput(llm_on: LLM, llm_off: LLM, args) -> dict:
    rng = random.Random(2)
    vocab = llm_on.llm_engine.config.model.vocab_size
    prompts = [{"prompt_token_ids": [rng.randrange(100, vocab - 100) for _ in range(args.random_len)]}
               for _ in range(args.random_prompts)]
    sp = SamplingParams(temperature=0.0, max_tokens=args.random_out, ignore_eos=True)
    n_tokens = args.random_prompts * (args.random_len + args.random_out)
    core_acc = {"off": timed_core(llm_off), "on": timed_core(llm_on)}
    runs: dict[str, list[tuple[float, float, float]]] = {"off": [], "on": []}
    for _ in range(args.repeats):
        for name, llm in (("off", llm_off), ("on", llm_on)):
            llm.reset_prefix_cache()
            core_acc[name][0] = 0.0
            c0, t0 = time.process_time(), time.perf_counter()
            llm.generate(prompts, sp, use_tqdm=False)
            runs[name].append((time.perf_counter() - t0, time.process_time() - c0, core_acc[name][0]))
    out = {}
    for name, rs in runs.items():
        best = min(rs)
        out[name] = dict(tok_s=n_tokens / best[0], cpu=min(r[1] for r in rs), core=min(r[2] for r in rs),
                         walls=[r[0] for r in rs])
    return out


def bench_utilization(llm: LLM, args) -> dict:
    rng = random.Random(3)
    eng = llm.llm_engine
    vocab = eng.config.model.vocab_size
    sched = eng.engine_core.scheduler
    counter = 0

    def add():
        nonlocal counter
        counter += 1
        prompt = [rng.randrange(100, vocab - 100) for _ in range(rng.randint(32, 768))]
        sp = SamplingParams(temperature=0.0, max_tokens=rng.randint(16, 256), ignore_eos=True)
        eng.add_request(f"mix{counter}", {"prompt_token_ids": prompt}, sp)

    util, usage = [], []
    for _ in range(args.mixed_concurrency):
        add()
    for i in range(args.mixed_warmup + args.mixed_steps):
        eng.step()
        while eng.get_num_unfinished_requests() < args.mixed_concurrency:
            add()
        if i >= args.mixed_warmup:
            util.append(sched.kv_cache_utilization())
            usage.append(sched.kv.usage)
    for rid in list(eng.output_processor.parents):
        eng.abort_request(rid)
    return dict(mean=statistics.mean(util), min=min(util), max=max(util), usage=statistics.mean(usage),
                steps=len(util))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=2 << 30)
    p.add_argument("--only", default="abc", help="which parts to run, e.g. 'ab'")
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--num-questions", type=int, default=64)
    p.add_argument("--ttft-max-tokens", type=int, default=4)
    p.add_argument("--random-prompts", type=int, default=32)
    p.add_argument("--random-len", type=int, default=512)
    p.add_argument("--random-out", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--mixed-concurrency", type=int, default=32)
    p.add_argument("--mixed-warmup", type=int, default=40)
    p.add_argument("--mixed-steps", type=int, default=160)
    args = p.parse_args()

    llm_on = LLM(args.model, dtype=args.dtype, max_model_len=2048, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                 max_num_seqs=256)
    llm_off = llm_on.with_engine_args(enable_prefix_caching=False)
    warm = [{"prompt_token_ids": list(range(1000, 1100))}] * 2
    for llm in (llm_on, llm_off):  # first-use costs (kernel build, allocator) out of the figures
        llm.generate(warm, SamplingParams(max_tokens=4), use_tqdm=False)
    mc = llm_on.llm_engine.config
    print(f"model {mc.model.served_model_name}, dtype {mc.model.dtype}, block_size {mc.cache.block_size}, "
          f"max_num_batched_tokens {mc.scheduler.max_num_batched_tokens}")

    if "a" in args.only:
        r = bench_ttft(llm_on, llm_off, args)
        off, on = r["off"], r["on"]
        print(f"\n(a) shared {args.system_tokens}-token system prompt + {args.num_questions} distinct questions, "
              f"max_tokens {args.ttft_max_tokens}, all submitted at once")
        print(f"{'':28}{'caching off':>14}{'caching on':>14}{'off / on':>10}")
        for key, label in (("mean_ttft", "mean TTFT (s)"), ("p50_ttft", "median TTFT (s)"),
                           ("prefill", "total prefill (s)"), ("wall", "wall (s)")):
            print(f"{label:28}{off[key]:14.3f}{on[key]:14.3f}{off[key] / on[key]:10.2f}")
        print(f"{'prefix hit rate (tokens)':28}{off['hit_rate']:14.1%}{on['hit_rate']:14.1%}")
        print(f"{'cached prompt tokens':28}{off['cached']:14d}{on['cached']:14d}   of {on['prompt_tokens']}")

    if "b" in args.only:
        r = bench_throughput(llm_on, llm_off, args)
        off, on = r["off"], r["on"]
        print(f"\n(b) {args.random_prompts} random prompts x {args.random_len} tokens, {args.random_out} output tokens "
              f"(best of {args.repeats})")
        print(f"{'':28}{'caching off':>14}{'caching on':>14}{'on / off':>10}")
        print(f"{'throughput (tok/s)':28}{off['tok_s']:14.1f}{on['tok_s']:14.1f}{on['tok_s'] / off['tok_s']:10.3f}")
        print(f"{'process CPU time (s)':28}{off['cpu']:14.2f}{on['cpu']:14.2f}{on['cpu'] / off['cpu']:10.3f}")
        print(f"{'scheduler+KV manager (s)':28}{off['core']:14.4f}{on['core']:14.4f}")
        wall_on = min(on["walls"])
        print(f"hashing/caching cost: {(on['core'] - off['core']) * 1e3:.1f} ms = "
              f"{(on['core'] - off['core']) / wall_on:.3%} of the caching-on run; "
              f"walls off {['%.2f' % w for w in off['walls']]}, on {['%.2f' % w for w in on['walls']]}")

    if "c" in args.only:
        r = bench_utilization(llm_on, args)
        print(f"\n(c) mixed workload, block_size {mc.cache.block_size}: {args.mixed_concurrency} requests in flight, "
              f"prompts 32-768, outputs 16-256 tokens; {r['steps']} steps after {args.mixed_warmup} warm-up steps")
        print(f"KV utilization: mean {r['mean']:.4f}, min {r['min']:.4f}, max {r['max']:.4f} "
              f"(KV usage, share of blocks held: mean {r['usage']:.3f})")


if __name__ == "__main__":
    main()
