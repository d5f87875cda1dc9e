"""What the completion and chat handlers share: OpenAI-shaped errors, the model check, logprob formatting,
SSE framing and merging the streams of several prompts."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any, AsyncIterator, Optional, Sequence

from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.exceptions import (
    EngineDeadError,
    EngineShuttingDownError,
    InvalidRequestError,
    QueueFullError,
    RequestFailedError,
)
from pagedllm.outputs import Logprob, RequestOutput

# ---------------------------------------------------------------------------------------------------- errors
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
                429: "rate_limit_error", 500: "server_error", 503: "server_error"}


class OpenAIServingError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with HTTP ``status``."""

    def __init__(self, message: str, status: int = 400, param: Optional[str] = None, code: Optional[str] = None,
                 err_type: Optional[str] = None, headers: Optional[dict] = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.err_type = err_type or _ERROR_TYPES.get(status, "invalid_request_error")
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.err_type, self.param, self.code)


def error_body(message: str, err_type: str, param: Optional[str] = None, code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


_FIELD_RE = re.compile(r"^([a-z_][a-z0-9_]*)\b")


def bad_request(e: Exception, prompt_param: str = "prompt") -> OpenAIServingError:
    """A 400 for a ``ValueError`` from validation; ``param`` is the field the message starts with."""
    msg = str(e)
    if isinstance(e, InvalidRequestError) and e.param is not None:
        param, code = e.param, e.code
    else:
        m = _FIELD_RE.match(msg)
        param = m.group(1) if m else None
        code = "context_length_exceeded" if "max_model_len" in msg else "invalid_value"
    if param in ("prompt", "prompt_token_ids"):
        param = prompt_param
    return OpenAIServingError(msg, 400, param=param, code=code)


def engine_error(e: BaseException) -> OpenAIServingError:
    """The answer for an exception from the engine side (dead engine 503, full queue 429, a request that failed
    alone 500)."""
    if isinstance(e, OpenAIServingError):
        return e
    if isinstance(e, EngineDeadError):
        return OpenAIServingError(str(e), 503, code="engine_dead")
    if isinstance(e, EngineShuttingDownError):
        return OpenAIServingError(str(e), 503, code="shutting_down")
    if isinstance(e, QueueFullError):
        return OpenAIServingError(str(e), 429, code="queue_full",
                                  headers={"Retry-After": str(max(1, int(e.retry_after_s)))})
    if isinstance(e, RequestFailedError):
        return OpenAIServingError(str(e), 500, code="request_failed")
    return OpenAIServingError(f"internal error: {type(e).__name__}: {e}", 500, code="internal_error")


# ---------------------------------------------------------------------------------------------------- SSE
def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def sse_error(e: BaseException) -> str:
    """The event sent for an error after a stream has started (then ``[DONE]`` follows)."""
    if isinstance(e, OpenAIServingError):
        err = e
    elif isinstance(e, ValueError):
        err = bad_request(e)
    else:
        err = engine_error(e)
    return sse(err.body())


# ---------------------------------------------------------------------------------------------------- logprobs
def clamp_logprob(v: float) -> float:
    """JSON has no -inf; OpenAI-compatible servers report -9999.0 instead."""
    if v != v:  # NaN
        return -9999.0
    return max(float(v), -9999.0)


def token_text(tid: int, lp: Optional[Logprob], tokenizer, as_token_id: bool = False) -> str:
    """A token's text in logprobs; ``"token_id:N"`` with vLLM's ``return_tokens_as_token_ids``."""
    if as_token_id:
        return f"token_id:{tid}"
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return tokenizer.decode([tid])


_BYTE_TOKEN_RE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_byte_decoder_table: Optional[dict[str, int]] = None


def _byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's byte-level BPE alphabet (bytes 0-255 shown as printable characters: the printable
    Latin-1 ranges map to themselves, the other 68 bytes to U+0100 onward, in byte order; Radford et al. 2019)."""
    global _byte_decoder_table
    if _byte_decoder_table is None:
        keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
        table, n = {}, 0
        for b in range(256):
            if b in keep:
                table[chr(b)] = b
            else:
                table[chr(256 + n)] = b
                n += 1
        _byte_decoder_table = table
    return _byte_decoder_table


def token_bytes(tid: int, text: str, tokenizer) -> list[int]:
    """The UTF-8 bytes a token contributes (OpenAI's ``bytes``). For a token holding part of a character its text
    decodes to U+FFFD; its own bytes come from the vocabulary entry instead: a ``<0xNN>`` byte token
    (SentencePiece) or a byte-level BPE string (GPT-2's alphabet)."""
    if "\ufffd" not in text:
        return list(text.encode("utf-8"))
    try:
        piece = tokenizer.convert_ids_to_tokens(tid)
    except Exception:  # noqa: BLE001 - no vocabulary entry: fall back to the text
        piece = None
    if isinstance(piece, str) and piece:
        m = _BYTE_TOKEN_RE.match(piece)
        if m:
            return [int(m.group(1), 16)]
        table = _byte_decoder()
        if all(ch in table for ch in piece):
            return [table[ch] for ch in piece]
    return list(text.encode("utf-8"))


def completion_logprobs(token_ids: Sequence[int], logprobs: Sequence[Optional[dict[int, Logprob]]],
                        num_top: int, tokenizer, initial_text_offset: int = 0, as_token_ids: bool = False) -> dict:
    """The completions API's logprobs: ``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``.

    ``logprobs[i]`` holds the sampled token first, then the top ``num_top`` by rank; ``None`` (the first prompt
    token, which has no logprob) gives ``null`` entries.
    """
    tokens, token_lps, tops, offsets = [], [], [], []
    offset = initial_text_offset
    for tid, d in zip(token_ids, logprobs):
        lp = d.get(tid) if d is not None else None
        text = token_text(tid, lp, tokenizer, as_token_ids)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if d is None:
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(clamp_logprob(lp.logprob) if lp is not None else None)
        top: dict[str, float] = {}
        for t, v in d.items():
            if t == tid or (v.rank is not None and v.rank <= num_top):
                top.setdefault(token_text(t, v, tokenizer, as_token_ids), clamp_logprob(v.logprob))
        tops.append(top)
    return {"text_offset": offsets, "token_logprobs": token_lps, "tokens": tokens, "top_logprobs": tops}


def chat_logprobs(token_ids: Sequence[int], logprobs: Sequence[dict[int, Logprob]], num_top: int,
                  tokenizer, as_token_ids: bool = False) -> dict:
    """The chat API's ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``; ``bytes`` are the
    token's own bytes (``token_bytes``)."""
    content = []
    for tid, d in zip(token_ids, logprobs):
        lp = d.get(tid)
        text = token_text(tid, lp, tokenizer)
        top = []
        if num_top:
            # Ties (equal logprobs share a rank) list the sampled token first.
            ranked = sorted((v.rank, t != tid, t, v) for t, v in d.items()
                            if v.rank is not None and v.rank <= num_top)
            for _, _, t, v in ranked[:num_top]:
                s = token_text(t, v, tokenizer)
                top.append({"token": f"token_id:{t}" if as_token_ids else s, "logprob": clamp_logprob(v.logprob),
                            "bytes": token_bytes(t, s, tokenizer)})
        content.append({"token": f"token_id:{tid}" if as_token_ids else text,
                        "logprob": clamp_logprob(lp.logprob) if lp is not None else -9999.0,
                        "bytes": token_bytes(tid, text, tokenizer), "top_logprobs": top})
    return {"content": content}


def prompt_logprobs_json(prompt_logprobs: Optional[list]) -> Optional[list]:
    """vLLM's ``prompt_logprobs``: per prompt position ``None`` or ``{token_id: {logprob, rank, decoded_token}}``."""
    if prompt_logprobs is None:
        return None
    return [None if d is None else {
        tid: {"logprob": clamp_logprob(v.logprob), "rank": v.rank, "decoded_token": v.decoded_token}
        for tid, v in d.items()} for d in prompt_logprobs]


# ---------------------------------------------------------------------------------------------------- shared base
class OpenAIServing:
    def __init__(self, engine: AsyncLLM, served_model_names: Sequence[str],
                 enable_prompt_tokens_details: bool = False) -> None:
        self.engine = engine
        self.served_model_names = list(served_model_names)
        self.model_name = self.served_model_names[0]
        # The model's path as given at start-up (its card's ``root``) names it too: vLLM's served name defaults to
        # that path, so clients written for vLLM send it (``vllm bench serve`` sends the card's root to /tokenize).
        self.model_root = engine.config.model.model
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.config.model.max_model_len
        self.limits = engine.input_processor.limits
        # cached_tokens tells whether someone else recently sent the same prefix: only with vLLM's
        # --enable-prompt-tokens-details.
        self.enable_prompt_tokens_details = enable_prompt_tokens_details

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
        return usage_dict(prompt_tokens, completion_tokens,
                          cached_tokens if self.enable_prompt_tokens_details else None)

    def start_requests(self, specs: Sequence[tuple], prompt_param: str = "prompt") -> list:
        """``engine.add_request(*spec)`` for each spec, all or none: if one is refused the started ones are
        aborted. Raises OpenAIServingError (400, 429, 503)."""
        streams = []
        try:
            for spec in specs:
                streams.append(self.engine.add_request(*spec[:3], cache_salt=spec[3]))
        except BaseException as e:
            for st in streams:
                self.engine.abort_stream(st.request_id)
            if isinstance(e, ValueError):
                raise bad_request(e, prompt_param) from None
            if isinstance(e, Exception):
                raise engine_error(e) from None
            raise
        return streams

    def check_model(self, model: Optional[str]) -> str:
        """Returns the model name to report (the served name for ``None`` or the model's root path). Raises 404 for
        a model this server doesn't serve."""
        if model is None or model == self.model_root:
            return self.model_name
        if model in self.served_model_names:
            return model
        raise OpenAIServingError(f"The model `{model}` does not exist.", 404, param="model",
                                 code="model_not_found")

    def check_engine(self) -> None:
        if self.engine.is_dead:
            raise engine_error(self.engine.dead_error)


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: Optional[int]) -> dict:
    """OpenAI's usage object; ``prompt_tokens_details`` only when ``cached_tokens`` is reported (not None)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": None if cached_tokens is None else {"cached_tokens": cached_tokens}}


async def merge_async_iterators(iterators: Sequence[AsyncIterator[RequestOutput]]
                                ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yields ``(i, item)`` from all iterators as items arrive. Closing this closes (and so aborts) them all."""
    if len(iterators) == 1:
        it = iterators[0]
        try:
            async for item in it:
                yield 0, item
        finally:
            await it.aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def drain(i: int, it: AsyncIterator) -> None:
        try:
            async for item in it:
                queue.put_nowait((i, item))
        except Exception as e:  # noqa: BLE001 - re-raised by the consumer
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, done))
            await it.aclose()  # an unfinished request is aborted

    tasks = [asyncio.ensure_future(drain(i, it)) for i, it in enumerate(iterators)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
