"""How many draft tokens a request gets, from its recent acceptance (plain floats; the scheduler calls these).

Model (Leviathan et al. 2023, section 3.1): each draft token is accepted with probability ``a`` independently, so
the ``k``-th draft token of a step is used with probability ``a ** k``, and ``k`` drafts yield
``(1 - a ** (k + 1)) / (1 - a)`` tokens on average. A draft token costs a row of the verifying forward pass, which
at the small batches speculation runs at is a fraction ``MIN_GAIN`` of a step (a decode matmul of 1 row costs
about what 4-8 rows cost on these CPUs, see DESIGN.md). So a request drafts the largest ``k <= k_max`` with
``a ** k >= MIN_GAIN``: ``a = 0.9`` -> up to 15, ``0.5`` -> 2, ``0.3`` -> 1, below ``MIN_GAIN`` -> none.

Cost-aware (where the runner has measured this machine's costs, ``StepCosts``): a draft token costs ``c`` plain
decode steps (a verify row's share of the target's step plus, for a model drafter, its draft step), and a request
drafts the ``k <= k_max`` that maximizes tokens per unit of time, ``E(k) / (1 + c k)``, or none where no ``k``
beats a plain step (``E(1) / (1 + c) > 1`` needs ``a > c``). Measured (1.5B Q4_K_M target, 0.5B draft):
``c`` ~0.5 on a Xeon with AMX, ~0.7 on an EPYC Zen 3, where the fixed rule drafted at 0.78x.

``a`` is estimated per step as ``accepted / (accepted + 1 if a draft was rejected else accepted)`` (the draws the
step observed: every accepted token and the first rejection) and smoothed with weight ``EMA_WEIGHT``. A request
whose estimate fell below ``MIN_GAIN`` drafts nothing, and its estimate relaxes toward ``PROBE_LEVEL`` by
``RELAX`` per step until it drafts one token again (a probe costing one row: after 8 steps from 0, after 2-3 steps
from just below ``MIN_GAIN``, where a rejected probe leaves it): text that turns repetitive later is picked up.
"""

from __future__ import annotations

import math
from typing import Optional

MIN_GAIN = 0.2
EMA_WEIGHT = 0.3
PROBE_LEVEL = 0.5
RELAX = 1.0 / 16


def num_draft_tokens(k_max: int, acceptance: float, cost: Optional[float] = None) -> int:
    """Without ``cost``: the largest ``k <= k_max`` with ``acceptance ** k >= MIN_GAIN`` (0 when ``acceptance <
    MIN_GAIN``). With ``cost`` (a draft token's cost in plain decode steps, ``StepCosts.draft_token_cost``): the
    ``k`` in ``0..k_max`` with the most expected tokens per step time, ``E(k) / (1 + cost k)`` (``E(0) = 1``)."""
    if cost is not None:
        best, best_rate, expected, p = 0, 1.0, 1.0, 1.0
        for k in range(1, k_max + 1):
            p *= min(acceptance, 1.0)
            expected += p
            rate = expected / (1.0 + cost * k)
            if rate > best_rate * (1.0 + 1e-9):
                best, best_rate = k, rate
        return best
    if acceptance >= 1.0:
        return k_max
    if acceptance < MIN_GAIN:
        return 0
    return min(k_max, max(1, int(math.log(MIN_GAIN) / math.log(acceptance) + 1e-9)))


def share(k_max: int, acceptance: float, cost: Optional[float] = None) -> int:
    """A request's drafts for a step: ``num_draft_tokens``, and under a measured ``cost`` a probe of one draft once
    the estimate of a request that drafts nothing has relaxed to ``PROBE_LEVEL`` (from above or below: ~40-50
    steps), where a cost above that level would otherwise never let it draft again (text that turns repetitive
    later is picked up)."""
    k = num_draft_tokens(k_max, acceptance, cost)
    if k == 0 and cost is not None and k_max and abs(acceptance - PROBE_LEVEL) <= 0.01:
        return 1
    return k


def update(acceptance: float, num_draft: int, num_accepted: int) -> float:
    """The smoothed acceptance after a step that verified ``num_draft`` draft tokens and accepted
    ``num_accepted`` (``0 <= num_accepted <= num_draft``, ``num_draft >= 1``)."""
    trials = num_accepted + (1 if num_accepted < num_draft else 0)
    return (1.0 - EMA_WEIGHT) * acceptance + EMA_WEIGHT * (num_accepted / trials)


def relax(acceptance: float) -> float:
    """One step without drafts because of low acceptance: the estimate moves toward ``PROBE_LEVEL``."""
    return acceptance + (PROBE_LEVEL - acceptance) * RELAX


COST_EMA = 0.1  # weight of a new timing in StepCosts' averages
CALIBRATE_EVERY = 64  # a speculating single stream verifies no drafts once per this many steps (a plain step timed)


class StepCosts:
    """This machine's speculation costs, timed by the model runner on steps of one request (where speculation
    pays most; a batch shares its step): exponential averages (weight ``COST_EMA``) of the target's step time by
    its row count (``1 + drafts verified``: the forward, sampling and acceptance, in seconds), and of the
    drafter's time per draft token. ``draft_token_cost`` is a draft token's cost in plain steps: the target's
    marginal seconds per row (over the rows counts seen beside 1, whose time the scheduler's calibration steps
    give: ``CALIBRATE_EVERY``) plus the draft's seconds per token, over the plain step's seconds."""

    def __init__(self) -> None:
        self.step_s: dict[int, float] = {}  # rows -> seconds
        self.draft_s: Optional[float] = None  # seconds per draft token (0 for n-gram lookups, in effect)

    @staticmethod
    def _ema(old: Optional[float], new: float) -> float:
        return new if old is None else old + COST_EMA * (new - old)

    def observe_step(self, rows: int, seconds: float) -> None:
        self.step_s[rows] = self._ema(self.step_s.get(rows), seconds)

    def observe_draft(self, num_tokens: int, seconds: float) -> None:
        if num_tokens > 0:
            self.draft_s = self._ema(self.draft_s, seconds / num_tokens)

    def draft_token_cost(self) -> Optional[float]:
        """None until a plain step and a verify step (or a draft) were timed."""
        plain = self.step_s.get(1)
        if not plain:
            return None
        rows = [(r - 1, t - plain) for r, t in self.step_s.items() if r > 1]
        if not rows and self.draft_s is None:
            return None
        per_row = max(sum(dt for _, dt in rows) / sum(n for n, _ in rows), 0.0) if rows else 0.0
        return (per_row + (self.draft_s or 0.0)) / plain
