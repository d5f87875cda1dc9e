"""IncrementalDetokenizer on real tokenizers: byte-level BPE (SmolLM2 GGUF) and SentencePiece with byte fallback
(Gemma-3 GGUF), plus a tiny Llama-2-style tokenizer whose decoder strips the first leading space."""

import random

import pytest

from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.model_files import default_model_path, gemma3_270m_path
from pagedllm.tokenizer import get_tokenizer

TEXTS = [
    "Hello world, this is a test.",
    "👍🏽 🇫🇷 ok 👨‍👩‍👧‍👦!",
    "你好，世界。这是一个测试。",
    "déjà vu, naïve café, Ελληνικά и русский",
    "def f(x):\n    if x:\n        return x  # done\n\treturn None\n",
    " leading space and  double  spaces ",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ꙮ 🫨 𓀀",  # byte-fallback tokens in Gemma
    "\n\nend\n",
]
PROMPT = "Question: what comes next?\nAnswer:"


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def tok(request):
    path = default_model_path() if request.param == "smollm2" else gemma3_270m_path()
    return get_tokenizer(path)


def enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


def run(tok, prompt_ids, output_ids, chunk_sizes=None, finish=True, **kwargs):
    """Feed output_ids in chunks; returns (detokenizer, deltas, stop string or None)."""
    d = IncrementalDetokenizer(tok, prompt_ids, **kwargs)
    deltas = []
    i = 0
    stop = None
    sizes = iter(chunk_sizes or [])
    while i < len(output_ids):
        n = next(sizes, 1)
        chunk = output_ids[i : i + n]
        i += len(chunk)
        finished = finish and i >= len(output_ids)
        stop = d.update(chunk, finished)
        deltas.append(d.get_next_output_text(finished or stop is not None, delta=True))
        if stop is not None:
            break
    return d, deltas, stop


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_full_decode(tok, text):
    prompt_ids = enc(tok, PROMPT)
    ids = enc(tok, text)
    expected = tok.decode(ids, skip_special_tokens=True)
    assert expected == text  # these texts round-trip
    rng = random.Random(hash(text) & 0xFFFF)
    for chunk_sizes in (None, [rng.randint(1, 5) for _ in ids]):
        d, deltas, stop = run(tok, prompt_ids, ids, chunk_sizes)
        assert stop is None
        assert "".join(deltas) == d.output_text == expected
        assert not any("\ufffd" in delta for delta in deltas), deltas
        assert d.output_token_ids == ids


def test_multibyte_characters_are_held_until_complete(tok):
    """The texts really exercise the hold-back: some single tokens decode to U+FFFD on their own."""
    ids = enc(tok, "𝔘𝔫 🫨 ꙮ")
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    d, deltas, _ = run(tok, enc(tok, PROMPT), ids)
    assert "" in deltas  # some steps released nothing
    assert "".join(deltas) == "𝔘𝔫 🫨 ꙮ"


def test_random_unicode_text(tok):
    rng = random.Random(1234)
    alphabet = "ab xyz\n\t,.éàü你好世界😀👍🏽🇫🇷ꙮ𝔘🫨ß∑→"
    prompt_ids = enc(tok, "Go:")
    for _ in range(20):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30)))
        ids = enc(tok, text)
        d, deltas, _ = run(tok, prompt_ids, ids, [rng.randint(1, 3) for _ in ids])
        assert "".join(deltas) == tok.decode(ids) == text
        assert not any("\ufffd" in delta for delta in deltas)


def test_first_output_token_keeps_leading_space(tok):
    prompt_ids = enc(tok, "The capital of France is")
    ids = enc(tok, " Paris.")
    assert tok.convert_ids_to_tokens(ids[0]) in ("ĠParis", "▁Paris")
    d = IncrementalDetokenizer(tok, prompt_ids)
    d.update(ids[:1], False)
    assert d.get_next_output_text(False, delta=True) == " Paris"
    d.update(ids[1:], True)
    assert d.get_next_output_text(True, delta=True) == "."
    assert d.output_text == " Paris."


def test_empty_prompt(tok):
    ids = enc(tok, "Hello world")
    _, deltas, _ = run(tok, [], ids)
    assert "".join(deltas) == tok.decode(ids)


