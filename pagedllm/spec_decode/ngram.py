"""N-gram (prompt lookup) proposer: drafts tokens by finding the request's latest n-gram earlier in its own tokens.

Prompt lookup decoding (Saxena 2023, https://github.com/apoorvumang/prompt-lookup-decoding; vLLM's ``ngram``
method): the last ``n`` tokens (``prompt_lookup_min <= n <= prompt_lookup_max``) are searched for in the prompt and
the output so far; the tokens that followed the match are the draft. The longest matching ``n`` wins; among
matches of that length the latest one (the most recent context). Worked example, ``min = 2``, ``max = 3``,
tokens ``[5 6 7 8 | 9 6 7]``: the 3-gram ``9 6 7`` has no earlier occurrence, the 2-gram ``6 7`` occurs at 1..2, so
the draft is ``[8, 9, 6, ...]`` (what followed it, up to ``k`` tokens, running into the suffix itself if need be).

Cost: numpy over the request's tokens, no Python loop over them: one comparison of every token with the last one
(the candidate match ends), then ``max - 1`` gathers over the candidates only. ~20-40 us for 2k tokens.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {prompt_lookup_min}, "
                             f"{prompt_lookup_max}.")
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, token_ids: Sequence[int] | np.ndarray, k: int | None = None) -> list[int]:
        """Up to ``k`` (default ``num_speculative_tokens``) draft tokens to follow ``token_ids`` (prompt + output
        so far); ``[]`` when the last ``prompt_lookup_min`` tokens occur nowhere earlier."""
        k = self.k if k is None else k
        arr = np.asarray(token_ids, dtype=np.int64)
        L = arr.shape[0]
        if L <= self.min_n or k <= 0:
            return []
        # Candidate match ends c < L - 1 with tokens[c] == tokens[-1], and each one's match length (<= max_n).
        cands = np.flatnonzero(arr[:L - 1] == arr[L - 1])
        if cands.shape[0] == 0:
            return []
        length = np.ones(cands.shape[0], dtype=np.int64)
        alive = np.ones(cands.shape[0], dtype=bool)
        for j in range(1, min(self.max_n, L - 1)):
            idx = cands - j
            ok = alive & (idx >= 0)
            ok[ok] = arr[idx[ok]] == arr[L - 1 - j]
            alive = ok
            if not alive.any():
                break
            length += alive
        best = int(length.max())
        if best < self.min_n:
            return []
        c = int(cands[np.flatnonzero(length == best)[-1]])  # the latest of the longest matches
        return arr[c + 1:c + 1 + k].tolist()
