"""The offline API: ``LLM(model).generate(prompts, SamplingParams(...))``, as in vLLM."""

from __future__ import annotations

import itertools
import time
from typing import Any, Optional, Sequence, Union

from pagedllm.config import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine, ProcessedPrompt, PromptType
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    """An engine for offline batch generation.

    Args:
        model: a GGUF file or a Hugging Face folder; None = the bundled SmolLM2-135M-Instruct GGUF.
        **kwargs: ``EngineArgs`` fields with vLLM's names (``dtype``, ``max_model_len``, ``max_num_seqs``,
            ``max_num_batched_tokens``, ``block_size``, ``kv_cache_memory_bytes``, ``enable_prefix_caching``, ...).

    Raises:
        TypeError: for an unknown keyword argument.
        ValueError: for a bad engine argument, naming it.
    """

    def __init__(self, model: Optional[str] = None, _loaded_model=None, **kwargs: Any) -> None:
        unknown = set(kwargs) - EngineArgs.field_names()
        if unknown:
            raise TypeError(f"LLM() got unknown engine arguments: {sorted(unknown)}")
        args = EngineArgs(model=model, **kwargs)
        self.engine_args = args
        self.llm_engine = LLMEngine(args.create_engine_config(), model=_loaded_model)
        self._ids = itertools.count()

    def with_engine_args(self, **kwargs: Any) -> "LLM":
        """A new ``LLM`` on the same loaded weights with some engine arguments changed (scheduler, KV cache)."""
        import dataclasses

        args = dataclasses.asdict(self.engine_args)
        args.update(kwargs)
        model = args.pop("model")
        return LLM(model, _loaded_model=self.llm_engine.engine_core.runner.model, **args)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def shutdown(self) -> None:
        """Stops the worker processes of a tensor/pipeline-parallel engine (they also stop when this process
        exits)."""
        self.llm_engine.engine_core.shutdown()

    def reset_prefix_cache(self) -> bool:
        return self.llm_engine.reset_prefix_cache()

    # ------------------------------------------------------------------ generate
    def generate(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        sampling_params: Optional[Union[SamplingParams, Sequence[SamplingParams]]] = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generates completions for ``prompts`` (a string, a token-id list, a dict prompt, or a list of them).

        Returns one ``RequestOutput`` per prompt, in input order. Every prompt and parameter set is validated before
        any request starts.

        Raises:
            ValueError: for a bad prompt or parameter (naming the field); nothing has run then.
        """
        if isinstance(prompts, (str, dict)) or (
                isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"sampling_params has {len(params_list)} entries for {len(prompts)} prompts.")
        eng = self.llm_engine
        processed: list[ProcessedPrompt] = []
        final_params: list[SamplingParams] = []
        for p, sp in zip(prompts, params_list):
            pp = eng.process_prompt(p)
            sp = sp.clone()
            sp.output_kind = RequestOutputKind.FINAL_ONLY
            eng.validate_params(sp, len(pp.prompt_token_ids))
            processed.append(pp)
            final_params.append(sp)
        ids = []
        for pp, sp in zip(processed, final_params):
            rid = str(next(self._ids))
            eng.add_request(rid, pp, sp)
            ids.append(rid)
        return self._run_engine(ids, use_tqdm)

    def chat(
        self,
        messages: Union[list[dict], Sequence[list[dict]]],
        sampling_params: Optional[Union[SamplingParams, Sequence[SamplingParams]]] = None,
        use_tqdm: bool = True,
        chat_template: Optional[str] = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Optional[list[dict]] = None,
        chat_template_kwargs: Optional[dict[str, Any]] = None,
    ) -> list[RequestOutput]:
        """Applies the chat template (the model's, or ``chat_template``) to each conversation, then generates.

        ``tools`` (OpenAI's function-tool dicts) reach the template, as do assistant ``tool_calls`` and ``tool``
        messages of earlier turns; parse the calls out of the text with a parser from
        ``pagedllm.entrypoints.openai.tool_parsers`` (or constrain them with ``SamplingParams.structured_outputs``).

        Raises:
            ValueError: if the model has no chat template and none is given, or for bad parameters.
        """
        from pagedllm.tokenizer import apply_chat_template

        if messages and isinstance(messages[0], dict):
            convs = [messages]
        else:
            convs = list(messages)
        template = chat_template or self.llm_engine.config.model.chat_template
        prompts = []
        from pagedllm.entrypoints.openai.chat_tools import messages_for_template

        for conv in convs:
            text = apply_chat_template(self.llm_engine.tokenizer, messages_for_template(conv), chat_template=template,
                                       add_generation_prompt=add_generation_prompt,
                                       continue_final_message=continue_final_message, tools=tools,
                                       **(chat_template_kwargs or {}))
            ids = self.llm_engine.tokenizer.encode(text, add_special_tokens=False)
            prompts.append({"prompt_token_ids": ids})
        outs = self.generate(prompts, sampling_params, use_tqdm)
        return outs

    def _run_engine(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        eng = self.llm_engine
        results: dict[str, RequestOutput] = {}
        pbar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            pbar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True,
                        postfix="est. speed input: 0.00 toks/s, output: 0.00 toks/s")
        t0 = time.perf_counter()
        n_in = n_out = 0
        while eng.has_unfinished_requests():
            for ro in eng.step():
                if ro.finished:
                    results[ro.request_id] = ro
                    if pbar is not None:
                        n_in += len(ro.prompt_token_ids)
                        n_out += sum(len(c.token_ids) for c in ro.outputs)
                        dt = max(time.perf_counter() - t0, 1e-9)
                        pbar.postfix = f"est. speed input: {n_in / dt:.2f} toks/s, output: {n_out / dt:.2f} toks/s"
                        pbar.update(1)
        if pbar is not None:
            pbar.close()
        return [results[i] for i in ids if i in results]
