"""How many draft tokens a request gets, from its recent acceptance (plain floats; the scheduler calls these).

Model (Leviathan et al. 2023, section 3.1): each draft token is accepted with probability ``a`` independently, so
the ``k``-th draft token of a step is used with probability ``a ** k``, and ``k`` drafts yield
``(1 - a ** (k + 1)) / (1 - a)`` tokens on average. A draft token costs a row of the verifying forward pass, which
at the small batches speculation runs at is a fraction ``MIN_GAIN`` of a step (a decode matmul of 1 row costs
about what 4-8 rows cost on these CPUs, see DESIGN.md). So a request drafts the largest ``k <= k_max`` with
``a ** k >= MIN_GAIN``: ``a = 0.9`` -> up to 15, ``0.5`` -> 2, ``0.3`` -> 1, below ``MIN_GAIN`` -> none.

``a`` is estimated per step as ``accepted / (accepted + 1 if a draft was rejected else accepted)`` (the draws the
step observed: every accepted token and the first rejection) and smoothed with weight ``EMA_WEIGHT``. A request
whose estimate fell below ``MIN_GAIN`` drafts nothing, and its estimate relaxes toward ``PROBE_LEVEL`` by
``RELAX`` per step until it drafts one token again (a probe costing one row: after 8 steps from 0, after 2-3 steps
from just below ``MIN_GAIN``, where a rejected probe leaves it): text that turns repetitive later is picked up.
"""

from __future__ import annotations

import math

MIN_GAIN = 0.2
EMA_WEIGHT = 0.3
PROBE_LEVEL = 0.5
RELAX = 1.0 / 16


def num_draft_tokens(k_max: int, acceptance: float) -> int:
    """The largest ``k <= k_max`` with ``acceptance ** k >= MIN_GAIN`` (0 when ``acceptance < MIN_GAIN``)."""
    if acceptance >= 1.0:
        return k_max
    if acceptance < MIN_GAIN:
        return 0
    return min(k_max, max(1, int(math.log(MIN_GAIN) / math.log(acceptance) + 1e-9)))


def update(acceptance: float, num_draft: int, num_accepted: int) -> float:
    """The smoothed acceptance after a step that verified ``num_draft`` draft tokens and accepted
    ``num_accepted`` (``0 <= num_accepted <= num_draft``, ``num_draft >= 1``)."""
    trials = num_accepted + (1 if num_accepted < num_draft else 0)
    return (1.0 - EMA_WEIGHT) * acceptance + EMA_WEIGHT * (num_accepted / trials)


def relax(acceptance: float) -> float:
    """One step without drafts because of low acceptance: the estimate moves toward ``PROBE_LEVEL``."""
    return acceptance + (PROBE_LEVEL - acceptance) * RELAX