def test_window_stays_small(tok):
    """O(1) per token: the decode window never grows with the output length."""
    ids = enc(tok, " ".join(TEXTS) * 3)
    d = IncrementalDetokenizer(tok, enc(tok, PROMPT), stop=["never appears in text"])
    for i in ids:
        d.update([i], False)
        assert len(d.token_ids) - d.prefix_offset <= 8
    assert d.output_text == tok.decode(ids)[: len(d.output_text)]
    assert len(d.output_text) >= len(tok.decode(ids)) - len("never appears in text")


# ------------------------------------------------------------------ stop strings


def _check_stream_prefixes(deltas, final):
    """Every prefix of the stream is a prefix of the final text: nothing was emitted and later taken back."""
    acc = ""
    for delta in deltas:
        acc += delta
        assert final.startswith(acc), (acc, final)
    assert acc == final


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("text, stop, before", [
    ("Hello world, the end is near. More text follows.", "end is near", "Hello world, the "),
    ("Count: one two three four five", "three four", "Count: one two "),
    ("Emoji 👍🏽 then more", "🏽 then", "Emoji 👍"),
    ("line one\n\nline two", "\n\n", "line one"),
    ("你好，世界。再见", "世界。", "你好，"),
])
def test_stop_string_spanning_tokens(tok, include, text, stop, before):
    ids = enc(tok, text)
    expected = before + stop if include else before
    rng = random.Random(7)
    for chunk_sizes in (None, [rng.randint(1, 4) for _ in ids]):
        d, deltas, found = run(tok, enc(tok, PROMPT), ids, chunk_sizes, stop=[stop],
                               include_stop_str_in_output=include)
        assert found == stop
        assert d.output_text == expected
        assert d.stop_reason == stop
        _check_stream_prefixes(deltas, expected)
        assert not any("\ufffd" in delta for delta in deltas)
        # After the stop, more tokens change nothing.
        assert d.update(enc(tok, " extra"), False) is None
        assert d.output_text == expected


def test_multi_token_stop_strings_really_span_tokens(tok):
    for stop in ("end is near", "three four"):
        assert len(enc(tok, stop)) >= 2


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_at_very_start(tok, include):
    ids = enc(tok, "STOP and then the rest")
    d, deltas, found = run(tok, enc(tok, PROMPT), ids, stop="STOP", include_stop_str_in_output=include)
    assert found == "STOP"
    assert d.output_text == ("STOP" if include else "")
    _check_stream_prefixes(deltas, d.output_text)


def test_stop_prefix_held_back_then_released(tok):
    ids = enc(tok, "The end was near")
    d = IncrementalDetokenizer(tok, enc(tok, PROMPT), stop=["end is"])
    seen = {}
    for n, i in enumerate(ids, 1):
        assert d.update([i], False) is None
        decoded = tok.decode(ids[:n])
        seen[decoded] = d.output_text
        # Released = decoded text minus its longest tail that could still begin "end is".
        held = max((k for k in range(1, 6) if "end is".startswith(decoded[-k:])), default=0)
        assert d.output_text == decoded[: len(decoded) - held]
    assert seen["The end"] == "The "  # "end" held back ...
    assert seen["The end was"] == "The end was"  # ... and released once " was" ruled the stop string out
    assert d.output_text == "The end was near"


def test_held_back_text_flushed_on_finish(tok):
    ids = enc(tok, "It is the end")
    d, deltas, found = run(tok, enc(tok, PROMPT), ids, stop=["end of story", "the end!"])
    assert found is None
    assert "".join(deltas) == d.output_text == "It is the end"
    # Before the final (finishing) step, the tail that may begin a stop string was held back.
    d2, deltas2, _ = run(tok, enc(tok, PROMPT), ids, finish=False, stop=["end of story", "the end!"])
    assert d2.output_text == "It is " and "".join(deltas2) == "It is "
    assert d2.get_next_output_text(finished=True, delta=True) == "the end"


def test_earliest_completing_stop_wins(tok):
    ids = enc(tok, "xabcdef")
    d, _, found = run(tok, [], ids, chunk_sizes=[len(ids)], stop=["bcdef", "abcd", "cd"])
    assert (found, d.output_text) == ("abcd", "x")  # "abcd" and "cd" end at the same char: the longer one wins
    d, _, found = run(tok, [], ids, chunk_sizes=[len(ids)], stop=["cdef", "abc"])
    assert (found, d.output_text) == ("abc", "x")


