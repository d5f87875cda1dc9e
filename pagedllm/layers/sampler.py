"""Batched sampling over requests (vLLM v1's order of operations and semantics).

One step, for logits ``[N, V]`` (one row per request):

1. raw logprobs (if any row asked): ``log_softmax`` of the logits exactly as given (vLLM's "raw_logprobs").
2. logits processors, in this order: ``allowed_token_ids`` (others -> -inf), ``logit_bias`` (additive),
   ``min_tokens`` (EOS and stop token ids -> -inf while the output is shorter), penalties (repetition over prompt
   and output, CTRL-style; frequency and presence over the output, OpenAI-style).
3. greedy rows (temperature < 1e-5) take the argmax of the processed logits.
4. random rows: divide by temperature, softmax, min_p (drop tokens with ``p < min_p * max p``), top_k, top_p
   (smallest set whose mass reaches ``top_p`` of what min_p/top_k left), then one inverse-CDF draw: the first kept
   token whose running sum of probabilities passes ``u`` times their total, ``u ~ U[0, 1)``, which draws exactly
   from the truncated, renormalised distribution without renormalising. ``sample_rows`` (one C call, no softmax or
   sort tensors) does all of it; torch (``_top_k_top_p_threshold``, ``_inverse_cdf``) where it can't run. The
   exponential race it replaced (``argmax(p / E)``, ``E ~ Exp(1)`` per token) drew V random numbers a row: Gemma 3's
   262,144-token vocabulary took ~1.8 ms a row on an AMD EPYC Zen 3 (2 threads), the C draw 0.11 ms; in the engine a
   decode step at temperature 1 went from ~1.7-2 ms over a greedy one to within noise of it, and with top_p /
   top_k from 1.6-2.3 ms over to 0.2-0.55 ms (one run each, rounds 8.1-8.8 ms).

Batch independence: a seeded row draws its uniform from its own ``torch.Generator`` (one number per step), its draw
depends only on its own row (fixed summation order, see ``sample_rows``), and every truncation is a per-row
threshold on probabilities (ties at the cut are all kept), so a seeded request samples the same tokens whatever else
shares the batch and wherever its row sits.

Cost (CPU), torch path: top_k/top_p never sort the whole vocabulary when the kept set lies within the top
``_NUM_TOP_P_CANDIDATES`` tokens (the usual case for real models); wider rows retry with 16x more candidates, and
only rows wider still are sorted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from pagedllm.attention.cpu_kernels import argmax_rows, sample_rows
from pagedllm.sampling_params import SAMPLING_EPS, SamplingParams

# top_p first looks for its cut among this many most likely tokens (a partial top-k, ~10x cheaper than a full sort
# of a 50k vocabulary); rows whose nucleus is wider retry with 16x more candidates, then sort the whole row.
_NUM_TOP_P_CANDIDATES = 128


@dataclass
class SamplerRequestState:
    """What the runner knows about one request row."""

    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # generated so far, before this step's token
    generator: Optional[torch.Generator]  # set iff sampling_params.seed is not None; the runner owns it
    eos_token_ids: set[int]  # the model's EOS ids (blocked while min_tokens is not reached)


@dataclass
class SamplingMetadata:
    """Per-step sampling tensors for ``N`` rows. Build with :meth:`build`.

    Random-sampling parameters are compacted to the ``R`` random (non-greedy) rows, in row order:
    ``random_row_indices [R]`` maps them back (None when every row is random). Optional tensors are None when no
    row uses the feature, so the forward pass skips it.
    """

    num_reqs: int
    all_greedy: bool
    all_random: bool
    random_row_indices: Optional[torch.Tensor]  # [R] int64
    temperature: Optional[torch.Tensor]  # [R] float32; None when all_greedy
    top_k: Optional[torch.Tensor]  # [R] int64 in [0, V], 0 = off
    max_top_k: int  # max of top_k (0 when top_k is None)
    top_p: Optional[torch.Tensor]  # [R] float32, 1.0 = off
    min_p: Optional[torch.Tensor]  # [R] float32, 0.0 = off
    generators: dict[int, torch.Generator]  # random-row index (into R) -> its generator
    max_num_logprobs: Optional[int]  # K of SamplerOutput.logprobs; None when no row asked
    allowed_token_ids_mask: Optional[torch.Tensor]  # [N, V] bool, True = NOT allowed
    logit_bias: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # (rows, token ids, bias), each [B]
    min_tokens_block: Optional[tuple[torch.Tensor, torch.Tensor]]  # (rows, token ids) to set to -inf
    prompt_token_ids: Optional[torch.Tensor]  # [N, Lp] int64 padded with V; only if a repetition penalty is on
    output_token_ids: Optional[torch.Tensor]  # [N, Lo] int64 padded with V; only if any penalty is on
    repetition_penalties: Optional[torch.Tensor]  # [N] float32 (1.0 = off)
    frequency_penalties: Optional[torch.Tensor]  # [N] float32
    presence_penalties: Optional[torch.Tensor]  # [N] float32
    vocab_size: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def no_penalties(self) -> bool:
        return self.output_token_ids is None

    @property
    def needs_processing(self) -> bool:
        """Whether any logits processor (allowed ids, bias, min_tokens, penalties) applies to any row."""
        return (
            self.allowed_token_ids_mask is not None
            or self.logit_bias is not None
            or self.min_tokens_block is not None
            or not self.no_penalties
        )

    @classmethod
    def build(cls, rows: list[SamplerRequestState], vocab_size: int, device: torch.device) -> "SamplingMetadata":
        """Gathers the per-row parameters into tensors on ``device`` (one pass over the rows)."""
        V = vocab_size
        N = len(rows)
        f32 = dict(dtype=torch.float32, device=device)
        i64 = dict(dtype=torch.int64, device=device)

        random_rows: list[int] = []
        temps: list[float] = []
        top_ks: list[int] = []
        top_ps: list[float] = []
        min_ps: list[float] = []
        generators: dict[int, torch.Generator] = {}
        max_num_logprobs: Optional[int] = None
        allowed_rows: list[int] = []
        allowed_cols: list[int] = []
        bias_rows: list[int] = []
        bias_cols: list[int] = []
        bias_vals: list[float] = []
        block_rows: list[int] = []
        block_cols: list[int] = []
        rep: list[float] = []
        freq: list[float] = []
        pres: list[float] = []
        any_rep = any_penalty = False

        for i, row in enumerate(rows):
            sp = row.sampling_params
            if sp.temperature >= SAMPLING_EPS:
                if row.generator is not None:
                    generators[len(random_rows)] = row.generator
                random_rows.append(i)
                temps.append(sp.temperature)
                top_ks.append(min(sp.top_k, V) if sp.top_k > 0 else 0)
                top_ps.append(sp.top_p)
                min_ps.append(sp.min_p)
            if sp.logprobs is not None:
                max_num_logprobs = max(max_num_logprobs or 0, sp.logprobs)
            if sp.allowed_token_ids is not None:
                allowed_rows.extend([i] * len(sp.allowed_token_ids))
                allowed_cols.extend(sp.allowed_token_ids)
            if sp.logit_bias:
                for tok, b in sp.logit_bias.items():
                    bias_rows.append(i)
                    bias_cols.append(tok)
                    bias_vals.append(b)
            if len(row.output_token_ids) < sp.min_tokens:
                blocked = sorted(
                    t for t in row.eos_token_ids | set(sp.stop_token_ids) | sp.all_stop_token_ids if 0 <= t < V
                )
                block_rows.extend([i] * len(blocked))
                block_cols.extend(blocked)
            rep.append(sp.repetition_penalty)
            freq.append(sp.frequency_penalty)
            pres.append(sp.presence_penalty)
            any_rep = any_rep or sp.repetition_penalty != 1.0
            any_penalty = any_penalty or sp.frequency_penalty != 0.0 or sp.presence_penalty != 0.0

        R = len(random_rows)
        allowed_mask = None
        if allowed_rows:
            # Rows without allowed_token_ids allow everything.
            allowed_mask = torch.zeros(N, V, dtype=torch.bool, device=device)
            allowed_mask[sorted(set(allowed_rows))] = True
            allowed_mask[torch.tensor(allowed_rows, **i64), torch.tensor(allowed_cols, **i64)] = False

        prompt_ids = output_ids = None
        if any_rep or any_penalty:
            output_ids = _pad_token_ids([r.output_token_ids for r in rows], pad=V, device=device)
            if any_rep:
                prompt_ids = _pad_token_ids([r.prompt_token_ids for r in rows], pad=V, device=device)

        return cls(
            num_reqs=N,
            all_greedy=R == 0,
            all_random=R == N,
            random_row_indices=None if R in (0, N) else torch.tensor(random_rows, **i64),
            temperature=torch.tensor(temps, **f32) if R else None,
            top_k=torch.tensor(top_ks, **i64) if any(top_ks) else None,
            max_top_k=max(top_ks, default=0),
            top_p=torch.tensor(top_ps, **f32) if any(p < 1.0 for p in top_ps) else None,
            min_p=torch.tensor(min_ps, **f32) if any(p > 0.0 for p in min_ps) else None,
            generators=generators,
            max_num_logprobs=max_num_logprobs,
            allowed_token_ids_mask=allowed_mask,
            logit_bias=(
                (torch.tensor(bias_rows, **i64), torch.tensor(bias_cols, **i64), torch.tensor(bias_vals, **f32))
                if bias_rows
                else None
            ),
            min_tokens_block=(
                (torch.tensor(block_rows, **i64), torch.tensor(block_cols, **i64)) if block_rows else None
            ),
            prompt_token_ids=prompt_ids,
            output_token_ids=output_ids,
            repetition_penalties=torch.tensor(rep, **f32) if any_rep else None,
            frequency_penalties=torch.tensor(freq, **f32) if any(f != 0.0 for f in freq) else None,
            presence_penalties=torch.tensor(pres, **f32) if any(p != 0.0 for p in pres) else None,
            vocab_size=V,
            device=torch.device(device),
        )


@dataclass
class LogprobsTensors:
    """Logprobs of ``N`` positions: column 0 is the sampled (or target) token, then the top ``K`` by logprob."""

    token_ids: torch.Tensor  # [N, K + 1] int64
    logprobs: torch.Tensor  # [N, K + 1] float32
    ranks: torch.Tensor  # [N] int64: 1-based rank of the column-0 token in the vocabulary (ties count as better)


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [N] int64
    logprobs: Optional[LogprobsTensors]  # None if no row asked; K = max requested over rows


class Sampler(torch.nn.Module):
    """Samples one token per row. Stateless: everything per step comes in ``SamplingMetadata``."""

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """logits ``[N, V]`` (float32; other dtypes are upcast). The input tensor is never modified."""
        md = metadata
        if md.all_greedy and md.max_num_logprobs is None and not md.needs_processing:
            # argmax is the same on the exact float32 widening: skip the [N, V] upcast copy
            return SamplerOutput(sampled_token_ids=argmax_rows(logits), logprobs=None)
        logits = logits.float()
        raw_logprobs = logits.log_softmax(dim=-1) if md.max_num_logprobs is not None else None

        if md.needs_processing:
            logits = _apply_logits_processors(logits, md)

        if md.all_greedy:
            sampled = argmax_rows(logits)
        elif md.all_random:
            sampled = _sample_random(logits, md)
        else:
            sampled = argmax_rows(logits)
            idx = md.random_row_indices
            sampled.index_copy_(0, idx, _sample_random(logits.index_select(0, idx), md))

        logprobs = None
        if raw_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, sampled, md.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)


def compute_prompt_logprobs(logits: torch.Tensor, target_token_ids: torch.Tensor, num_logprobs: int) -> LogprobsTensors:
    """Logprobs of the prompt: logits ``[T, V]`` at prompt positions, ``target_token_ids [T]`` the next prompt token
    each position predicts. Materialises a ``[T, V]`` float32 copy, so the caller chunks very long prompts."""
    logprobs = logits.float().log_softmax(dim=-1)
    return gather_logprobs(logprobs, target_token_ids.to(device=logits.device, dtype=torch.int64), num_logprobs)


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int) -> LogprobsTensors:
    """logprobs ``[N, V]``, token_ids ``[N]`` -> column 0 = token_ids, then the top ``num_logprobs``."""
    token_ids = token_ids.unsqueeze(-1)
    token_logprobs = logprobs.gather(-1, token_ids)  # [N, 1]
    ranks = (logprobs >= token_logprobs).sum(dim=-1)
    k = min(num_logprobs, logprobs.shape[-1])
    if k > 0:
        top_logprobs, top_ids = logprobs.topk(k, dim=-1)
        token_ids = torch.cat((token_ids, top_ids), dim=1)
        token_logprobs = torch.cat((token_logprobs, top_logprobs), dim=1)
    return LogprobsTensors(token_ids=token_ids, logprobs=token_logprobs, ranks=ranks)


# ---------------------------------------------------------------------------------------------- logits processors
def _apply_logits_processors(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """allowed_token_ids, logit_bias, min_tokens, penalties, on a copy of ``logits [N, V]``."""
    logits = logits.clone()
    if md.allowed_token_ids_mask is not None:
        logits.masked_fill_(md.allowed_token_ids_mask, float("-inf"))
    if md.logit_bias is not None:
        rows, cols, bias = md.logit_bias
        logits.index_put_((rows, cols), bias, accumulate=True)
    if md.min_tokens_block is not None:
        logits.index_put_(md.min_tokens_block, torch.tensor(float("-inf"), device=logits.device))
    if not md.no_penalties:
        logits = _apply_penalties(logits, md)
    return logits


def _apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Repetition (prompt + output; ``l > 0 -> l / r`` else ``l * r``), then ``- freq * count - pres * [count > 0]``
    over the output. Counts come from one scatter_add into a ``[N, V + 1]`` buffer whose last column absorbs the
    padding (token id V)."""
    N, V = logits.shape
    out_ids = md.output_token_ids
    counts = torch.zeros(N, V + 1, dtype=logits.dtype, device=logits.device)
    counts.scatter_add_(1, out_ids, torch.ones(out_ids.shape, dtype=logits.dtype, device=logits.device))
    counts = counts[:, :V]
    in_output = counts > 0
    if md.repetition_penalties is not None:
        seen = torch.zeros(N, V + 1, dtype=torch.bool, device=logits.device)
        seen.scatter_(1, md.prompt_token_ids, True)
        seen = seen[:, :V] | in_output
        penalty = torch.where(seen, md.repetition_penalties.unsqueeze(1), 1.0)
        logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    if md.frequency_penalties is not None:
        logits -= md.frequency_penalties.unsqueeze(1) * counts
    if md.presence_penalties is not None:
        logits -= md.presence_penalties.unsqueeze(1) * in_output
    return logits


