"""Verifying draft tokens in the runner's one forward pass: which logits rows, how they are sampled, what is kept.

A request with ``k`` drafts ``d_1..d_k`` was computed at ``k + 1`` positions: its last verified token, then the
drafts. Row ``j`` (``0 <= j <= k``) holds the target's logits for the token after ``d_1..d_j``. Each row is sampled
exactly as a plain decode at that position would be (the same ``Sampler``, with the row's own output so far,
``output + d_1..d_j``, for penalties and ``min_tokens``), giving ``t_0..t_k``; the output is the longest prefix of
drafts that equals the samples, then the first sample after it: ``t_0..t_a`` where ``a`` = the first ``j`` with
``d_{j+1} != t_j`` (or ``k``).

Why this is exact (the drafts here are deterministic, a one-hot draft distribution ``q``): rejection sampling
(Leviathan et al. 2023, Chen et al. 2023) accepts ``d`` with probability ``min(1, p(d) / q(d)) = p(d)`` and on
rejection samples from ``max(p - q, 0)`` normalised, which is ``p`` restricted to tokens ``!= d`` and normalised. A
sample ``t ~ p`` satisfies ``P(t = d) = p(d)`` and, given ``t != d``, is distributed as ``p`` restricted to
``!= d``: so "accept iff the target's own sample equals the draft, else output that sample" *is* rejection sampling
for one-hot drafts, and for greedy rows (``t = argmax p``) it is greedy decoding itself. Every output token is thus
distributed as the target's at its position (tested with a chi-square bound in tests/test_spec_decode.py).

Seeds: a seeded row draws one uniform from its request's generator per sampled row (``sampler.draw_uniform``: its
inverse-CDF draw), and a plain decode draws once per output token. After verification the generator is put back to where it
was and advanced once per *output* token (``GeneratorRewind``), so a seeded request's stream, and thus its output,
is the same with and without speculation, whatever shares its batch.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from pagedllm.layers.sampler import SamplerRequestState, draw_uniform
from pagedllm.sampling_params import SAMPLING_EPS


def verify_rows(row_ends: Sequence[int], rows: Sequence[SamplerRequestState],
                drafts: Sequence[Sequence[int]]) -> tuple[list[int], list[SamplerRequestState]]:
    """Logits rows and sampler states for requests ``rows[i]`` whose scheduled tokens end at flat index
    ``row_ends[i]`` (exclusive) with ``drafts[i]`` last (possibly none): ``len(drafts[i]) + 1`` rows each.

    A row after ``j`` drafts gets a state whose output is ``output + drafts[:j]`` when the sampler reads it
    (penalties, or ``min_tokens`` not yet reached); otherwise the request's own state object is reused."""
    idx: list[int] = []
    out: list[SamplerRequestState] = []
    for end, st, d in zip(row_ends, rows, drafts):
        k = len(d)
        idx.extend(range(end - 1 - k, end))
        out.append(st)
        if not k:
            continue
        sp = st.sampling_params
        reads_output = (sp.repetition_penalty != 1.0 or sp.frequency_penalty != 0.0 or sp.presence_penalty != 0.0
                        or len(st.output_token_ids) < sp.min_tokens)
        if not reads_output:
            out.extend([st] * k)
            continue
        for j in range(1, k + 1):
            out.append(SamplerRequestState(sp, st.prompt_token_ids, st.output_token_ids + list(d[:j]),
                                           st.generator, st.eos_token_ids))
    return idx, out


def accept(sampled: Sequence[int], drafts: Sequence[Sequence[int]]) -> tuple[list[list[int]], list[int]]:
    """``sampled``: the samples of every row (``len(drafts[i]) + 1`` per request, in order) -> per request the
    output tokens (accepted drafts + the sample after them) and the index of its first row.

    Example: drafts ``[[4, 5, 6], []]``, samples ``[4, 5, 9, 2, 7]`` -> ``[[4, 5, 9], [7]]``, rows ``[0, 4]``."""
    sizes = np.fromiter((len(d) + 1 for d in drafts), dtype=np.int64, count=len(drafts))
    starts = np.zeros(len(drafts), dtype=np.int64)
    np.cumsum(sizes[:-1], out=starts[1:])
    s = np.asarray(sampled, dtype=np.int64)
    k_max = int(sizes.max()) - 1 if len(drafts) else 0
    if k_max == 0:
        return [[t] for t in s.tolist()], starts.tolist()
    # [R, k_max] draft matrix (padded with -1, which never equals a sample) against the samples before each draft
    dmat = np.full((len(drafts), k_max), -1, dtype=np.int64)
    col = np.arange(k_max)
    has = col[None, :] < (sizes - 1)[:, None]
    dmat[has] = np.fromiter((t for d in drafts for t in d), dtype=np.int64, count=int(has.sum()))
    smat = np.full((len(drafts), k_max), -2, dtype=np.int64)
    smat[has] = s[(starts[:, None] + col[None, :])[has]]
    num_accepted = np.cumprod(dmat == smat, axis=1).sum(axis=1)
    sl = s.tolist()
    out = [sl[b:b + a + 1] for b, a in zip(starts.tolist(), num_accepted.tolist())]
    return out, starts.tolist()


class GeneratorRewind:
    """Seeded random rows of speculating requests: the generator's state before sampling, so that afterwards it
    can be advanced once per output token only (see the module docstring)."""

    def __init__(self, rows: Sequence[SamplerRequestState], drafts: Sequence[Sequence[int]]) -> None:
        self.saved: list[tuple[int, torch.Generator, torch.Tensor]] = []
        for i, (st, d) in enumerate(zip(rows, drafts)):
            if d and st.generator is not None and st.sampling_params.temperature >= SAMPLING_EPS:
                self.saved.append((i, st.generator, st.generator.get_state()))

    def advance(self, outputs: Sequence[Sequence[int]]) -> None:
        """Resets each saved generator and draws the sampler's one uniform per output token of its request."""
        for i, gen, state in self.saved:
            gen.set_state(state)
            for _ in range(len(outputs[i])):
                draw_uniform(gen)