def test_flush_of_incomplete_bytes_on_finish(tok):
    """An output that ends mid-character: the held bytes come out (as U+FFFD) when the request finishes."""
    full = enc(tok, "ok 🫨")
    ids = full[:-1]
    partial = tok.decode(ids)
    assert partial.endswith("\ufffd")
    d, deltas, _ = run(tok, enc(tok, PROMPT), ids, finish=False)
    assert "\ufffd" not in d.output_text
    d.update([], True)
    assert d.output_text == partial
    assert "".join(deltas) + d.get_next_output_text(True, delta=True) == partial


# ------------------------------------------------------------------ special tokens


def _end_token(tok):
    return tok.eos_token_id


def test_skip_special_tokens(tok):
    eos = _end_token(tok)
    ids = enc(tok, "Hi there") + [eos]
    d, deltas, _ = run(tok, enc(tok, PROMPT), ids, skip_special_tokens=True)
    assert "".join(deltas) == d.output_text == "Hi there"
    d, deltas, _ = run(tok, enc(tok, PROMPT), ids, skip_special_tokens=False)
    assert "".join(deltas) == d.output_text == "Hi there" + tok.eos_token
    assert d.output_text == tok.decode(ids, skip_special_tokens=False)


def test_stop_terminated_drops_eos_text(tok):
    eos = _end_token(tok)
    ids = enc(tok, "Hi there")
    for include, expected in ((False, "Hi there"), (True, "Hi there" + tok.eos_token)):
        d = IncrementalDetokenizer(tok, enc(tok, PROMPT), skip_special_tokens=False, include_stop_str_in_output=include)
        d.update(ids, False)
        assert d.update([eos], True, stop_terminated=True) is None
        assert d.output_text == expected
        assert d.output_token_ids == ids + [eos]


def test_get_next_output_text_full_and_delta(tok):
    ids = enc(tok, "one two three")
    d = IncrementalDetokenizer(tok, enc(tok, PROMPT))
    d.update(ids[:2], False)
    first = d.get_next_output_text(False, delta=True)
    d.update(ids[2:], True)
    assert d.get_next_output_text(True, delta=False) == "one two three"
    assert first + d.get_next_output_text(True, delta=True) == "one two three"
    assert d.get_next_output_text(True, delta=True) == ""


def test_chat_prompt_context_with_special_tokens(tok):
    """Prompt ends in special tokens (chat turn header): skipped ones are fine as context."""
    if tok.chat_template:
        prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                         add_generation_prompt=True)
    else:
        prompt = "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    prompt_ids = enc(tok, prompt)
    ids = enc(tok, "Hello! 👋 How are you?")
    _, deltas, _ = run(tok, prompt_ids, ids)
    assert "".join(deltas) == "Hello! 👋 How are you?"


# ------------------------------------------------------------------ a decoder that strips the first space


