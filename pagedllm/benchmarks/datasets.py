"""Benchmark workloads, shared by ``bench throughput``, ``bench latency``, ``bench serve`` and ``bench compare``.

Every workload turns into a list of ``BenchRequest``s: exact prompt token ids (what offline engines get, and what
``/v1/completions`` gets for random-token prompts), the prompt as text, chat messages where the workload is a chat,
and the number of output tokens to generate (exact with ``--ignore-eos``).

Workloads:

``random``
    ``--input-len`` random token ids (uniform over the vocabulary, special tokens excluded) and ``--output-len``
    output tokens for every request; ``--seed`` fixes them. The ids are decoded and re-encoded once, so the text form
    sent to chat endpoints tokenizes back to (nearly) the same ids.
``mixed``
    Random-token prompts whose lengths vary as in real traffic: input length log-uniform on
    [``--mixed-input-min``, ``--mixed-input-max``] = [50, 1000] tokens (median ~224, mean ~317) and output length,
    drawn independently, log-uniform on [``--mixed-output-min``, ``--mixed-output-max``] = [16, 512] tokens
    (median ~91, mean ~143). Log-uniform: many short requests, a long tail of long ones.
``shared-prefix``
    One long system prompt (a support policy of ~960 tokens, ``data/shared_prefix.json``; ``--prefix-len`` cuts it)
    followed by one of 40 customer questions, each prefixed with a distinct ticket number so no two prompts are
    identical; chat-formatted. Exercises prefix caching.
``chat``
    Multi-turn English conversations written for this benchmark (``data/chat_conversations.json``, 25 conversations
    on everyday topics). Every prefix of a conversation that ends on a user turn is one prompt (so later turns share
    a prefix with earlier ones, as in real chat traffic); prompts are shuffled with ``--seed`` and reused in a cycle
    when more are asked for. ``--output-len`` output tokens each.
``code-edit``
    "Rewrite this code with the following change: ..." over 24 short Python functions and classes
    (``data/code_edit.json``), chat-formatted with a system prompt asking for the whole rewritten code: most of
    the answer repeats the prompt (the workload n-gram speculation is for). Shuffled with ``--seed``, reused in a
    cycle; ``--output-len`` output tokens at most (run it with ``--no-ignore-eos``: the answer ends by itself).

Chat-formatted workloads are rendered with the tokenizer's chat template for engines that take token ids or text;
``--backend openai-chat`` sends their messages instead. A base model's tokenizer has no chat template: its
messages are then rendered as a plain transcript (``PLAIN_CHAT_TEMPLATE``: "User: ...", blank line, "Assistant:"),
to be sent as completions (``--backend openai``), the same text to every engine.
"""

from __future__ import annotations

import json
import math
import os
import random
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
WORKLOADS = ("random", "mixed", "shared-prefix", "chat", "json-schema", "code-edit")


@dataclass
class BenchRequest:
    prompt: str  # text form (chat workloads: the chat-templated text)
    prompt_token_ids: list[int]
    output_len: int
    messages: Optional[list[dict]] = None  # chat form, where the workload is a chat
    token_prompt: bool = False  # random-token prompt: send ids where the API allows (completions)
    extra: dict = field(default_factory=dict)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    def to_dict(self) -> dict:
        return asdict(self)


def add_dataset_args(p, engine_flags: bool = False) -> None:
    """Workload flags. With ``engine_flags`` the engine's own ``--seed`` and ``--tokenizer`` (already added by
    ``add_engine_args``) serve the workload too."""
    g = p.add_argument_group("workload")
    g.add_argument("--dataset-name", "--workload", dest="dataset_name", default="random", choices=WORKLOADS,
                   help="Workload (see `pagedllm.benchmarks.datasets`).")
    g.add_argument("--num-prompts", type=int, default=None, help="Number of requests (default depends on the tool).")
    g.add_argument("--input-len", "--random-input-len", dest="input_len", type=int, default=256,
                   help="random: prompt tokens per request.")
    g.add_argument("--output-len", "--random-output-len", dest="output_len", type=int, default=128,
                   help="random, shared-prefix, chat: output tokens per request.")
    g.add_argument("--mixed-input-min", type=int, default=50)
    g.add_argument("--mixed-input-max", type=int, default=1000)
    g.add_argument("--mixed-output-min", type=int, default=16)
    g.add_argument("--mixed-output-max", type=int, default=512)
    g.add_argument("--prefix-len", type=int, default=None,
                   help="shared-prefix: cut the system prompt to this many tokens (default: all of it, ~960).")
    if not engine_flags:
        g.add_argument("--seed", type=int, default=0, help="Seed of the workload's random choices.")
    g.add_argument("--ignore-eos", action=argparse_bool(), default=True,
                   help="Generate exactly the requested output lengths (on by default; --no-ignore-eos to stop at EOS).")
    if not engine_flags:
        g.add_argument("--tokenizer", default=None,
                       help="Tokenizer (GGUF file or HF folder) used to build prompts (default: the bundled SmolLM2 "
                            "GGUF).")


