"""``POST /v1/chat/completions``.

The conversation is rendered with the model's chat template (or ``--chat-template``; a request's own
``chat_template`` is refused unless the server runs with ``--trust-request-chat-template``, vLLM's flag, since a
template is code) off the event loop, its rendered size capped (``--max-chat-template-chars``), and tokenized
without adding special tokens (the template writes them), the same path
``/tokenize`` takes for ``messages``, so ``usage.prompt_tokens`` equals its ``count``.

Stream chunks (``object: "chat.completion.chunk"``, one choice per chunk, the same ``id`` throughout):
first, for each choice, ``delta: {"role": "assistant", "content": ""}``; then ``delta: {"content": ...}`` chunks;
``finish_reason`` is non-null in exactly one chunk per choice (the one with its last text); with
``stream_options.include_usage`` a last chunk with ``"choices": []`` and ``usage``; then ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator, Optional, Union

import jinja2

from pagedllm.engine.input_processor import ProcessedPrompt
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatLogProbs,
    ChatMessage,
    ChatResponseMessage,
    UsageInfo,
    random_id,
)
from pagedllm.entrypoints.openai.serving_engine import (
    SSE_DONE,
    OpenAIServing,
    OpenAIServingError,
    bad_request,
    chat_logprobs,
    merge_async_iterators,
    prompt_logprobs_json,
    sse,
    sse_error,
)
from pagedllm.entrypoints.openai.chat_tools import (
    ChoiceStream,
    merge_delta,
    messages_for_template,
    parse_choice,
    plan_tools,
)
from pagedllm.entrypoints.openai.reasoning import get_reasoning_parser, prompt_opens_think
from pagedllm.entrypoints.openai.tool_parsers import ToolParserManager
from pagedllm.sampling_params import SamplingParams
from pagedllm.tokenizer import apply_chat_template


# Arguments apply_chat_template sets itself; chat_template_kwargs may not override them.
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "chat_template", "tools", "documents", "add_generation_prompt",
    "continue_final_message", "tokenize", "return_dict", "return_tensors", "return_assistant_tokens_mask",
    "padding", "truncation", "max_length", "tokenizer_kwargs"})


class OpenAIServingChat(OpenAIServing):
    def __init__(self, engine, served_model_names, chat_template: Optional[str] = None,
                 enable_auto_tool_choice: bool = False, tool_call_parser: Optional[str] = None,
                 trust_request_chat_template: bool = False, enable_prompt_tokens_details: bool = False) -> None:
        """Raises ValueError for an unknown ``tool_call_parser`` or auto tool choice without one."""
        super().__init__(engine, served_model_names, enable_prompt_tokens_details)
        self.chat_template = chat_template if chat_template is not None else engine.config.model.chat_template
        self.trust_request_chat_template = trust_request_chat_template
        # Tools and reasoning (chat_tools.py): vLLM's --enable-auto-tool-choice / --tool-call-parser /
        # --reasoning-parser.
        if tool_call_parser is not None:
            ToolParserManager.get_tool_parser(tool_call_parser)
        if enable_auto_tool_choice and tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser.")
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.tool_call_parser = tool_call_parser
        so_config = getattr(engine.config, "structured_outputs", None)
        rp = so_config.reasoning_parser if so_config is not None else None
        self.reasoning_cls = get_reasoning_parser(rp) if rp else None

    def check_template_args(self, chat_template: Optional[str], chat_template_kwargs: Optional[dict],
                            add_generation_prompt: bool, continue_final_message: bool) -> None:
        """Raises OpenAIServingError (400) for a request template without --trust-request-chat-template, reserved
        ``chat_template_kwargs`` keys, or both ``continue_final_message`` and ``add_generation_prompt``."""
        if chat_template is not None and not self.trust_request_chat_template:
            raise OpenAIServingError("chat_template in a request is refused: the server runs without "
                                     "--trust-request-chat-template.", 400, param="chat_template",
                                     code="invalid_value")
        bad = sorted(set(chat_template_kwargs or ()) & _RESERVED_TEMPLATE_KWARGS)
        if bad:
            raise OpenAIServingError(f"chat_template_kwargs may not set {bad}.", 400, param="chat_template_kwargs",
                                     code="invalid_value")
        if continue_final_message and add_generation_prompt:
            raise OpenAIServingError(
                "continue_final_message and add_generation_prompt can't both be true (set add_generation_prompt "
                "to false to continue the final assistant message).", 400, param="continue_final_message",
                code="invalid_value")

    def render(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
               continue_final_message: bool = False, chat_template: Optional[str] = None,
               chat_template_kwargs: Optional[dict] = None, tools: Optional[list] = None) -> str:
        """The prompt text of a conversation. Raises OpenAIServingError (400) for a bad conversation/template."""
        if not messages:
            raise OpenAIServingError("messages must not be empty.", 400, param="messages", code="invalid_value")
        msgs = []
        for m in messages:
            d = m.model_dump(exclude_none=True)
            if d["role"] == "developer":  # OpenAI's newer name for the system turn
                d["role"] = "system"
            d.setdefault("content", "")
            msgs.append(d)
        msgs = messages_for_template(msgs)
        try:
            text = apply_chat_template(self.tokenizer, msgs, chat_template=chat_template or self.chat_template,
                                       add_generation_prompt=add_generation_prompt,
                                       continue_final_message=continue_final_message, tools=tools,
                                       **(chat_template_kwargs or {}))
        except (ValueError, TypeError, KeyError, AttributeError, IndexError, RecursionError,
                jinja2.TemplateError) as e:
            raise OpenAIServingError(f"chat template failed: {type(e).__name__}: {e}", 400, param="messages",
                                     code="invalid_value") from None
        if not isinstance(text, str):
            raise OpenAIServingError("chat template did not render to text.", 400, param="messages",
                                     code="invalid_value")
        cap = self.limits.max_chat_template_chars
        if len(text) > cap:
            raise OpenAIServingError(f"messages render to {len(text)} characters, more than "
                                     f"--max-chat-template-chars={cap}.", 400, param="messages",
                                     code="context_length_exceeded")
        return text

    def tokenize_messages(self, messages, add_generation_prompt=True, continue_final_message=False,
                          chat_template=None, chat_template_kwargs=None, tools=None,
                          add_special_tokens: bool = False) -> list[int]:
        text = self.render(messages, add_generation_prompt, continue_final_message, chat_template,
                           chat_template_kwargs, tools)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def prepare(self, req: ChatCompletionRequest) -> tuple[ProcessedPrompt, SamplingParams]:
        """Renders, tokenizes and validates (call it off the event loop). Raises OpenAIServingError (400)."""
        self.check_template_args(req.chat_template, req.chat_template_kwargs, req.add_generation_prompt,
                                 req.continue_final_message)
        try:
            req._tool_plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls,
                                        self.enable_auto_tool_choice, self.tool_call_parser)
        except ValueError as e:
            raise bad_request(e) from None
        text = self.render(req.messages, req.add_generation_prompt, req.continue_final_message,
                           req.chat_template, req.chat_template_kwargs, req.tools)
        req._prompt_opens_think = self.reasoning_cls is not None and prompt_opens_think(text)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        try:
            pp = self.engine.process_prompt(ids)
            pp.prompt = text  # the rendered conversation
            sp = req.to_sampling_params(self.max_model_len, len(pp.prompt_token_ids))
            tool_so = req._tool_plan.structured_outputs()
            if tool_so is not None:
                if sp.structured_outputs is not None:
                    raise ValueError("tool_choice required or a named function can't be combined with "
                                     "response_format or structured_outputs.")
                sp.structured_outputs = tool_so
            self.engine.validate_params(sp, len(pp.prompt_token_ids))
        except ValueError as e:
            err = bad_request(e, prompt_param="messages")
            if err.param == "logprobs":  # chat's logprobs is a flag; the count is top_logprobs
                err.param = "top_logprobs"
            elif err.param == "max_tokens" and req.max_completion_tokens is not None:
                err.param = "max_completion_tokens"
            raise err from None
        return pp, sp

    async def create_chat_completion(self, req: ChatCompletionRequest
                                     ) -> Union[ChatCompletionResponse, AsyncIterator[str]]:
        """A ``ChatCompletionResponse``, or (``stream``) an async iterator of SSE strings.

        Raises:
            OpenAIServingError: 400 (validation), 404 (model), 503 (engine dead), before anything runs.
        """
        model = self.check_model(req.model)
        self.check_engine()
        pp, sp = await asyncio.to_thread(self.prepare, req)  # the template and tokenizer run off the event loop
        request_id = random_id("chatcmpl")
        created = int(time.time())
        gen = self.start_requests([(pp, sp, request_id, req.cache_salt)], prompt_param="messages")[0]
        if req.stream:
            return self._stream(req, model, request_id, created, gen, len(pp.prompt_token_ids))
        final = None
        async for _, ro in merge_async_iterators([gen]):
            final = ro
        num_top = req.top_logprobs or 0
        choices = []
        for c in sorted(final.outputs, key=lambda c: c.index):
            logprobs = None
            if req.logprobs and c.logprobs is not None:
                logprobs = ChatLogProbs(**chat_logprobs(c.token_ids, c.logprobs, num_top, self.tokenizer,
                                                        req.return_tokens_as_token_ids))
            parsed = parse_choice(c.text, req._tool_plan, self.reasoning_cls, req._prompt_opens_think)
            finish = c.finish_reason
            if parsed.tool_calls and finish == "stop":
                finish = "tool_calls"
            choices.append(ChatCompletionResponseChoice(
                index=c.index, message=ChatResponseMessage(content=parsed.content, tool_calls=parsed.tool_calls,
                                                           reasoning_content=parsed.reasoning_content),
                logprobs=logprobs, finish_reason=finish, stop_reason=c.stop_reason))
        usage = self.usage(len(final.prompt_token_ids), sum(len(c.token_ids) for c in final.outputs),
                           final.num_cached_tokens)
        return ChatCompletionResponse(
            id=request_id, created=created, model=model, choices=choices, usage=UsageInfo(**usage),
            prompt_logprobs=prompt_logprobs_json(final.prompt_logprobs) if req.prompt_logprobs is not None
            else None)

    async def _stream(self, req: ChatCompletionRequest, model: str, request_id: str, created: int,
                      gen, num_prompt: int = 0) -> AsyncIterator[str]:
        num_top = req.top_logprobs or 0
        num_completion = num_cached = 0
        plan = req._tool_plan
        # Plain text needs no per-choice parsing; tools or reasoning go through a ChoiceStream each.
        streams = ({i: ChoiceStream(plan, self.reasoning_cls, req._prompt_opens_think) for i in range(req.n)}
                   if plan.mode != "none" or self.reasoning_cls is not None else None)

        def chunk(index: int, delta: dict, logprobs=None, finish_reason=None, stop_reason=None) -> str:
            event = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                     "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                  "finish_reason": finish_reason, "stop_reason": stop_reason}]}
            if req.continuous_usage:  # cumulative usage in every chunk (vLLM's continuous_usage_stats)
                event["usage"] = self.usage(num_prompt, num_completion, num_cached)
            return sse(event)

        try:
            for i in range(req.n):
                yield chunk(i, {"role": "assistant", "content": ""})
            async for _, ro in merge_async_iterators([gen]):
                num_prompt = len(ro.prompt_token_ids)
                num_cached = ro.num_cached_tokens
                for c in ro.outputs:
                    num_completion += len(c.token_ids)
                    logprobs = None
                    if req.logprobs and c.logprobs:
                        logprobs = chat_logprobs(c.token_ids, c.logprobs, num_top, self.tokenizer,
                                                 req.return_tokens_as_token_ids)
                    if streams is not None:
                        cs = streams[c.index]
                        delta = cs.feed(c.text) if c.text else {}
                        finish = c.finish_reason
                        if finish is not None:
                            merge_delta(delta, cs.finish())
                            if cs.called and finish == "stop":
                                finish = "tool_calls"
                        if not delta and finish is None and logprobs is None:
                            continue
                        yield chunk(c.index, delta, logprobs, finish, c.stop_reason)
                        continue
                    if not c.text and not c.token_ids and c.finish_reason is None and logprobs is None:
                        continue  # nothing new (a token that completes no character yet: content "", as vLLM)
                    delta = {"content": c.text} if c.text or c.finish_reason is None else {}
                    yield chunk(c.index, delta, logprobs, c.finish_reason, c.stop_reason)
            if req.include_usage:
                yield sse({"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                           "choices": [], "usage": self.usage(num_prompt, num_completion, num_cached)})
        except Exception as e:  # noqa: BLE001 - the status line is gone; report in-band
            yield sse_error(e)
        yield SSE_DONE
