"""Tokenizer loading, EOS ids and chat templates.

A model is either an HF folder (tokenizer.json / tokenizer_config.json / generation_config.json) or a GGUF file,
whose tokenizer and chat template live in its metadata and are converted by transformers' GGUF support.

That conversion is slow on 2 cores (SmolLM2 ~5 s, Gemma-3's 262k vocab ~23 s: transformers parses the whole file
with `gguf.GGUFReader`), so a converted GGUF tokenizer is saved once as an HF tokenizer folder under
`<cache_dir>/tokenizers/` and loaded from there afterwards, straight into a `PreTrainedTokenizerFast` (~0.06 s /
~0.8 s; see `_load_saved_fast_tokenizer`). The cache key holds the
GGUF's resolved path, size and mtime and the transformers version; `PAGEDLLM_TOKENIZER_CACHE=0` turns it off.
Within a process, `get_tokenizer` returns the same object per source.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import threading
from typing import Any, Optional

from pagedllm import envs
from pagedllm.model_files import cache_dir, read_gguf_metadata

__all__ = [
    "apply_chat_template",
    "get_eos_token_ids",
    "get_tokenizer",
    "is_gguf_file",
    "load_chat_template",
    "tokenizer_fingerprint",
]

_lock = threading.Lock()
_tokenizers: dict[tuple[str, bool], Any] = {}


def is_gguf_file(path: str | os.PathLike) -> bool:
    """True for an existing file named *.gguf or starting with the GGUF magic."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        return False
    if path.lower().endswith(".gguf"):
        return True
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def get_tokenizer(model: str, tokenizer: Optional[str] = None, trust_remote_code: bool = False):
    """Load (once per process) the tokenizer for `model`, or from `tokenizer` when given.

    Either may be a GGUF file or an HF folder. Returns a `transformers.PreTrainedTokenizerBase`.
    """
    source = os.path.realpath(os.fspath(tokenizer if tokenizer is not None else model))
    key = (source, trust_remote_code)
    with _lock:
        cached = _tokenizers.get(key)
        if cached is not None:
            return cached
        tok = _load_gguf_tokenizer(source) if is_gguf_file(source) else _load_hf_tokenizer(source, trust_remote_code)
        _tokenizers[key] = tok
        return tok


def _load_hf_tokenizer(folder: str, trust_remote_code: bool):
    from transformers import AutoTokenizer

    if not os.path.isdir(folder):
        raise FileNotFoundError(f"Tokenizer source {folder!r} is neither a GGUF file nor a folder")
    return AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)


def _tokenizer_cache_folder(gguf_path: str) -> str:
    import transformers

    st = os.stat(gguf_path)
    ident = f"{gguf_path}\0{st.st_size}\0{st.st_mtime_ns}\0{transformers.__version__}"
    digest = hashlib.sha256(ident.encode()).hexdigest()[:16]
    stem = os.path.basename(gguf_path)
    return os.path.join(cache_dir(), "tokenizers", f"{stem}-{digest}")


def _load_gguf_tokenizer(gguf_path: str, use_disk_cache: Optional[bool] = None):
    from transformers import AutoTokenizer

    if use_disk_cache is None:
        use_disk_cache = envs.flag("PAGEDLLM_TOKENIZER_CACHE")
    folder = _tokenizer_cache_folder(gguf_path) if use_disk_cache else None
    if folder is not None and os.path.isfile(os.path.join(folder, "tokenizer.json")):
        tok = _load_saved_fast_tokenizer(folder)
    else:
        tok = AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))
        if folder is not None:
            _save_atomically(tok, folder)
    tok.name_or_path = gguf_path
    return tok


def _load_saved_fast_tokenizer(folder: str):
    """The tokenizer ``_save_atomically`` wrote to ``folder``, as a ``PreTrainedTokenizerFast`` over its
    ``tokenizer.json`` with the special tokens of its ``tokenizer_config.json``, the class defaults (padding side,
    ...) of the class named there, and its chat template.

    Same ids, tokens, decoding, special tokens and chat template as ``AutoTokenizer.from_pretrained(folder)`` (tested
    on every real model's GGUF), ~3x sooner: transformers 5's ``AutoTokenizer`` parses the 33 MB ``tokenizer.json``
    of Gemma 3's 262k vocabulary with Python's ``json`` five times and rebuilds the model from the vocabulary (2.7 s
    -> 0.8 s on 2 cores; Qwen2.5 0.87 -> 0.3 s). Falls back to ``AutoTokenizer`` for a config it doesn't read
    (special tokens saved as objects)."""
    import transformers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    specials = {k: v for k, v in cfg.items() if k.endswith("_token")}
    if any(v is not None and not isinstance(v, str) for v in specials.values()) or \
            "additional_special_tokens" in cfg or "extra_special_tokens" in cfg:
        return AutoTokenizer.from_pretrained(folder)
    kwargs: dict[str, Any] = {k: v for k, v in specials.items() if v is not None}
    cls = getattr(transformers, str(cfg.get("tokenizer_class") or ""), None)
    for attr in ("padding_side", "truncation_side", "model_input_names"):
        if cls is not None and hasattr(cls, attr):
            kwargs[attr] = getattr(cls, attr)
    template = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(template):
        with open(template, encoding="utf-8") as f:
            kwargs["chat_template"] = f.read()
    return PreTrainedTokenizerFast(tokenizer_file=os.path.join(folder, "tokenizer.json"), **kwargs)


