"""Engine configuration: flat ``EngineArgs`` (vLLM's names) -> frozen ``EngineConfig``.

Values found at start-up (number of KV blocks, EOS ids, the HF config) are computed in ``EngineArgs.create_engine_config``
and ``determine_num_blocks`` and passed in; nothing patches a config afterwards.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Optional

GiB = 1 << 30

# Default KV cache size on CPU. vLLM-CPU defaults VLLM_CPU_KVCACHE_SPACE to 4 GiB; this 2-core/24 GiB machine runs
# several engines in tests, so we default to 2 GiB (about 93k tokens of SmolLM2-135M in bf16).
DEFAULT_KV_CACHE_MEMORY_BYTES = 2 * GiB


@dataclass(frozen=True)
class ModelConfig:
    """What to run. ``hf_config`` is a ``transformers.PretrainedConfig`` (from config.json or GGUF metadata)."""

    model: str  # path: a GGUF file or a Hugging Face folder
    tokenizer: str
    served_model_name: str
    dtype: Any  # torch.dtype
    max_model_len: int  # tokens (prompt + output)
    hf_config: Any
    architecture: str
    vocab_size: int
    max_logprobs: int = 20
    seed: int = 0
    chat_template: Optional[str] = None
    is_gguf: bool = False
    skip_tokenizer_init: bool = False  # no tokenizer: prompts must be token ids and no text is produced
    quantization: Any = None  # a layers.quantization.QuantConfig (None: dense in dtype)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16  # tokens per KV block
    num_blocks: int = 0  # physical KV blocks, including the null block 0 (set at start-up)
    kv_cache_memory_bytes: int = DEFAULT_KV_CACHE_MEMORY_BYTES
    enable_prefix_caching: bool = True


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256  # running requests per step
    max_num_batched_tokens: int = 2048  # tokens computed per step (the token budget)
    max_model_len: int = 8192
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # the most prompt tokens one request computes in a step (0: no cap)


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # "mp": the engine starts one worker process per rank; "external_launcher": this process is one rank of a
    # torchrun (or --nnodes/--node-rank) launch and runs the whole engine itself (see pagedllm.executor).
    distributed_executor_backend: str = "mp"
    distributed_init_method: Optional[str] = None  # e.g. tcp://10.0.0.1:29500 (default: a free local port)
    nnodes: int = 1
    node_rank: int = 0
    # Pipeline parallel: micro-batches in flight at once (1: one step at a time, every stage waits for the others).
    max_in_flight_batches: int = 1

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1 or self.distributed_executor_backend == "external_launcher"


SPEC_METHODS = ("ngram", "self_int4", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (``--speculative-config``, ``LLM(speculative_config=...)``; vLLM's keys).

    ``method`` ``ngram`` is prompt lookup (Saxena 2023, "Prompt Lookup Decoding"): the last ``prompt_lookup_min`` ..
    ``prompt_lookup_max`` tokens are matched against the request's prompt and output so far and the tokens that
    followed the match are proposed, at most ``num_speculative_tokens`` of them. vLLM's defaults: when neither bound
    is given both are 5; when one is given the other equals it.

    ``disable_by_batch_size``: no draft tokens are scheduled in a step that starts with more running requests than
    this (vLLM's key; unset: never). ``step_token_budget`` (ours): drafts only fill a step up to this many tokens in
    all, shared evenly: with ``R`` running requests each may verify ``(budget - R) // R`` drafts (budget 8: 7 drafts
    at 1 request, 3 at 2, 1 at 3-4, none from 5 on). A decode step on a CPU costs about the same up to a few rows
    (its weights are read once; int4 weights take the integer GEMV kernel up to 8 rows,
    ``layers/quantization/kernels.py``) and then more per row, so under load speculation steps aside by itself.
    ``adaptive`` (ours): each request's number of draft tokens follows its recent acceptance
    (``pagedllm.spec_decode.adaptive``); off: always as many as allowed when a proposal is that long.
    ``cost_aware`` (ours, with ``adaptive``): the share also weighs what a draft token costs on this machine, timed
    by the runner on single-stream steps (``adaptive.StepCosts``; one plain step in ``CALIBRATE_EVERY``), so
    speculation turns itself off where it can't pay; off (the default): the fixed rule (a draft pays when
    ``a ** k >= 0.2``). Opt-in because it measured worse than the fixed rule on its first real run (1.5B Q4_K_M,
    0.5B draft, Xeon with AMX, ``bench speculative --dataset-name chat``: 0.83x against 0.98x): the drafter's
    seconds per token include its catch-up forward, which a small share makes dear, so the share shrinks further.

    ``method`` ``draft_model``: a second, smaller model with the target's vocabulary drafts (``model``: its GGUF
    file or HF folder; vLLM infers the method when only ``model`` is given). It loads like the target (a GGUF
    draft runs its quant types as stored; ``quantization``: the draft's, default auto) in the target's dtype, and
    keeps its own paged KV cache indexed by the target's block tables (``pagedllm.spec_decode.draft_model``); its
    bytes per block are counted in the KV budget with the target's (``determine_num_blocks``).
    ``draft_tensor_parallel_size``: vLLM's key, only 1 here. ``draft_model_config`` (not a key): the draft's
    ``ModelConfig``, resolved in ``EngineArgs.create_engine_config``, which checks the path, that the vocabulary
    sizes are equal and that the draft's max positions cover ``max_model_len`` (``ValueError`` naming
    ``speculative_config.model``). ``method`` ``self_int4``: the target drafts with an int4 copy of its own bf16
    weights (``pagedllm.spec_decode.self_int4``), its KV counted the same way.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    disable_by_batch_size: Optional[int] = None
    adaptive: bool = True
    cost_aware: bool = False
    step_token_budget: int = 8
    model: Optional[str] = None  # draft_model: the draft's GGUF file or HF folder
    quantization: Optional[str] = None  # draft_model: the draft's --quantization (None: auto)
    draft_tensor_parallel_size: Optional[int] = None  # vLLM's key; 1 (or unset) only
    draft_model_config: Any = None  # draft_model: its ModelConfig, resolved at start-up (not a key)

    @classmethod
    def from_dict(cls, d: Any) -> "SpeculativeConfig":
        """Builds the config from vLLM's JSON/dict form (a JSON string is parsed first).

        Raises:
            ValueError: naming ``speculative_config`` and the bad key (unknown key, wrong type, bad range).
        """
        import json

        if isinstance(d, cls):
            return d
        if isinstance(d, str):
            try:
                d = json.loads(d)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(d).__name__}.")
        known = {f.name for f in dataclasses.fields(cls)} - {"draft_model_config"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; known: {sorted(known)}.")
        # vLLM: a draft model given without a method is a draft model; "[ngram]" is its older spelling of ngram
        method = d.get("method", "draft_model" if d.get("model") is not None else "ngram")
        if method == "[ngram]":
            method = "ngram"
        if method not in SPEC_METHODS:
            raise ValueError(f"speculative_config.method must be one of {list(SPEC_METHODS)}, got {method!r}.")

        def int_key(name: str, lo: int, default: Optional[int]) -> Optional[int]:
            v = d.get(name, default)
            if v is None:
                return None
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= 1 << 20:
                raise ValueError(f"speculative_config.{name} must be an integer >= {lo}, got {v!r}.")
            return v

        if "num_speculative_tokens" not in d:
            raise ValueError("speculative_config.num_speculative_tokens is required.")
        k = int_key("num_speculative_tokens", 1, None)
        if k > 64:
            raise ValueError(f"speculative_config.num_speculative_tokens must be at most 64, got {k}.")
        lo = int_key("prompt_lookup_min", 1, None)
        hi = int_key("prompt_lookup_max", 1, None)
        if lo is None and hi is None:
            lo = hi = 5
        lo = hi if lo is None else lo
        hi = lo if hi is None else hi
        if lo > hi:
            raise ValueError(f"speculative_config.prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi}).")
        adaptive, cost_aware = d.get("adaptive", True), d.get("cost_aware", False)
        for name, v in (("adaptive", adaptive), ("cost_aware", cost_aware)):
            if not isinstance(v, bool):
                raise ValueError(f"speculative_config.{name} must be true or false, got {v!r}.")
        model = d.get("model")
        if method == "draft_model":
            if not isinstance(model, str) or not model:
                raise ValueError("speculative_config.model (the draft's GGUF file or HF folder) is required for "
                                 "method 'draft_model'.")
            model = os.path.expanduser(model)
            if not os.path.exists(model):
                raise ValueError(f"speculative_config.model {model!r} not found: give a GGUF file or a Hugging Face "
                                 f"model folder.")
        elif model is not None:
            raise ValueError(f"speculative_config.model is only for method 'draft_model', not {method!r}.")
        quantization = d.get("quantization")
        if quantization is not None and (method != "draft_model" or not isinstance(quantization, str)):
            raise ValueError(f"speculative_config.quantization must be a string, for method 'draft_model' only; "
                             f"got {quantization!r}.")
        dtp = int_key("draft_tensor_parallel_size", 1, None)
        if dtp not in (None, 1):
            raise ValueError(f"speculative_config.draft_tensor_parallel_size must be 1 here, got {dtp}.")
        return cls(method=method, num_speculative_tokens=k, prompt_lookup_min=lo, prompt_lookup_max=hi,
                   disable_by_batch_size=int_key("disable_by_batch_size", 1, None), adaptive=adaptive,
                   cost_aware=cost_aware,
                   step_token_budget=int_key("step_token_budget", 2, 8), model=model, quantization=quantization,
                   draft_tensor_parallel_size=dtp)

    def with_draft_model_config(self, target: "ModelConfig") -> "SpeculativeConfig":
        """This config with ``draft_model_config`` resolved for ``target`` (the target's ``ModelConfig``); itself
        for other methods. The draft runs in the target's dtype with its own max positions.

        Raises:
            ValueError: naming ``speculative_config.model``: vocabulary sizes differ (both given), the draft's
                max positions are fewer than the target's ``max_model_len``, or its architecture is unsupported.
        """
        if self.method != "draft_model":
            return self
        from pagedllm.layers.quantization import resolve_quant_config
        from pagedllm.model_loader.hf_config import get_architecture, load_hf_config
        from pagedllm.models.registry import get_model_class

        hf_config = load_hf_config(self.model)
        architecture = get_architecture(hf_config)
        try:
            cls = get_model_class(architecture)
        except ValueError as e:
            raise ValueError(f"speculative_config.model {self.model!r}: {e}") from None
        vocab_size = int(hf_config.vocab_size)
        if vocab_size != target.vocab_size:
            raise ValueError(f"speculative_config.model {self.model!r} has a vocabulary of {vocab_size} tokens, the "
                             f"target {target.vocab_size}: a draft model must share the target's vocabulary.")
        max_pos = getattr(hf_config, "max_position_embeddings", None) or 8192
        if max_pos < target.max_model_len:
            raise ValueError(f"speculative_config.model {self.model!r} has max_position_embeddings={max_pos}, below "
                             f"max_model_len={target.max_model_len}: lower --max-model-len.")
        quant = resolve_quant_config(self.quantization, self.model, hf_config, cls, 1)
        draft = ModelConfig(model=self.model, tokenizer=target.tokenizer, served_model_name=self.model,
                            dtype=target.dtype, max_model_len=target.max_model_len, hf_config=hf_config,
                            architecture=architecture, vocab_size=vocab_size,
                            is_gguf=self.model.endswith(".gguf"), skip_tokenizer_init=True, quantization=quant)
        return dataclasses.replace(self, draft_model_config=draft)
STRUCTURED_OUTPUT_BACKENDS = ("xgrammar",)
# The names pagedllm.entrypoints.openai.reasoning registers (a test keeps the two in step).
REASONING_PARSERS = ("deepseek_r1", "qwen3")


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """``--structured-outputs-config`` (vLLM 0.32's keys) plus ``--reasoning-parser``.

    ``disable_any_whitespace`` defaults to True here (vLLM: False): JSON grammars are compiled without arbitrary
    whitespace, so a small model can't emit spaces until ``max_tokens`` inside a constrained answer; a request opts
    into the permissive form with ``structured_outputs.disable_any_whitespace = false``.
    """

    backend: str = "xgrammar"
    disable_any_whitespace: bool = True
    disable_fallback: bool = False
    disable_additional_properties: bool = False
    reasoning_parser: Optional[str] = None
    max_compile_threads: int = 2  # grammar compilation runs in this many threads, off the engine thread
    # Ours: how long the step that samples a request's first token may wait, after its forward pass, for that
    # request's grammar to finish compiling (else the request samples in a later step; structured_output/manager.py).
    max_sample_wait_ms: float = 20.0
    # Ours: the compile threads' nice value (Linux; 0 = the engine's own priority). A compile competing at equal
    # priority with the forward pass's OpenMP threads stalls both of them (a descheduled thread holds the other at
    # the barrier); niced, it runs in the gaps and in the wait above, when the cores are free.
    compile_thread_nice: int = 10

    @classmethod
    def parse(cls, value: Any, reasoning_parser: Optional[str] = None) -> "StructuredOutputsConfig":
        """From a dict, its JSON text or None.

        Raises:
            ValueError: naming ``structured_outputs_config`` for bad JSON, an unknown key or backend.
        """
        import json

        if value is None:
            value = {}
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ValueError(f"structured_outputs_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"structured_outputs_config must be a JSON object, got {value!r}.")
        value = dict(value)
        if value.get("backend") in (None, "auto"):
            value["backend"] = "xgrammar"
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(value) - names
        if unknown:
            raise ValueError(f"structured_outputs_config has unknown keys {sorted(unknown)}; known: {sorted(names)}.")
        if value["backend"] not in STRUCTURED_OUTPUT_BACKENDS:
            raise ValueError(f"structured_outputs_config backend must be one of {STRUCTURED_OUTPUT_BACKENDS}, "
                             f"got {value['backend']!r}.")
        w = value.get("max_sample_wait_ms", 20.0)
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 <= w <= 1000:
            raise ValueError(f"structured_outputs_config max_sample_wait_ms must be a number in [0, 1000], got {w!r}.")
        nice = value.get("compile_thread_nice", 10)
        if isinstance(nice, bool) or not isinstance(nice, int) or not 0 <= nice <= 19:
            raise ValueError(f"structured_outputs_config compile_thread_nice must be an integer in [0, 19], got "
                             f"{nice!r}.")
        if reasoning_parser is not None:
            value["reasoning_parser"] = reasoning_parser
        if value.get("reasoning_parser") not in (None, *REASONING_PARSERS):
            raise ValueError(f"reasoning_parser must be one of {REASONING_PARSERS}, got "
                             f"{value['reasoning_parser']!r}.")
        return cls(**value)


@dataclass(frozen=True)
class InputLimits:
    """Bounds every request is checked against once, by ``engine.input_processor.InputProcessor`` (and, for the
    HTTP body, by the server's body guard). The README's "Request bounds" table lists each with its flag.

    0 / None means "no bound" only where noted."""

    max_n: int = 128  # choices per request (OpenAI's cap)
    max_num_stop_strings: int = 64
    max_stop_string_len: int = 1024  # characters, each stop string
    max_num_stop_token_ids: int = 1024
    max_num_logit_bias: int = 1024  # logit_bias entries
    max_num_allowed_token_ids: int = 4096  # also bounds the sampler's per-step mask building
    max_cache_salt_len: int = 1024  # characters
    max_num_prompts: int = 1024  # prompts in one completions request (vLLM's cap)
    max_request_body_bytes: int = 16 << 20  # HTTP body; 413 past it, checked before parsing
    max_chat_template_chars: int = 1 << 20  # rendered chat prompt, characters
    # Admission queue (vLLM's names): requests (children of n > 1 count one each) and prompt tokens admitted but
    # not yet producing output; past either the server answers 429 with Retry-After. 0: unbounded.
    max_num_queued_reqs: int = 1024
    max_num_queued_tokens: int = 1 << 20


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: Optional[SpeculativeConfig] = None  # None: no speculative decoding
    structured_outputs: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    limits: InputLimits = field(default_factory=InputLimits)
    # Which CPU kernels run (ISA level and switches), resolved once at start-up; see pagedllm.kernels.config.
    kernel: Any = None  # a pagedllm.kernels.KernelConfig (None: resolve from the environment)


def resolve_dtype(dtype: str, hf_config: Any = None, cpu_isa: Optional[str] = None):
    """Maps ``auto``/``bfloat16``/``bf16``/``float16``/``float32``/``fp32`` to a torch dtype.

    ``auto`` is bfloat16 on CUDA and at every CPU ISA level with our bf16 kernels (``amx``, ``avx512_bf16``, ``avx2``;
    ``cpu_isa``, default the detected level), float32 at level ``none`` (torch alone, whose bf16 matmuls are emulated
    where oneDNN has no native bf16). At ``avx2`` bf16 runs on our AVX2 kernels (dpbf16 linear, int4 integer-dot
    GEMV, decode attention): on an EPYC Zen 3, SmolLM2 decode at batch 1 takes ~3x less time than in float32, whose
    linears are MKL's float32 GEMV over twice the bytes.

    Raises:
        ValueError: naming ``dtype`` for an unknown value.
    """
    import torch

    d = str(dtype).lower().replace("torch.", "")
    table = {
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "half": torch.float16,
        "fp16": torch.float16,
        "float32": torch.float32,
        "float": torch.float32,
        "fp32": torch.float32,
    }
    if d == "auto":
        if torch.cuda.is_available():
            return torch.bfloat16
        from pagedllm.kernels.config import check_level

        return torch.bfloat16 if check_level(cpu_isa) in ("amx", "avx512_bf16", "avx2") else torch.float32
    if d not in table:
        raise ValueError(f"dtype must be one of auto, bfloat16, float16, float32; got {dtype!r}.")
    return table[d]


@dataclass
class EngineArgs:
    """Flat engine arguments with vLLM's names (``LLM(**kwargs)`` and the CLI flags map onto these)."""

    model: Optional[str] = None
    tokenizer: Optional[str] = None
    served_model_name: Optional[str] = None
    dtype: str = "auto"
    max_model_len: Optional[int] = None
    max_num_seqs: int = 256
    max_num_batched_tokens: Optional[int] = None
    block_size: int = 16
    kv_cache_memory_bytes: Optional[int] = None
    num_gpu_blocks_override: Optional[int] = None  # vLLM's name for an explicit KV block count
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # vLLM's: a prompt's chunk per step at most this (0: off)
    max_logprobs: int = 20
    seed: int = 0
    chat_template: Optional[str] = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str = "mp"
    distributed_init_method: Optional[str] = None
    nnodes: int = 1
    node_rank: int = 0
    # Pipeline parallel: micro-batches in flight. 1 by default: on CPU a decode step of half the batch costs about as
    # much as the whole batch, so splitting it doubles the work (see README, "Tensor and pipeline parallelism").
    max_in_flight_batches: int = 1
    trust_remote_code: bool = False
    skip_tokenizer_init: bool = False
    quantization: Optional[str] = None  # auto (None) | none | gguf | gptq | awq | int8
    speculative_config: Optional[Any] = None  # a dict / JSON string with vLLM's keys (SpeculativeConfig.from_dict)
    structured_outputs_config: Optional[Any] = None  # dict or JSON text, see StructuredOutputsConfig
    reasoning_parser: Optional[str] = None  # deepseek_r1 | qwen3: structured outputs start after </think>
    cpu_isa: Optional[str] = None  # auto (None) | amx | avx512_bf16 | avx2 | none: force a lower kernel ISA level
    # Request bounds (see InputLimits and the README's "Request bounds" table).
    max_n: int = InputLimits.max_n
    max_num_stop_strings: int = InputLimits.max_num_stop_strings
    max_stop_string_len: int = InputLimits.max_stop_string_len
    max_num_stop_token_ids: int = InputLimits.max_num_stop_token_ids
    max_num_logit_bias: int = InputLimits.max_num_logit_bias
    max_num_allowed_token_ids: int = InputLimits.max_num_allowed_token_ids
    max_cache_salt_len: int = InputLimits.max_cache_salt_len
    max_num_prompts: int = InputLimits.max_num_prompts
    max_request_body_bytes: int = InputLimits.max_request_body_bytes
    max_chat_template_chars: int = InputLimits.max_chat_template_chars
    max_num_queued_reqs: int = InputLimits.max_num_queued_reqs
    max_num_queued_tokens: int = InputLimits.max_num_queued_tokens

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    def _verify(self) -> None:
        def pos(name: str, allow_none: bool = True) -> None:
            v = getattr(self, name)
            if v is None and allow_none:
                return
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}.")

        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size",
                     "kv_cache_memory_bytes", "num_gpu_blocks_override", "max_logprobs",
                     "tensor_parallel_size", "pipeline_parallel_size"):
            pos(name)
        pos("max_in_flight_batches", allow_none=False)
        t = self.long_prefill_token_threshold
        if not isinstance(t, int) or isinstance(t, bool) or t < 0:
            raise ValueError(f"long_prefill_token_threshold must be a non-negative integer, got {t!r}.")
        if t and not self.enable_chunked_prefill:
            raise ValueError("long_prefill_token_threshold needs chunked prefill (a prompt it cuts spans several "
                             "steps); drop --no-enable-chunked-prefill or the threshold.")
        for f in dataclasses.fields(InputLimits):
            v = getattr(self, f.name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0 or (v == 0 and not f.name.startswith(
                    "max_num_queued")):
                raise ValueError(f"{f.name} must be a positive integer, got {v!r}.")
        pos("nnodes", allow_none=False)
        if not isinstance(self.node_rank, int) or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes={self.nnodes}), got {self.node_rank!r}.")
        if self.distributed_executor_backend not in ("mp", "external_launcher"):
            raise ValueError(f"distributed_executor_backend must be 'mp' or 'external_launcher', "
                             f"got {self.distributed_executor_backend!r}.")
        if self.nnodes > 1 and self.distributed_executor_backend != "external_launcher":
            raise ValueError("nnodes > 1 needs distributed_executor_backend='external_launcher' (torchrun or one "
                             "process per node with --distributed-init-method).")
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            raise ValueError(f"block_size must be a power of two in [1, 256], got {self.block_size}.")

    def _quant_config(self, model: str, hf_config: Any, architecture: str) -> Any:
        from pagedllm.layers.quantization import resolve_quant_config
        from pagedllm.models.registry import get_model_class

        try:
            cls = get_model_class(architecture)
        except ValueError:
            cls = None
        return resolve_quant_config(self.quantization, model, hf_config, cls,
                                    self.tensor_parallel_size * self.pipeline_parallel_size)

    def create_engine_config(self) -> EngineConfig:
        """Resolves the model, reads its config and builds the frozen config (KV block count still 0).

        Raises:
            ValueError: for bad values, naming the argument.
            FileNotFoundError: if the model path doesn't exist.
        """
        from pagedllm.model_files import default_model_path
        from pagedllm.model_loader.hf_config import load_hf_config, get_architecture

        self._verify()
        from pagedllm.kernels.config import KernelConfig

        kernel = KernelConfig.from_env(self.cpu_isa)  # ValueError for a level above this CPU's
        model = self.model or default_model_path()
        model = os.path.expanduser(model)
        if not os.path.exists(model):
            raise FileNotFoundError(f"model {model!r} not found: give a GGUF file or a Hugging Face model folder.")
        is_gguf = model.endswith(".gguf")
        hf_config = load_hf_config(model)
        architecture = get_architecture(hf_config)
        dtype = resolve_dtype(self.dtype, hf_config, kernel.level)
        quant_config = self._quant_config(model, hf_config, architecture)
        max_pos = getattr(hf_config, "max_position_embeddings", None) or 8192
        max_model_len = self.max_model_len or max_pos
        vocab_size = int(hf_config.vocab_size)
        max_num_batched_tokens = self.max_num_batched_tokens or 2048
        if not self.enable_chunked_prefill:
            max_num_batched_tokens = max(max_num_batched_tokens, max_model_len)
        if self.served_model_name:
            name = self.served_model_name
        else:
            name = self.model if self.model else os.path.basename(model)
        chat_template = None
        if self.chat_template:
            from pagedllm.tokenizer import load_chat_template

            chat_template = load_chat_template(self.chat_template)
        kv_bytes = self.kv_cache_memory_bytes or DEFAULT_KV_CACHE_MEMORY_BYTES
        speculative = None
        if self.speculative_config is not None:
            speculative = SpeculativeConfig.from_dict(self.speculative_config)
            if self.tensor_parallel_size * self.pipeline_parallel_size > 1 or \
                    self.distributed_executor_backend == "external_launcher":
                raise ValueError("speculative_config can't be combined with tensor/pipeline parallelism yet.")
        so_config = StructuredOutputsConfig.parse(self.structured_outputs_config, self.reasoning_parser)
        model_config = ModelConfig(
                model=model,
                tokenizer=self.tokenizer or model,
                served_model_name=name,
                dtype=dtype,
                max_model_len=max_model_len,
                hf_config=hf_config,
                architecture=architecture,
                vocab_size=vocab_size,
                max_logprobs=self.max_logprobs,
                seed=self.seed,
                chat_template=chat_template,
                is_gguf=is_gguf,
                skip_tokenizer_init=self.skip_tokenizer_init,
                quantization=quant_config,
        )
        if speculative is not None:
            speculative = speculative.with_draft_model_config(model_config)
        return EngineConfig(
            structured_outputs=so_config,
            model=model_config,
            cache=CacheConfig(
                block_size=self.block_size,
                num_blocks=(self.num_gpu_blocks_override + 1) if self.num_gpu_blocks_override else 0,
                kv_cache_memory_bytes=kv_bytes,
                enable_prefix_caching=self.enable_prefix_caching,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=max_model_len,
                enable_chunked_prefill=self.enable_chunked_prefill,
                long_prefill_token_threshold=self.long_prefill_token_threshold,
            ),
            parallel=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size,
                pipeline_parallel_size=self.pipeline_parallel_size,
                distributed_executor_backend=self.distributed_executor_backend,
                distributed_init_method=self.distributed_init_method,
                nnodes=self.nnodes,
                node_rank=self.node_rank,
                max_in_flight_batches=self.max_in_flight_batches,
            ),
            speculative=speculative,
            limits=InputLimits(**{f.name: getattr(self, f.name) for f in dataclasses.fields(InputLimits)}),
            kernel=kernel,
        )