def argparse_bool():
    import argparse

    return argparse.BooleanOptionalAction


def _special_ids(tok) -> set[int]:
    ids = set(getattr(tok, "all_special_ids", []) or [])
    for attr in ("added_tokens_decoder",):
        try:
            ids.update(int(k) for k in getattr(tok, attr).keys())
        except Exception:  # noqa: BLE001 - tokenizer without it
            pass
    return ids


def _random_ids(tok, rng: random.Random, n: int, vocab: int, specials: set[int]) -> list[int]:
    out: list[int] = []
    while len(out) < n:
        t = rng.randrange(vocab)
        if t not in specials:
            out.append(t)
    return out


def _random_prompt(tok, rng: random.Random, n: int, vocab: int, specials: set[int]) -> tuple[str, list[int]]:
    """n random ids, made stable under decode -> encode (so text and ids agree), topped up to n tokens."""
    ids = _random_ids(tok, rng, n, vocab, specials)
    for _ in range(3):
        text = tok.decode(ids)
        again = tok.encode(text, add_special_tokens=False)
        if len(again) >= n:
            ids = again[:n]
        else:
            ids = again + _random_ids(tok, rng, n - len(again), vocab, specials)
        if tok.encode(tok.decode(ids), add_special_tokens=False) == ids:
            break
    return tok.decode(ids), list(ids)


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


# A base model's stand-in for a chat template (its tokenizer has none): each message as "Role: content" and a blank
# line, then "Assistant:" for the answer.
PLAIN_CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n\n{% endfor %}"
                       "{% if add_generation_prompt %}Assistant:{% endif %}")


def _render_chat(tok, messages: list[dict], chat_template: Optional[str] = None) -> tuple[str, list[int]]:
    if chat_template is None and not getattr(tok, "chat_template", None):
        chat_template = PLAIN_CHAT_TEMPLATE
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, chat_template=chat_template)
    ids = tok.encode(text, add_special_tokens=False)
    return text, list(ids)


def load_chat_conversations() -> list[dict]:
    with open(os.path.join(DATA_DIR, "chat_conversations.json")) as f:
        return json.load(f)["conversations"]


def load_json_schemas() -> list[dict]:
    """``[{"prompt", "schema"}]``: the json-schema workload (data/json_schemas.json)."""
    with open(os.path.join(DATA_DIR, "json_schemas.json")) as f:
        return json.load(f)


def load_shared_prefix() -> dict:
    with open(os.path.join(DATA_DIR, "shared_prefix.json")) as f:
        return json.load(f)


def code_edit_prompts() -> list[list[dict]]:
    """One chat (system + user turn) per item of ``data/code_edit.json``, in file order."""
    with open(os.path.join(DATA_DIR, "code_edit.json")) as f:
        data = json.load(f)
    return [[{"role": "system", "content": data["system_prompt"]},
             {"role": "user", "content": data["template"].format(**item)}] for item in data["items"]]


def chat_prompts() -> list[list[dict]]:
    """Every conversation prefix that ends on a user turn (system message kept), in file order."""
    out = []
    for conv in load_chat_conversations():
        msgs = conv["messages"]
        for i, m in enumerate(msgs):
            if m["role"] == "user":
                out.append([dict(x) for x in msgs[: i + 1]])
    return out