def _save_atomically(tok, folder: str) -> None:
    """save_pretrained into a temp folder, then rename it into place (a concurrent writer may win; that's fine)."""
    parent = os.path.dirname(folder)
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tmp-", dir=parent)
    except OSError:
        return  # read-only cache: just don't cache
    try:
        tok.save_pretrained(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it 0700; the cache may be shared
        os.rename(tmp, folder)
    except OSError:
        pass
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                    "tokenizer.model", "vocab.json", "merges.txt")


def tokenizer_fingerprint(tokenizer) -> Optional[str]:
    """A short hex digest naming ``tokenizer``'s source as it is on disk now (for caches of what is derived from it:
    ``XgrammarBackend``'s tokenizer info): the GGUF file's or the folder's tokenizer files' paths, sizes and mtimes,
    the class, its length and the transformers version. None where its source isn't a file or folder, or the disk
    caches are off (``PAGEDLLM_TOKENIZER_CACHE=0``)."""
    import transformers

    if not envs.flag("PAGEDLLM_TOKENIZER_CACHE"):
        return None
    source = os.path.realpath(str(getattr(tokenizer, "name_or_path", "") or ""))
    if os.path.isfile(source):
        files = [source]
    elif os.path.isdir(source):
        files = [os.path.join(source, f) for f in _TOKENIZER_FILES if os.path.isfile(os.path.join(source, f))]
    else:
        return None
    if not files:
        return None
    parts = [type(tokenizer).__name__, str(len(tokenizer)), transformers.__version__]
    for f in files:
        st = os.stat(f)
        parts.append(f"{f}\0{st.st_size}\0{st.st_mtime_ns}")
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def get_eos_token_ids(tokenizer, model_path: str) -> set[int]:
    """All token ids that end generation: the tokenizer's EOS, plus generation_config.json's `eos_token_id` (int or
    list) for an HF folder, or `tokenizer.ggml.eos_token_id` from a GGUF's metadata.

    (transformers' GGUF tokenizer takes its eos_token from that same key, so for GGUF the two usually agree; the
    metadata is read directly so the answer doesn't depend on conversion details.)
    """
    ids: set[int] = set()
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    path = os.fspath(model_path)
    if is_gguf_file(path):
        meta = read_gguf_metadata(path, ["tokenizer.ggml.eos_token_id"])
        if meta.get("tokenizer.ggml.eos_token_id") is not None:
            ids.add(int(meta["tokenizer.ggml.eos_token_id"]))
    elif os.path.isdir(path):
        gen_cfg = os.path.join(path, "generation_config.json")
        if os.path.isfile(gen_cfg):
            with open(gen_cfg, encoding="utf-8") as f:
                eos = json.load(f).get("eos_token_id")
            if isinstance(eos, int):
                ids.add(eos)
            elif isinstance(eos, (list, tuple)):
                ids.update(int(i) for i in eos)
    return ids


def load_chat_template(arg: Optional[str]) -> Optional[str]:
    """vLLM's `--chat-template`: a path to a template file, or the template text itself."""
    if arg is None:
        return None
    if os.path.isfile(arg):
        with open(arg, encoding="utf-8") as f:
            return f.read()
    if any(c in arg for c in "{}\n"):
        return arg  # looks like Jinja: the template itself
    raise ValueError(
        f"Chat template {arg!r} looks like a file path, but no such file exists "
        "(a literal template must contain Jinja syntax such as '{{' or '{%')"
    )


def _flatten_content(messages: list[dict]) -> list[dict]:
    """OpenAI content parts ([{"type": "text", "text": ...}, ...]) → one string, as string-format templates
    (ChatML, Llama, ...) expect. Text parts are joined with newlines; other parts are not supported."""
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if isinstance(part, str):
                    texts.append(part)
                elif isinstance(part, dict) and part.get("type", "text") == "text":
                    texts.append(part.get("text", ""))
                else:
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise ValueError(f"Unsupported message content part type {kind!r} (only text is supported)")
            message = {**message, "content": "\n".join(texts)}
        out.append(message)
    return out


def apply_chat_template(
    tokenizer,
    messages: list[dict],
    chat_template: Optional[str] = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: Optional[list[dict]] = None,
    **template_kwargs: Any,
) -> str:
    """Render `messages` to a prompt string with `chat_template` or else the tokenizer's own template.

    Extra keyword arguments go to the template (vLLM's `chat_template_kwargs`, e.g. `enable_thinking`).
    """
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
    template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError(
            "The model has no chat template (its tokenizer defines none) and none was given; "
            "pass one with --chat-template, or use the completions API instead"
        )
    if continue_final_message and (not messages or messages[-1].get("role") != "assistant"):
        raise ValueError("continue_final_message needs the final message to be from the assistant")
    return tokenizer.apply_chat_template(
        _flatten_content(messages),
        chat_template=template,
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        tokenize=False,
        **template_kwargs,
    )
