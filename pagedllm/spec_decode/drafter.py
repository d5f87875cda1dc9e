"""The runner's drafter: after a step, draft tokens for every request that sampled (``ModelRunnerOutput
.spec_token_ids``); the scheduler decides how many of them the next step verifies."""

from __future__ import annotations

from typing import Optional, Sequence

from pagedllm.spec_decode.draft_model import max_drafting_reqs
from pagedllm.spec_decode.ngram import NgramProposer


class NgramDrafter:
    """Prompt lookup over each request's prompt + output (``pagedllm.spec_decode.ngram``)."""

    mirrors = False  # no model of its own to run over the target's rows

    def __init__(self, config) -> None:
        self.k = config.num_speculative_tokens
        self.proposer = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min,
                                      config.prompt_lookup_max)
        self.max_num_reqs = max_drafting_reqs(config)  # from this many requests on no drafts are verified

    def propose(self, states: Sequence, sampled: Sequence[Sequence[int]],
                limits: Optional[Sequence[int]] = None) -> list[list[int]]:
        """``states[i]``: a runner request state (``token_ids`` = prompt + output, this step's tokens included);
        ``sampled[i]``: what it sampled this step (no drafts for a request still prefilling); ``limits[i]``: at most
        this many drafts (default ``num_speculative_tokens``)."""
        if len(states) > self.max_num_reqs:
            return [[] for _ in states]
        propose = self.proposer.propose
        limits = limits or [self.k] * len(states)
        # Structured outputs: no drafts (the grammar's bitmask covers one position per step).
        return [propose(st.token_ids)[:lim] if toks and lim and getattr(st.sampling_params, "structured_outputs", None)
                is None else [] for st, toks, lim in zip(states, sampled, limits)]


def make_drafter(config, runner=None, draft=None):
    """The drafter for a ``SpeculativeConfig`` (None: no speculation); ``runner``: the ``ModelRunner`` (its model and
    KV layout), for a method with a model of its own (``self_int4``, ``draft_model``); ``draft``: the loaded draft
    model of ``draft_model`` (default: ``load_draft_model``).

    Raises:
        ValueError: for a method without a drafter, or one the model can't run (``self_int4`` on a non-bf16 model,
            a hybrid-attention target).
    """
    if config is None:
        return None
    if config.method == "ngram":
        return NgramDrafter(config)
    if config.method == "self_int4" and runner is not None:
        from pagedllm.spec_decode.self_int4 import SelfInt4Drafter

        return SelfInt4Drafter(config, runner)
    if config.method == "draft_model" and runner is not None:
        from pagedllm.spec_decode.draft_model import make_draft_model_drafter

        return make_draft_model_drafter(config, runner, draft)
    raise ValueError(f"speculative_config.method {config.method!r} has no drafter.")