# ---------------------------------------------------------------------------------------------- random sampling
def _sample_random(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """logits ``[R, V]`` of the random rows -> ``[R]`` sampled token ids, each drawn by inverse CDF from one uniform
    (``_uniforms``): the C kernel truncates and draws in one call (``sample_rows``); where it can't run, torch builds
    the truncated probabilities and ``_inverse_cdf`` draws from them."""
    u = _uniforms(logits.shape[0], md.generators)
    drawn = sample_rows(logits, 1.0 / md.temperature, u, md.min_p, md.top_k, md.top_p)
    if drawn is not None:
        return drawn
    probs = (logits / md.temperature.unsqueeze(1)).softmax(dim=-1)
    if md.min_p is not None:
        max_probs = probs.amax(dim=-1, keepdim=True)
        probs.masked_fill_(probs < max_probs * md.min_p.unsqueeze(1), 0.0)
    if md.top_k is not None or md.top_p is not None:
        threshold = _top_k_top_p_threshold(probs, md.top_k, md.max_top_k, md.top_p)
        probs.masked_fill_(probs < threshold, 0.0)
    return _inverse_cdf(probs, u)


def _uniforms(R: int, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """``[R]`` float64 uniforms in [0, 1), one per row: row ``i`` in ``generators`` from its own generator (one
    number a step, so a seeded request's draws never depend on the batch), the rest from the default one (one draw
    for all of them)."""
    u = torch.empty(R, dtype=torch.float64) if len(generators) == R else torch.rand(R, dtype=torch.float64)
    for i, gen in generators.items():
        u[i] = draw_uniform(gen)
    return u


def draw_uniform(gen: torch.Generator) -> float:
    """A seeded row's uniform for one sampled token, from its generator: all the sampler takes from it a step
    (``spec_decode.verify.GeneratorRewind`` replays it per output token). Drawn on the generator's device (the
    runner makes CPU generators), so the stream doesn't depend on where the logits live."""
    return torch.rand(1, dtype=torch.float64, generator=gen, device=gen.device).item()


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """torch's inverse-CDF draw (where ``sample_rows``' kernel can't run): per row the first index whose running
    sum (float64) passes ``u`` times the total, taken only among nonzero probabilities."""
    cum = probs.double().cumsum(dim=-1)
    target = (u.to(cum.device) * cum[:, -1]).unsqueeze(1)
    idx = torch.searchsorted(cum, target, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)
    ok = probs.gather(1, idx.unsqueeze(1)).squeeze(1) > 0  # rounding put the target at the total: the last nonzero
    if not bool(ok.all()):
        last = probs.shape[1] - 1 - (probs.flip(-1) > 0).int().argmax(dim=-1)
        idx = torch.where(ok, idx, last)
    return idx


def _top_k_top_p_threshold(
    probs: torch.Tensor, top_k: Optional[torch.Tensor], max_top_k: int, top_p: Optional[torch.Tensor]
) -> torch.Tensor:
    """Per-row probability cut ``[R, 1]``: tokens below it are dropped (0 = keep all).

    top_k keeps tokens ``>=`` the k-th largest probability. top_p then keeps the smallest prefix (by descending
    probability) whose mass reaches ``top_p`` times the mass top_k and min_p left; its cut is the probability of the
    last kept token. Example: probs [.5, .3, .1, .1], top_p .7: prefix sums [.5, .8, ...] -> keep 2, cut .3.
    """
    R, V = probs.shape
    num_cand = min(V, max(max_top_k, _NUM_TOP_P_CANDIDATES if top_p is not None else 0))
    cand = probs.topk(num_cand, dim=-1).values  # [R, C], descending
    threshold = torch.zeros(R, 1, dtype=probs.dtype, device=probs.device)
    k_idx = None
    if top_k is not None:
        k_idx = (top_k.clamp(min=1) - 1).unsqueeze(1)
        threshold = cand.gather(1, k_idx).masked_fill_((top_k == 0).unsqueeze(1), 0.0)
    if top_p is None:
        return threshold

    cum = cand.cumsum(dim=-1)
    mass = probs.sum(dim=-1, keepdim=True)  # < 1 after min_p
    if k_idx is not None:
        mass = torch.where((top_k > 0).unsqueeze(1), cum.gather(1, k_idx), mass)
    target = top_p.unsqueeze(1) * mass  # [R, 1]
    active = top_p < 1.0
    p_cut = _nucleus_cut(cand, cum, target)
    # Rows whose nucleus is wider than the candidates: retry with 16x more, then sort the whole row.
    wide = (active & (cum[:, -1:] < target).squeeze(1)).nonzero().squeeze(1)
    num_cand = 16 * num_cand if 16 * num_cand <= V // 4 else V
    while wide.numel() > 0:
        sub = probs.index_select(0, wide)
        cand = sub.topk(num_cand, dim=-1).values if num_cand < V else sub.sort(dim=-1, descending=True).values
        cum = cand.cumsum(dim=-1)
        sub_target = target.index_select(0, wide)
        p_cut.index_copy_(0, wide, _nucleus_cut(cand, cum, sub_target))
        if num_cand == V:
            break
        wide = wide[(cum[:, -1:] < sub_target).squeeze(1)]
        num_cand = 16 * num_cand if 16 * num_cand <= V // 4 else V
    p_cut.masked_fill_(~active.unsqueeze(1), 0.0)
    return torch.maximum(threshold, p_cut)


def _nucleus_cut(sorted_probs: torch.Tensor, cum: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """sorted_probs ``[R, C]`` descending, cum their prefix sums, target ``[R, 1]`` -> ``[R, 1]`` the probability of
    the last token of the smallest prefix with mass ``>= target`` (token j is kept iff the mass before it < target;
    token 0 always)."""
    num_kept = 1 + (cum[:, :-1] < target).sum(dim=-1, keepdim=True)
    return sorted_probs.gather(1, num_kept - 1)


def _pad_token_ids(token_ids: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    """Ragged id lists -> ``[N, max_len]`` int64 padded with ``pad``."""
    max_len = max((len(t) for t in token_ids), default=0)
    padded = [list(t) + [pad] * (max_len - len(t)) for t in token_ids]
    return torch.tensor(padded, dtype=torch.int64).reshape(len(token_ids), max_len).to(device)