def make_requests(
    name: str,
    tokenizer,
    num_prompts: int,
    *,
    input_len: int = 256,
    output_len: int = 128,
    seed: int = 0,
    mixed_input: tuple[int, int] = (50, 1000),
    mixed_output: tuple[int, int] = (16, 512),
    prefix_len: Optional[int] = None,
    max_model_len: Optional[int] = None,
    chat_template: Optional[str] = None,
) -> list[BenchRequest]:
    """Builds ``num_prompts`` requests of workload ``name`` (deterministic for a given seed and tokenizer).

    Raises:
        ValueError: for an unknown workload or impossible lengths.
    """
    if num_prompts <= 0:
        raise ValueError("num_prompts must be positive")
    rng = random.Random(seed)
    tok = tokenizer
    reqs: list[BenchRequest] = []
    if name in ("random", "mixed"):
        vocab = len(tok)
        specials = _special_ids(tok)
        for i in range(num_prompts):
            if name == "random":
                n_in, n_out = input_len, output_len
            else:
                n_in = _log_uniform(rng, *mixed_input)
                n_out = _log_uniform(rng, *mixed_output)
            if n_in < 1 or n_out < 1:
                raise ValueError("input and output lengths must be at least 1")
            text, ids = _random_prompt(tok, rng, n_in, vocab, specials)
            reqs.append(BenchRequest(prompt=text, prompt_token_ids=ids, output_len=n_out, token_prompt=True))
    elif name == "shared-prefix":
        data = load_shared_prefix()
        system = data["system_prompt"]
        if prefix_len is not None:
            sys_ids = tok.encode(system, add_special_tokens=False)[:prefix_len]
            system = tok.decode(sys_ids)
        questions = data["questions"]
        order = list(range(len(questions)))
        rng.shuffle(order)
        for i in range(num_prompts):
            q = questions[order[i % len(order)]]
            msgs = [{"role": "system", "content": system},
                    {"role": "user", "content": f"Ticket #{1000 + i}: {q}"}]
            text, ids = _render_chat(tok, msgs, chat_template)
            reqs.append(BenchRequest(prompt=text, prompt_token_ids=ids, output_len=output_len, messages=msgs))
    elif name in ("chat", "code-edit"):
        convs = chat_prompts() if name == "chat" else code_edit_prompts()
        order = list(range(len(convs)))
        rng.shuffle(order)
        for i in range(num_prompts):
            msgs = convs[order[i % len(order)]]
            text, ids = _render_chat(tok, msgs, chat_template)
            reqs.append(BenchRequest(prompt=text, prompt_token_ids=ids, output_len=output_len, messages=msgs))
    elif name == "json-schema":
        # Realistic extraction/classification prompts, each with its JSON schema (BenchRequest.extra["schema"]);
        # bench serve constrains --structured-output-ratio of them and reports the share of valid outputs.
        items = load_json_schemas()
        order = list(range(len(items)))
        rng.shuffle(order)
        for i in range(num_prompts):
            item = items[order[i % len(order)]]
            msgs = [{"role": "user", "content": item["prompt"]}]
            text, ids = _render_chat(tok, msgs, chat_template)
            reqs.append(BenchRequest(prompt=text, prompt_token_ids=ids, output_len=output_len, messages=msgs,
                                     extra={"schema": item["schema"]}))
    else:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    if max_model_len is not None:
        for r in reqs:
            if r.prompt_len + r.output_len > max_model_len:
                raise ValueError(f"a request of {r.prompt_len} prompt + {r.output_len} output tokens does not fit "
                                 f"max_model_len={max_model_len}")
    return reqs


def requests_from_args(ns, tokenizer, num_prompts: int, max_model_len: Optional[int] = None) -> list[BenchRequest]:
    return make_requests(
        ns.dataset_name, tokenizer, num_prompts, input_len=ns.input_len, output_len=ns.output_len, seed=ns.seed,
        mixed_input=(ns.mixed_input_min, ns.mixed_input_max), mixed_output=(ns.mixed_output_min, ns.mixed_output_max),
        prefix_len=ns.prefix_len, max_model_len=max_model_len)


def load_tokenizer(tokenizer: Optional[str] = None, model: Optional[str] = None):
    """The tokenizer at ``tokenizer`` (GGUF or HF folder), else ``model``'s, else the bundled SmolLM2's."""
    from pagedllm.tokenizer import get_tokenizer

    src = tokenizer or model
    if src is None:
        from pagedllm.model_files import default_model_path

        src = default_model_path()
    return get_tokenizer(src)


def summarize(reqs: list[BenchRequest]) -> dict[str, Any]:
    ins = [r.prompt_len for r in reqs]
    outs = [r.output_len for r in reqs]
    return {"num_requests": len(reqs), "total_input_tokens": sum(ins), "total_output_tokens": sum(outs),
            "input_len_min": min(ins), "input_len_max": max(ins), "input_len_mean": sum(ins) / len(ins),
            "output_len_min": min(outs), "output_len_max": max(outs), "output_len_mean": sum(outs) / len(outs)}
