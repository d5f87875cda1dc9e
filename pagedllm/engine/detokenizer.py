"""Incremental detokenization with stop strings: one `IncrementalDetokenizer` per request (per child when n > 1).

Two stages, both O(1)-ish per token:

1. Token ids → text, by the prefix/read-offset method. `token_ids` holds the last few prompt tokens followed by the
   output. Each step decodes two short windows:
       prefix_text = decode(token_ids[prefix_offset:read_offset])   # already emitted, used as context
       new_text    = decode(token_ids[prefix_offset:])
   and emits `new_text[len(prefix_text):]`, then slides the window (prefix_offset = read_offset,
   read_offset = len(token_ids)). The context is what keeps leading spaces: decoders that strip the first token's
   leading space (SentencePiece "▁Hello" → "Hello") strip it in both windows alike, so " world" survives; and it
   starts with the prompt's tail, so the very first output token keeps its space too. When `new_text` ends in
   U+FFFD, the last tokens hold an incomplete UTF-8 sequence (an emoji split over byte tokens): nothing is emitted
   and the window is not slid until the character completes (or the request finishes).

   Worked example (byte-level BPE, prompt ending "... is"): output tokens "ĠðŁ", "ĳ", "į" (the 4 bytes of 👍 in
   three tokens): step 1 new_text ends "\\ufffd" → hold; step 2 likewise; step 3 decodes " 👍" → emit, slide.

2. Stop strings over the decoded text. `_text` is all decoded output text; `output_text` is its released prefix.
   Each stop string keeps a Knuth-Morris-Pratt automaton (its failure table, len(stop) ints, and the current
   match length: the longest suffix of `_text` that is a prefix of the stop string), fed each new character once:
   O(total stop length) memory per request and amortized O(number of stops) work per character. A match ends at
   the first character where some automaton reaches its full length (the longest stop string wins a tie). Without
   a match, the longest current match length is held back (a suffix that could still begin a stop string); it is
   released when later text rules the match out or on finish. With a match, `_text` is cut before the stop string
   (or right after it with include_stop_str_in_output). Invariant: nothing released is ever part of a stop string
   that completes later.
   A stop string that is exactly a special token's text (`special_stop`, e.g. "<|im_end|>") never appears in the
   text when skip_special_tokens hides that token, so it is matched by the token id instead.

`spaces_between_special_tokens` is accepted for API compatibility; fast (tokenizers-backed) tokenizers, the only
kind transformers 5 has, ignore it in `decode` too, so output matches `tokenizer.decode`.
"""

from __future__ import annotations

from typing import Optional, Sequence

__all__ = ["IncrementalDetokenizer"]