@pytest.fixture(scope="module")
def llama2_style():
    """SentencePiece-like tokenizer whose decoder strips one leading space (Llama 2 / Mistral), with byte
    fallback tokens; built in memory."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>", "▁The", "▁capital", "▁is", "▁Paris", ".", "▁Hello", "▁world", "▁"]
    pieces += [f"<0x{b:02X}>" for b in range(256)]
    backend = Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token="<unk>"))
    backend.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0),
    ])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    ids = {p: i for i, p in enumerate(pieces)}
    return tok, ids


def test_strip_decoder_keeps_leading_spaces(llama2_style):
    tok, v = llama2_style
    assert tok.decode([v["▁Paris"]]) == "Paris"  # decoded alone, the space is stripped ...
    prompt_ids = [v["<s>"], v["▁The"], v["▁capital"], v["▁is"]]
    smile = [v[f"<0x{b:02X}>"] for b in "😀".encode()]
    out = [v["▁Paris"], v["."], v["▁"]] + smile + [v["▁Hello"], v["▁world"]]
    for sizes in (None, [2, 3, 1, 4]):
        d, deltas, _ = run(tok, prompt_ids, out, sizes)
        assert deltas[0].startswith(" Paris")  # ... but not after the prompt
        assert "".join(deltas) == " Paris. 😀 Hello world"
        assert "".join(deltas) == tok.decode(prompt_ids + out)[len(tok.decode(prompt_ids)):]
        assert not any("\ufffd" in delta for delta in deltas)


def test_invalid_bytes_do_not_stall(llama2_style):
    """A run of lone continuation bytes decodes to U+FFFD for ever: emitted anyway, window bounded."""
    tok, v = llama2_style
    bad = [v["<0x80>"]] * 40
    d = IncrementalDetokenizer(tok, [v["▁Hello"]])
    for i in bad:
        d.update([i], False)
        assert len(d.token_ids) - d.prefix_offset <= 32
    assert len(d.output_text) > 0
    d.update([v["▁world"]], True)
    assert d.output_text == tok.decode([v["▁Hello"]] + bad + [v["▁world"]])[len("Hello"):]


# ------------------------------------------------------------------ stop strings: KMP matcher vs brute force


class CharTokenizer:
    """Token id i is the character ALPHABET[i]: the text is exactly what the test feeds."""

    ALPHABET = "ab"

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.ALPHABET[i] for i in ids)


def _brute_force(text: str, stops: list[str], include: bool):
    """(cut text, stop) by definition: the stop string whose first occurrence ends earliest (the longest on a
    tie); None if none occurs."""
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or (i + len(s), -len(s)) < (best[0] + len(best[1]), -len(best[1]))):
            best = (i, s)
    if best is None:
        return text, None
    i, s = best
    return text[: i + len(s)] if include else text[:i], s


def _brute_held_back(text: str, stops: list[str]) -> int:
    return max((k for s in stops for k in range(1, len(s)) if k <= len(text) and text.endswith(s[:k])), default=0)


@pytest.mark.parametrize("seed", range(6))
def test_stop_matcher_equals_brute_force(seed):
    rng = random.Random(seed)
    tok = CharTokenizer()
    for _ in range(150):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 4))]
        text = "".join(rng.choice("ab") for _ in range(rng.randint(0, 24)))
        include = rng.random() < 0.5
        ids = [CharTokenizer.ALPHABET.index(c) for c in text]
        d = IncrementalDetokenizer(tok, [], stop=stops, include_stop_str_in_output=include)
        fed, stop, streamed = "", None, ""
        i = 0
        while i < len(ids) and stop is None:
            n = rng.randint(1, 3)
            fed += text[i:i + n]
            stop = d.update(ids[i:i + n], False)
            i += n
            streamed += d.get_next_output_text(stop is not None, delta=True)
            if stop is None:  # held back exactly the longest suffix that could begin a stop string
                assert d.output_text == fed[: len(fed) - _brute_held_back(fed, stops)], (stops, fed)
        if stop is None:
            d.update([], True)
            streamed += d.get_next_output_text(True, delta=True)
        want_text, want_stop = _brute_force(text, stops, include)
        assert (stop, d.output_text, streamed) == (want_stop, want_text, want_text), (stops, text, include)


def test_stop_strings_cost_linear_memory():
    """64 stop strings of 1024 characters: the matcher keeps O(total stop length) state (a set of every prefix
    would hold ~33 M characters)."""
    import tracemalloc

    stops = [f"{i:02d}" + "x" * 1022 for i in range(64)]
    tracemalloc.start()
    d = IncrementalDetokenizer(CharTokenizer(), [], stop=stops)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert sum(len(f) for f in d._stop_fail) == sum(len(s) for s in stops)
    assert peak < 8 << 20, peak


def test_special_token_stop_string_hidden_by_skip_special_tokens():
    """A stop string equal to a special token's text stops generation even though skip_special_tokens keeps that
    token out of the text (matched by id; the ids come from the InputProcessor's table)."""
    from types import SimpleNamespace

    from pagedllm.engine.input_processor import InputProcessor

    tok = get_tokenizer(default_model_path())
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    cfg = SimpleNamespace(model=SimpleNamespace(vocab_size=len(tok), max_model_len=2048, max_logprobs=20))
    table = InputProcessor(cfg, tok).special_stop_token_ids(["<|im_end|>", "plain"])
    assert table == {im_end: "<|im_end|>"}
    ids = enc(tok, "Hi there") + [im_end] + enc(tok, " more text")
    for include, want in ((False, "Hi there"), (True, "Hi there<|im_end|>")):
        d, deltas, stop = run(tok, enc(tok, PROMPT), ids, chunk_sizes=[2] * len(ids), stop=["<|im_end|>"],
                              include_stop_str_in_output=include, special_stop=table)
        assert stop == "<|im_end|>" and d.output_text == want and "".join(deltas) == want
    # Without the table the token is invisible and generation would run on.
    _, deltas, stop = run(tok, enc(tok, PROMPT), ids, stop=["<|im_end|>"])
    assert stop is None and "".join(deltas) == "Hi there more text"
