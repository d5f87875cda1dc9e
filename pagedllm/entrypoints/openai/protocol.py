"""Pydantic models of the OpenAI-compatible API (request bodies, responses, stream chunks, errors).

Field names and defaults follow the OpenAI API, plus vLLM's extra sampling fields. Range checks live in
``SamplingParams`` (one place, naming the field); these models check types and shapes. Unknown request fields are
ignored, as OpenAI-compatible servers do.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from pagedllm.sampling_params import RequestOutputKind, SamplingParams


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


# ---------------------------------------------------------------------------------------------------- errors
class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[Union[str, int]] = None


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


# ---------------------------------------------------------------------------------------------------- shared
class StreamOptions(OpenAIBaseModel):
    include_usage: Optional[bool] = False
    continuous_usage_stats: Optional[bool] = False


class PromptTokenUsageInfo(OpenAIBaseModel):
    cached_tokens: Optional[int] = None


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: Optional[PromptTokenUsageInfo] = None


class ModelCard(OpenAIBaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedllm"
    root: Optional[str] = None
    parent: Optional[str] = None
    max_model_len: Optional[int] = None
    architecture: Optional[str] = None  # e.g. "LlamaForCausalLM", as read from the model file


class ModelList(OpenAIBaseModel):
    object: str = "list"
    data: list[ModelCard] = Field(default_factory=list)


class _SamplingFields(OpenAIBaseModel):
    """Sampling fields shared by completions and chat (OpenAI's and vLLM's extras)."""

    model: Optional[str] = None
    n: int = 1
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stop: Optional[Union[str, list[str]]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[dict[str, float]] = None
    seed: Optional[int] = None
    user: Optional[str] = None
    # vLLM extras
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    prompt_logprobs: Optional[int] = None
    allowed_token_ids: Optional[list[int]] = None
    cache_salt: Optional[str] = None
    return_tokens_as_token_ids: bool = False  # logprobs name tokens "token_id:N" (vLLM's extension)
    # Structured outputs (see structured_fields.py): vLLM's object and its legacy fields; response_format below.
    structured_outputs: Optional[dict[str, Any]] = None
    guided_json: Optional[Union[str, dict[str, Any]]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    response_format: Optional[dict[str, Any]] = None

    # Unknown fields are kept (model_extra) so that structured_fields.check_unknown_fields can refuse or log them.
    model_config = ConfigDict(extra="allow")

    def _sampling_params(self, max_tokens: Optional[int], logprobs: Optional[int]) -> SamplingParams:
        """Raises ValueError naming the field."""
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true.")
        if self.cache_salt is not None and not self.cache_salt:
            raise ValueError("cache_salt must be a non-empty string.")
        logit_bias = None
        if self.logit_bias is not None:
            logit_bias = {}
            for k, v in self.logit_bias.items():
                try:
                    logit_bias[int(k)] = float(v)
                except ValueError:
                    raise ValueError(f"logit_bias keys must be token ids, got {k!r}.") from None
                if not -100.0 <= v <= 100.0:
                    raise ValueError(f"logit_bias values must be in [-100, 100], got {v!r}.")
        from pagedllm.entrypoints.openai.structured_fields import (
            check_unknown_fields,
            structured_outputs_from_request,
        )

        check_unknown_fields(self.model_extra)
        return SamplingParams(
            structured_outputs=structured_outputs_from_request(self),
            n=self.n,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=logit_bias,
            allowed_token_ids=self.allowed_token_ids,
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Cumulative usage in every stream chunk (vLLM's ``stream_options.continuous_usage_stats``)."""
        return bool(self.stream and self.stream_options and self.stream_options.continuous_usage_stats)


# ---------------------------------------------------------------------------------------------------- completions
class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    echo: bool = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None

    def to_sampling_params(self, max_model_len: int, num_prompt_tokens: int) -> SamplingParams:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of is not supported (it must be None or equal n), got {self.best_of!r}.")
        if self.suffix:
            raise ValueError("suffix is not supported.")
        max_tokens = self.max_tokens
        if max_tokens is None:
            max_tokens = max(max_model_len - num_prompt_tokens, 1)
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None:
            # The echoed prompt carries logprobs too (OpenAI's behaviour).
            prompt_logprobs = max(self.logprobs, prompt_logprobs or 0)
        params = self._sampling_params(max_tokens, self.logprobs)
        if prompt_logprobs is not None and prompt_logprobs != params.prompt_logprobs:
            params.prompt_logprobs = prompt_logprobs
        return params


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    prompt_logprobs: Optional[list[Optional[dict[int, Any]]]] = None


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: Optional[str] = None


# ---------------------------------------------------------------------------------------------------- chat
class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[dict[str, Any]]]] = None
    name: Optional[str] = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: Optional[int] = None
    max_tokens: Optional[int] = None  # deprecated by OpenAI in favour of max_completion_tokens
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = True
    # vLLM extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    # Set by the chat handler: what this request does with tools, and whether its prompt opened a <think>.
    _tool_plan: Any = PrivateAttr(default=None)
    _prompt_opens_think: bool = PrivateAttr(default=False)

    def to_sampling_params(self, max_model_len: int, num_prompt_tokens: int) -> SamplingParams:
        """Raises ValueError naming the field."""
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt can't both be true (set "
                             "add_generation_prompt to false to continue the final assistant message).")
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise ValueError("top_logprobs needs logprobs set to true.")
            if self.top_logprobs < 0:
                raise ValueError(f"top_logprobs must be >= 0, got {self.top_logprobs}.")
        max_tokens = self.max_completion_tokens
        if max_tokens is None:
            max_tokens = self.max_tokens  # deprecated name
        if max_tokens is None:
            max_tokens = max(max_model_len - num_prompt_tokens, 1)
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs)


class ChatLogProb(OpenAIBaseModel):
    token: str
    logprob: float = -9999.0
    bytes: Optional[list[int]] = None


class ChatLogProbsContent(ChatLogProb):
    top_logprobs: list[ChatLogProb] = Field(default_factory=list)


class ChatLogProbs(OpenAIBaseModel):
    content: Optional[list[ChatLogProbsContent]] = None


class ChatResponseMessage(OpenAIBaseModel):
    role: str = "assistant"
    content: Optional[str] = None
    reasoning_content: Optional[str] = None  # with --reasoning-parser
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: Optional[str] = None
    prompt_logprobs: Optional[list[Optional[dict[int, Any]]]] = None


# ---------------------------------------------------------------------------------------------------- tokenize
class TokenizeCompletionRequest(OpenAIBaseModel):
    model: Optional[str] = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(OpenAIBaseModel):
    model: Optional[str] = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    tools: Optional[list[dict[str, Any]]] = None


TokenizeRequest = Union[TokenizeCompletionRequest, TokenizeChatRequest]


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = None


class DetokenizeRequest(OpenAIBaseModel):
    model: Optional[str] = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