# Prompt tokens decoded as context before the first output token (vLLM uses the same number).
INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET = 5
# A UTF-8 character is at most 4 bytes, so a window still ending in U+FFFD after this many pending tokens is truly
# invalid output: emit it as is rather than let the window (and per-token cost) grow without bound. Likewise for a
# run of tokens that decode to nothing (skipped special tokens).
_MAX_PENDING_TOKENS = 16
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        special_stop: Optional[dict[int, str]] = None,
    ):
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.include_stop_str_in_output = include_stop_str_in_output
        if isinstance(stop, str):
            stop = [stop]
        self.stop: tuple[str, ...] = tuple(s for s in (stop or ()) if s)  # "" would match everywhere
        self._decode_fn = _make_decode_fn(tokenizer, skip_special_tokens)

        # Stage 1 state. token_ids = prompt tail + output ids; offsets index into it.
        num_prompt = len(prompt_token_ids)
        context = list(prompt_token_ids[max(0, num_prompt - INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET) :])
        self.token_ids: list[int] = context
        self.num_prompt_context_tokens = len(context)
        self.prefix_offset = 0
        self.read_offset = len(context)
        self._prefix_text = self._decode_fn(context) if context else ""

        # Stage 2 state.
        self._text = ""  # all decoded output text (after a stop-string cut, the final text)
        self._num_released = 0  # output_text == _text[:_num_released]
        self._num_delta_sent = 0  # chars already handed out by get_next_output_text(delta=True)
        # KMP automata, one per stop string: failure tables and current match lengths (see the module note).
        self._stop_fail = [_failure_table(s) for s in self.stop]
        self._stop_state = [0] * len(self.stop)
        self._stop_chars = frozenset("".join(self.stop))
        # Special-token stop strings, by token id (only hidden tokens need it; visible ones match as text).
        self.special_stop = dict(special_stop or {}) if skip_special_tokens else {}
        self.stop_reason: Optional[str] = None  # the stop string that ended the request, once found
        self.finished = False

    # ------------------------------------------------------------------ public API

    @property
    def output_text(self) -> str:
        """All text released so far."""
        return self._text[: self._num_released]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_context_tokens :]

    def update(self, new_token_ids: Sequence[int], finished: bool, stop_terminated: bool = False) -> Optional[str]:
        """Add sampled tokens. Returns the stop string if one completed (the request must then stop), else None.

        finished: the request ends this step for another reason (EOS, stop token, length, abort): flush held text.
        stop_terminated: the last token is an EOS / stop_token_ids hit; like vLLM, it is left out of the text unless
            include_stop_str_in_output (matters only with skip_special_tokens=False or a non-special stop token).
        """
        if self.finished:
            return None
        token_ids = list(new_token_ids)
        skipped_id = None
        if stop_terminated and token_ids and not self.include_stop_str_in_output:
            skipped_id = token_ids.pop()
            finished = True
        if self.special_stop:
            k = next((k for k, t in enumerate(token_ids) if t in self.special_stop), None)
            if k is not None:
                return self._special_stop_hit(token_ids, k)
        old_len = len(self._text)
        for token_id in token_ids:
            self.token_ids.append(token_id)
            self._decode_pending(flush=False)
        if finished:
            self._decode_pending(flush=True)
        if skipped_id is not None:
            self.token_ids.append(skipped_id)  # an output token, but never decoded (the request is over)
        return self._after_decode(old_len, finished)

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The released text: all of it, or (delta=True) only what no earlier delta call returned.

        finished=True also releases text held back for stop-string matching (the request is over).
        """
        if finished and not self.finished:
            self._decode_pending(flush=True)
            self._num_released = len(self._text)
            self.finished = True
        if not delta:
            return self.output_text
        start = self._num_delta_sent
        self._num_delta_sent = self._num_released
        return self._text[start : self._num_released]

    # ------------------------------------------------------------------ internals

    def _decode_pending(self, flush: bool) -> None:
        """Stage 1: decode tokens after read_offset into `_text`, unless they end mid-character (and not flush)."""
        num_pending = len(self.token_ids) - self.read_offset
        if num_pending == 0:
            return
        new_text = self._decode_fn(self.token_ids[self.prefix_offset :])
        if not flush and num_pending < _MAX_PENDING_TOKENS:
            if new_text.endswith(_REPLACEMENT_CHAR):
                return  # incomplete UTF-8 sequence: wait for the next token
            if len(new_text) <= len(self._prefix_text):
                return  # no text yet (e.g. skipped special tokens): keep the context window as it is
        self._text += new_text[len(self._prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        self._prefix_text = self._decode_fn(self.token_ids[self.prefix_offset : self.read_offset])

    def _special_stop_hit(self, token_ids: list[int], k: int) -> Optional[str]:
        """Token ``token_ids[k]`` is a special-token stop string: text up to it is decoded and searched first (a
        text stop string completing there wins), then the request stops at it."""
        old_len = len(self._text)
        for token_id in token_ids[:k]:
            self.token_ids.append(token_id)
            self._decode_pending(flush=False)
        self._decode_pending(flush=True)
        if self.stop and len(self._text) > old_len:
            match = self._find_stop(old_len)
            if match is not None:
                return self._cut(*match)
        stop_str = self.special_stop[token_ids[k]]
        self.token_ids.extend(token_ids[k:k + 1])
        if self.include_stop_str_in_output:
            self._text += stop_str
        return self._cut(stop_str, len(self._text))

    def _cut(self, stop_str: str, cut: int) -> str:
        self._text = self._text[:cut]
        self._num_released = cut
        self.stop_reason = stop_str
        self.finished = True
        return stop_str

    def _after_decode(self, old_len: int, finished: bool) -> Optional[str]:
        """Stage 2: find a stop string in the text added since `old_len`, then decide what to release."""
        if self.stop and len(self._text) > old_len:
            match = self._find_stop(old_len)
            if match is not None:
                return self._cut(*match)
        if finished:
            self._num_released = len(self._text)
            self.finished = True
        elif self.stop:
            self._num_released = max(self._num_released, len(self._text) - self._held_back_len())
        else:
            self._num_released = len(self._text)
        return None

    def _find_stop(self, old_len: int) -> Optional[tuple[str, int]]:
        """Feeds ``_text[old_len:]`` to the stop-string automata; the stop string completing earliest (the longest
        one on a tie), given that none completed before ``old_len``. Returns (stop string, length to cut ``_text``
        to), or None (the automata then hold each stop string's current match length)."""
        text = self._text
        stops, fails, state = self.stop, self._stop_fail, self._stop_state
        chars = self._stop_chars
        num_stops = len(stops)
        for pos in range(old_len, len(text)):
            ch = text[pos]
            if ch not in chars:  # no stop string holds it: every automaton falls back to 0
                if any(state):
                    state[:] = [0] * num_stops
                continue
            best = -1
            for j in range(num_stops):
                s, m = stops[j], state[j]
                while m and s[m] != ch:
                    m = fails[j][m - 1]
                if s[m] == ch:
                    m += 1
                if m == len(s):
                    if best < 0 or len(s) > len(stops[best]):
                        best = j
                    m = fails[j][m - 1]
                state[j] = m
            if best >= 0:
                s = stops[best]
                end = pos + 1
                return s, (end if self.include_stop_str_in_output else end - len(s))
        return None

    def _held_back_len(self) -> int:
        """Length of the longest suffix of `_text` (not yet released) that could begin a stop string."""
        return min(max(self._stop_state, default=0), len(self._text) - self._num_released)


def _failure_table(s: str) -> list[int]:
    """KMP failure function: ``f[i]`` = length of the longest proper prefix of ``s[:i + 1]`` that is also its
    suffix (Knuth, Morris, Pratt 1977). O(len(s)) time and memory."""
    f = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = f[k - 1]
        if s[i] == s[k]:
            k += 1
        f[i] = k
    return f


def _make_decode_fn(tokenizer, skip_special_tokens: bool):
    """The cheapest call that decodes exactly like `tokenizer.decode(ids, skip_special_tokens=...)`.

    transformers' fast tokenizers wrap a `tokenizers.Tokenizer`; calling it directly skips Python-side argument
    handling. Only valid when no Python post-processing (clean_up_tokenization_spaces) would apply.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        decode = backend.decode
        return lambda ids: decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
