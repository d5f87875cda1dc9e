"""Sampler vs a brute-force float64 reference written per row with plain loops."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch

from pagedllm.layers import sampler as sampler_mod
from pagedllm.layers.sampler import (
    Sampler,
    SamplerRequestState,
    SamplingMetadata,
    compute_prompt_logprobs,
)
from pagedllm.sampling_params import SamplingParams

CPU = torch.device("cpu")


def state(sp: SamplingParams, prompt=(1, 2, 3), output=(), eos=(0,)) -> SamplerRequestState:
    gen = torch.Generator().manual_seed(sp.seed) if sp.seed is not None else None
    return SamplerRequestState(sp, list(prompt), list(output), gen, set(eos))


def run(logits: torch.Tensor, rows: list[SamplerRequestState]):
    md = SamplingMetadata.build(rows, logits.shape[1], CPU)
    return Sampler()(logits, md)


# ------------------------------------------------------------------------------------------------ reference
def ref_processed(logits_row: np.ndarray, st: SamplerRequestState) -> np.ndarray:
    sp = st.sampling_params
    V = len(logits_row)
    lg = logits_row.astype(np.float64).copy()
    if sp.allowed_token_ids is not None:
        for t in range(V):
            if t not in sp.allowed_token_ids:
                lg[t] = -np.inf
    for t, b in (sp.logit_bias or {}).items():
        lg[t] += b
    if len(st.output_token_ids) < sp.min_tokens:
        for t in set(st.eos_token_ids) | set(sp.stop_token_ids):
            lg[t] = -np.inf
    seen = set(st.prompt_token_ids) | set(st.output_token_ids)
    for t in seen:
        r = sp.repetition_penalty
        lg[t] = lg[t] / r if lg[t] > 0 else lg[t] * r
    counts = Counter(st.output_token_ids)
    for t, c in counts.items():
        lg[t] -= sp.frequency_penalty * c + sp.presence_penalty
    return lg


def ref_distribution(lg: np.ndarray, sp: SamplingParams) -> np.ndarray:
    """Final sampling distribution of one row from its processed logits (float64)."""
    V = len(lg)
    if sp.temperature < 1e-5:
        out = np.zeros(V)
        out[int(np.argmax(lg))] = 1.0
        return out
    z = lg / sp.temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    if sp.min_p > 0:
        pmax = p.max()
        for t in range(V):
            if p[t] < sp.min_p * pmax:
                p[t] = 0.0
    if sp.top_k > 0:
        kth = sorted(p, reverse=True)[min(sp.top_k, V) - 1]
        for t in range(V):
            if p[t] < kth:
                p[t] = 0.0
    if sp.top_p < 1.0:
        total = p.sum()
        order = sorted(range(V), key=lambda t: -p[t])
        keep, mass = set(), 0.0
        for t in order:
            if mass >= sp.top_p * total:
                break
            keep.add(t)
            mass += p[t]
        for t in range(V):
            if t not in keep:
                p[t] = 0.0
    return p / p.sum()


def ref_log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max()
    return x - m - math.log(np.exp(x - m).sum())


# ------------------------------------------------------------------------------------------------ greedy
def test_greedy_is_argmax_and_input_untouched():
    torch.manual_seed(0)
    logits = torch.randn(8, 1000)
    before = logits.clone()
    rows = [state(SamplingParams(temperature=0.0)) for _ in range(8)]
    md = SamplingMetadata.build(rows, 1000, CPU)
    assert md.all_greedy and not md.needs_processing  # the fast path
    out = Sampler()(logits, md)
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.sampled_token_ids.tolist() == [int(np.argmax(r)) for r in before.numpy()]
    assert out.logprobs is None
    assert torch.equal(logits, before)


def test_greedy_rows_in_mixed_batch_use_processed_logits():
    torch.manual_seed(1)
    V = 64
    logits = torch.randn(4, V)
    rows = [
        state(SamplingParams(temperature=0.0, repetition_penalty=1.8), prompt=[5, 9], output=[3]),
        state(SamplingParams(temperature=1.0)),
        state(SamplingParams(temperature=0.0, logit_bias={17: 10.0})),
        state(SamplingParams(temperature=0.7, top_k=3)),
    ]
    before = logits.clone()
    out = run(logits, rows).sampled_token_ids
    for i in (0, 2):
        assert out[i].item() == int(np.argmax(ref_processed(before[i].numpy(), rows[i])))
    assert out[2].item() == 17
    assert torch.equal(logits, before)


# ------------------------------------------------------------------------------------------------ processors
def test_logits_processors_match_reference():
    rng = np.random.default_rng(2)
    V = 40
    logits = torch.from_numpy(rng.normal(0, 2, size=(6, V)).astype(np.float32))
    rows = [
        state(SamplingParams(repetition_penalty=1.3), prompt=[1, 2, 3, 3], output=[4, 4, 30]),
        state(SamplingParams(repetition_penalty=0.7, frequency_penalty=0.5, presence_penalty=0.3),
              prompt=[7], output=[7, 7, 8, 39, 39, 39]),
        state(SamplingParams(frequency_penalty=-0.4, presence_penalty=1.1), prompt=[], output=[0, 5, 5]),
        state(SamplingParams(logit_bias={3: 2.5, 11: -7.0}, allowed_token_ids=[3, 4, 11, 20])),
        state(SamplingParams(min_tokens=4, stop_token_ids=[9, 12]), output=[1, 2], eos=(0, 38)),
        state(SamplingParams(min_tokens=2, stop_token_ids=[9]), output=[1, 2], eos=(0,)),  # reached: no block
    ]
    md = SamplingMetadata.build(rows, V, CPU)
    got = sampler_mod._apply_logits_processors(logits.clone(), md).double().numpy()
    for i, st in enumerate(rows):
        ref = ref_processed(logits[i].numpy(), st)
        assert np.array_equal(np.isinf(got[i]), np.isinf(ref)), i
        finite = np.isfinite(ref)
        np.testing.assert_allclose(got[i][finite], ref[finite], rtol=1e-5, atol=1e-5, err_msg=str(i))
    # Row 4 is blocked on EOS ids and stop ids; row 5 is not.
    assert all(np.isneginf(got[4][[0, 38, 9, 12]]))
    assert np.isfinite(got[5][[0, 9]]).all()


def test_min_tokens_blocks_eos_until_reached():
    V = 20
    logits = torch.zeros(1, V)
    logits[0, 7] = 5.0  # EOS is by far the best token
    logits[0, 4] = 4.0  # a stop token, second best
    logits[0, 2] = 1.0
    sp = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[4])
    assert run(logits, [state(sp, output=[1, 1], eos=(7,))]).sampled_token_ids.item() == 2
    assert run(logits, [state(sp, output=[1, 1, 1], eos=(7,))]).sampled_token_ids.item() == 7
    # Random rows too: EOS and stop ids are never drawn while blocked.
    torch.manual_seed(3)
    sp = SamplingParams(temperature=1.0, min_tokens=1, stop_token_ids=[4])
    out = run(logits.expand(500, V), [state(sp, output=[], eos=(7,)) for _ in range(500)]).sampled_token_ids
    assert not ({7, 4} & set(out.tolist()))


def test_allowed_token_ids_restrict_sampling():
    torch.manual_seed(4)
    V = 100
    logits = torch.randn(1, V) * 3
    allowed = [5, 17, 42, 99]
    sp = SamplingParams(temperature=2.0, allowed_token_ids=allowed)
    out = run(logits.expand(2000, V), [state(sp) for _ in range(2000)]).sampled_token_ids.tolist()
    assert set(out) == set(allowed)  # only these, and each of them shows up at temperature 2


def test_logit_bias_shifts_argmax():
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0]])
    assert run(logits, [state(SamplingParams(temperature=0.0))]).sampled_token_ids.item() == 0
    sp = SamplingParams(temperature=0.0, logit_bias={3: 3.5})
    assert run(logits, [state(sp)]).sampled_token_ids.item() == 3
    sp = SamplingParams(temperature=0.0, logit_bias={0: -1.5})
    assert run(logits, [state(sp)]).sampled_token_ids.item() == 2


# ------------------------------------------------------------------------------------------------ truncation
TRUNCATIONS = [
    dict(temperature=1.5),
    dict(temperature=0.8, top_k=5),
    dict(temperature=1.0, top_p=0.6),
    dict(temperature=1.2, min_p=0.2),
    dict(temperature=0.9, top_k=8, top_p=0.7),
    dict(temperature=1.3, min_p=0.05, top_k=12, top_p=0.8),
]


@pytest.mark.parametrize("params", TRUNCATIONS, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
def test_truncated_sampling_matches_reference_distribution(params):
    rng = np.random.default_rng(5)
    V, n = 30, 4000
    row = rng.normal(0, 1.5, size=V).astype(np.float32)
    sp = SamplingParams(**params)
    ref = ref_distribution(row.astype(np.float64), sp)
    torch.manual_seed(6)
    out = run(torch.from_numpy(row).expand(n, V), [state(sp) for _ in range(n)]).sampled_token_ids
    freq = np.bincount(out.numpy(), minlength=V) / n
    assert set(np.nonzero(freq)[0]) <= set(np.nonzero(ref)[0])  # never outside the kept set
    # Binomial std of a frequency is at most sqrt(0.25 / 4000) = 0.0079; allow ~4 std.
    assert np.abs(freq - ref).max() < 0.03, (freq, ref)


def test_truncated_tokens_never_sampled_over_many_seeds():
    rng = np.random.default_rng(7)
    V = 200
    logits = torch.from_numpy(rng.normal(0, 2.0, size=(len(TRUNCATIONS), V)).astype(np.float32))
    for seed in range(40):
        rows = [state(SamplingParams(seed=seed, **p)) for p in TRUNCATIONS]
        out = run(logits, rows).sampled_token_ids.tolist()
        for i, st in enumerate(rows):
            ref = ref_distribution(logits[i].double().numpy(), st.sampling_params)
            assert ref[out[i]] > 0, (seed, i)


@pytest.mark.parametrize("num_candidates", [128, 4, 2])
@pytest.mark.parametrize("with_top_k", [False, True])
def test_top_k_top_p_threshold_keeps_reference_set(monkeypatch, num_candidates, with_top_k):
    """The kept set is exact on every path: the cut found among the top candidates, the 16x retry, and the full
    sort (with 4 candidates and no top_k the tiers are 4, 64, then all 1000 tokens)."""
    monkeypatch.setattr(sampler_mod, "_NUM_TOP_P_CANDIDATES", num_candidates)
    rng = np.random.default_rng(8)
    V = 1000
    configs = [(0, 0.9, 0.3), (0, 0.9, 4.0), (0, 0.5, 1.0), (0, 1.0, 1.0), (0, 0.8, 8.0), (0, 0.99, 0.1),
               (50, 0.95, 0.5), (7, 0.3, 2.0), (10, 1.0, 1.0)]
    if not with_top_k:
        configs = [c for c in configs if c[0] == 0]
    logits = np.stack([rng.normal(0, s, size=V) for _, _, s in configs]).astype(np.float32)
    probs = torch.from_numpy(logits).softmax(-1)
    top_k = torch.tensor([k for k, _, _ in configs]) if with_top_k else None
    top_p = torch.tensor([p for _, p, _ in configs], dtype=torch.float32)
    thr = sampler_mod._top_k_top_p_threshold(probs, top_k, 0 if top_k is None else int(top_k.max()), top_p)
    sizes = []
    for i, (k, p, _) in enumerate(configs):
        kept = set(torch.nonzero(probs[i] >= thr[i]).flatten().tolist())
        ref = ref_distribution(logits[i].astype(np.float64), SamplingParams(top_k=k, top_p=p))
        assert kept == set(np.nonzero(ref)[0].tolist()), i
        sizes.append(len(kept) if p < 1.0 else 0)
    # The data reaches every tier: nuclei within 4 tokens, within 64, and wider.
    assert min(s for s in sizes if s) <= 4 and any(4 < s <= 64 for s in sizes) and max(sizes) > 64, sizes


# ------------------------------------------------------------------------------------------------ seeds
def _seeded_run(rows_fn, steps: int, V: int, logits_seq) -> list[list[int]]:
    rows = rows_fn()
    out = []
    for step in range(steps):
        out.append(run(logits_seq[step][: len(rows)], rows).sampled_token_ids.tolist())
    return out


def test_seeded_row_is_independent_of_the_batch():
    rng = np.random.default_rng(9)
    V, steps = 300, 6
    seeded = dict(temperature=0.9, top_k=40, seed=1234)
    seeded_p = dict(temperature=1.1, top_p=0.8, seed=99)
    # The same logits for the seeded rows in every configuration; other rows get their own.
    base = [rng.normal(0, 2, size=V).astype(np.float32) for _ in range(steps)]
    base_p = [rng.normal(0, 2, size=V).astype(np.float32) for _ in range(steps)]
    noise = [rng.normal(0, 2, size=(6, V)).astype(np.float32) for _ in range(steps)]

    alone = []
    gen = torch.Generator().manual_seed(1234)
    for s in range(steps):
        st = SamplerRequestState(SamplingParams(**seeded), [1], [], gen, {0})
        alone.append(run(torch.from_numpy(base[s])[None], [st]).sampled_token_ids.item())

    def batched(layout: list[str]):
        gens = {"s": torch.Generator().manual_seed(1234), "s2": torch.Generator().manual_seed(1234),
                "p": torch.Generator().manual_seed(99)}
        got = {"s": [], "s2": [], "p": []}
        torch.manual_seed(len(layout))  # a different default-generator stream per layout
        for s in range(steps):
            rows, lg = [], []
            for j, kind in enumerate(layout):
                if kind in ("s", "s2"):
                    rows.append(SamplerRequestState(SamplingParams(**seeded), [1], [], gens[kind], {0}))
                    lg.append(base[s])
                elif kind == "p":
                    rows.append(SamplerRequestState(SamplingParams(**seeded_p), [1], [], gens["p"], {0}))
                    lg.append(base_p[s])
                elif kind == "r":  # unseeded random, with top_p to force the top_p path for the whole batch
                    rows.append(state(SamplingParams(temperature=1.0, top_p=0.9)))
                    lg.append(noise[s][j])
                else:  # greedy
                    rows.append(state(SamplingParams(temperature=0.0)))
                    lg.append(noise[s][j])
            out = run(torch.from_numpy(np.stack(lg)), rows).sampled_token_ids.tolist()
            for j, kind in enumerate(layout):
                if kind in got:
                    got[kind].append(out[j])
        return got

    a = batched(["r", "g", "s", "r", "p"])
    b = batched(["p", "s", "s2", "g"])
    c = batched(["g", "r", "r", "r", "p", "s"])
    assert a["s"] == b["s"] == b["s2"] == c["s"] == alone
    assert a["p"] == b["p"] == c["p"]
    assert len(set(alone)) > 1  # it really samples (not a degenerate argmax)


def test_different_seeds_differ():
    torch.manual_seed(10)
    V = 1000
    logits = torch.randn(1, V)
    draws = {run(logits, [state(SamplingParams(seed=s))]).sampled_token_ids.item() for s in range(20)}
    assert len(draws) > 10


# ------------------------------------------------------------------------------------------------ logprobs
def test_logprobs_are_raw_with_ranks():
    rng = np.random.default_rng(11)
    V = 50
    logits_np = rng.normal(0, 2, size=(5, V)).astype(np.float32)
    logits_np[4, 7] = logits_np[4, 3] = logits_np[4].max() + 1.0  # a tie for the best token
    logits = torch.from_numpy(logits_np)
    rows = [
        state(SamplingParams(temperature=0.0, logprobs=2, repetition_penalty=2.0), output=[5, 6]),
        state(SamplingParams(temperature=1.0, logprobs=5, logit_bias={1: 3.0})),
        state(SamplingParams(temperature=0.7, top_p=0.5)),  # no logprobs asked: still filled (K = max)
        state(SamplingParams(temperature=0.0, logprobs=0, logit_bias={10: 50.0})),  # forced to a low-ranked token
        state(SamplingParams(temperature=0.0, logprobs=1)),
    ]
    out = run(logits, rows)
    lp = out.logprobs
    assert lp.token_ids.shape == lp.logprobs.shape == (5, 6)
    assert lp.token_ids.dtype == torch.int64 and lp.logprobs.dtype == torch.float32
    assert torch.equal(lp.token_ids[:, 0], out.sampled_token_ids)
    assert out.sampled_token_ids[3].item() == 10 and out.sampled_token_ids[4].item() == 3  # first of the tie
    for i in range(5):
        ref = ref_log_softmax(logits_np[i])  # of the raw logits, not the processed ones
        tok = out.sampled_token_ids[i].item()
        assert lp.logprobs[i, 0].item() == pytest.approx(ref[tok], abs=1e-5)
        assert lp.ranks[i].item() == int((ref >= ref[tok]).sum())
        top = np.argsort(-ref, kind="stable")[:5]
        np.testing.assert_allclose(lp.logprobs[i, 1:].numpy(), ref[top], atol=1e-5)
        if i != 4:
            assert lp.token_ids[i, 1:].tolist() == top.tolist()
    assert lp.ranks[4].item() == 2  # ties count as better
    assert set(lp.token_ids[4, 1:3].tolist()) == {3, 7}
    assert lp.ranks[3].item() > 1


def test_prompt_logprobs_match_reference():
    rng = np.random.default_rng(12)
    T, V = 7, 60
    logits_np = rng.normal(0, 3, size=(T, V)).astype(np.float32)
    targets = rng.integers(0, V, size=T)
    res = compute_prompt_logprobs(torch.from_numpy(logits_np), torch.from_numpy(targets), 3)
    assert res.token_ids.shape == (T, 4)
    assert res.token_ids[:, 0].tolist() == targets.tolist()
    for t in range(T):
        ref = ref_log_softmax(logits_np[t])
        assert res.logprobs[t, 0].item() == pytest.approx(ref[targets[t]], abs=1e-5)
        assert res.ranks[t].item() == int((ref >= ref[targets[t]]).sum())
        top = np.argsort(-ref)[:3]
        assert res.token_ids[t, 1:].tolist() == top.tolist()
        np.testing.assert_allclose(res.logprobs[t, 1:].numpy(), ref[top], atol=1e-5)
    assert compute_prompt_logprobs(torch.from_numpy(logits_np), torch.from_numpy(targets), 0).token_ids.shape == (T, 1)


def test_metadata_skips_unused_features():
    rows = [state(SamplingParams(temperature=0.5)), state(SamplingParams(temperature=0.0))]
    md = SamplingMetadata.build(rows, 100, CPU)
    assert not md.all_greedy and not md.all_random and md.random_row_indices.tolist() == [0]
    assert md.top_k is None and md.top_p is None and md.min_p is None and md.no_penalties
    assert md.max_num_logprobs is None and not md.needs_processing
    rows.append(state(SamplingParams(top_k=500, top_p=0.9, presence_penalty=0.1, seed=3)))
    md = SamplingMetadata.build(rows, 100, CPU)
    assert md.top_k.tolist() == [0, 100] and md.max_top_k == 100  # clamped to the vocabulary
    assert list(md.generators) == [1]  # index among the random rows
    assert md.output_token_ids is not None and md.prompt_token_ids is None  # no repetition penalty


def test_top_p_cut_at_exact_boundary():
    # Prefix sums are exact in binary: [.5, .75, .875, ...]; top_p .75 is reached by 2 tokens, so only 2 are kept.
    probs = torch.tensor([[0.0625, 0.5, 0.125, 0.25, 0.0625]])
    thr = sampler_mod._top_k_top_p_threshold(probs, None, 0, torch.tensor([0.75]))
    assert torch.nonzero(probs[0] >= thr[0]).flatten().tolist() == [1, 3]
