"""The grammar path against brute force, on small grammars over a small raw vocabulary.

For a finite language L, the allowed next tokens after a prefix p are exactly the tokens t with p + text(t) a
prefix of some string of L, and EOS is allowed exactly when p is in L. Random walks through the grammar compare
the backend's bitmask with that set at every step. Also: the request/config validation of structured outputs.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from pagedllm.config import StructuredOutputsConfig
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams
from pagedllm.structured_output import apply_grammar_bitmask, validate_structured_outputs
from pagedllm.structured_output.xgrammar_backend import XgrammarBackend

EOS = 0
VOCAB = ["<eos>", "a", "b", "c", "ab", "abc", "y", "e", "s", "ye", "yes", "n", "no", "o", "l", "w", "yellow",
         "{", "}", '"', ":", ",", " ", '{"', '":', '": ', ", ", "t", "r", "u", "true", "f", "fa", "false", "x",
         "1", "2", "12", "-", "0", '"x', "q", "ue"]


@pytest.fixture(scope="module")
def backend():
    import xgrammar as xgr

    info = xgr.TokenizerInfo(VOCAB, xgr.VocabType.RAW, vocab_size=len(VOCAB) + 3, stop_token_ids=[EOS])
    return XgrammarBackend(info, len(VOCAB) + 3)


def allowed_ids(bitmask: torch.Tensor, row: int, vocab_size: int) -> set[int]:
    words = bitmask[row].tolist()
    return {t for t in range(vocab_size) if (words[t // 32] >> (t % 32)) & 1}


def brute_force(language: set[str], prefix: str) -> set[int]:
    out = {t for t, s in enumerate(VOCAB) if t != EOS and any(w.startswith(prefix + s) for w in language)}
    if prefix in language:
        out.add(EOS)
    return out


CASES = [
    ("choice", json.dumps(["yes", "no", "yellow"]), {"yes", "no", "yellow"}),
    ("regex", "(ab|a)c?|b{1,2}", {"a", "ab", "ac", "abc", "b", "bb"}),
    ("grammar", 'root ::= "x" item ("," item)?\nitem ::= "1" | "12" | "-0"', {"x1", "x12", "x-0", "x1,1", "x1,12",
                                                                          "x1,-0", "x12,1", "x12,12", "x12,-0",
                                                                          "x-0,1", "x-0,12", "x-0,-0"}),
    # compact JSON (our default): exactly json.dumps' separators, no other whitespace
    ("json", json.dumps({"type": "object", "properties": {"x": {"type": "boolean"}}, "required": ["x"]}),
     {'{"x": true}', '{"x": false}'}),
]


@pytest.mark.parametrize("kind,spec,language", CASES, ids=[c[0] for c in CASES])
def test_bitmask_equals_brute_force(backend, kind, spec, language):
    compiled = backend.compile(kind, spec, any_whitespace=False)
    rng = random.Random(0)
    V = backend.vocab_size
    for _ in range(12):  # random walks
        g = backend.new_grammar(compiled)
        text = ""
        while True:
            bm = backend.allocate_bitmask(1)
            g.fill_bitmask(bm, 0)
            got = allowed_ids(bm, 0, V)
            assert got == brute_force(language, text), (kind, text)
            tok = rng.choice(sorted(got))
            assert g.accept_tokens([tok])
            if tok == EOS:
                assert g.is_terminated() and text in language
                break
            text += VOCAB[tok]
        # a token outside the mask is rejected
    g = backend.new_grammar(compiled)
    assert not g.accept_tokens([VOCAB.index("q")])


def test_any_whitespace_json_is_opt_in(backend):
    spec = CASES[3][1]
    compact = backend.new_grammar(backend.compile("json", spec, any_whitespace=False))
    loose = backend.new_grammar(backend.compile("json", spec, any_whitespace=True))
    spaced = [VOCAB.index(t) for t in ["{", " ", '"', "x", '"', ":", " ", " ", "true", " ", "}"]]
    assert not compact.accept_tokens(spaced)
    assert loose.accept_tokens(spaced)


def test_apply_grammar_bitmask_masks_only_constrained_rows(backend):
    compiled = backend.compile("choice", json.dumps(["no"]), any_whitespace=False)
    g = backend.new_grammar(compiled)
    bm = backend.allocate_bitmask(1)
    g.fill_bitmask(bm, 0)
    V = backend.vocab_size
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(3, V).to(dtype)
        ref = logits.float().clone()
        out = apply_grammar_bitmask(logits, (bm, {"r1": 0}), ["r0", "r1", "r2"])
        allowed = allowed_ids(bm, 0, V)
        assert torch.equal(out[0].float(), ref[0]) and torch.equal(out[2].float(), ref[2])
        for t in range(V):
            assert (out[1, t].item() == float("-inf")) == (t not in allowed)


def test_structured_outputs_params_validation():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(json={"type": "object"}, regex="a")
    with pytest.raises(ValueError, match="structured_outputs.json"):
        StructuredOutputsParams(json="{not json")
    with pytest.raises(ValueError, match="structured_outputs.choice"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="structured_outputs.choice"):
        StructuredOutputsParams(choice=["a"] * 5000)
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs={"json": {}})
    p = StructuredOutputsParams(json='{"type": "object", "properties": {"a": {"type": "integer"}}}')
    assert p.kind == "json" and json.loads(p.spec)["properties"]["a"]["type"] == "integer"
    assert StructuredOutputsParams(json_object=True).kind == "json_object"


@pytest.mark.parametrize("params", [
    StructuredOutputsParams(json={"type": "nonsense"}),
    StructuredOutputsParams(regex="(unclosed"),
    StructuredOutputsParams(grammar="root ::= ("),
])
def test_uncompilable_specs_raise_naming_the_field(params):
    with pytest.raises(ValueError, match=f"^structured_outputs.{params.kind}"):
        validate_structured_outputs(params, StructuredOutputsConfig())


def test_structured_outputs_config():
    assert StructuredOutputsConfig.parse('{"backend": "xgrammar"}').backend == "xgrammar"
    assert StructuredOutputsConfig.parse(None).disable_any_whitespace is True
    assert StructuredOutputsConfig.parse({"backend": "auto"}, reasoning_parser="qwen3").reasoning_parser == "qwen3"
    assert StructuredOutputsConfig.parse('{"max_sample_wait_ms": 0}').max_sample_wait_ms == 0
    for bad in ('{"backend": "outlines"}', '{"nope": 1}', "{bad json", "[1]", '{"max_sample_wait_ms": -1}',
                '{"max_sample_wait_ms": "5"}', '{"compile_thread_nice": 20}', '{"compile_thread_nice": 1.5}'):
        with pytest.raises(ValueError, match="structured_outputs_config"):
            StructuredOutputsConfig.parse(bad)
    with pytest.raises(ValueError, match="reasoning_parser"):
        StructuredOutputsConfig.parse(None, reasoning_parser="nope")


def test_tokenizer_info_is_kept_on_disk_and_equals_a_fresh_build(tmp_path, monkeypatch):
    """``tokenizer_info`` builds xgrammar's ``TokenizerInfo`` once per tokenizer source, keeps it under the cache
    folder and reads it back equal to a fresh build (vocabulary as decoded, metadata, stop ids); a damaged file is
    rebuilt; another vocab size or stop list is another entry."""
    import xgrammar as xgr

    from pagedllm.model_files import default_model_path
    from pagedllm.structured_output import xgrammar_backend
    from pagedllm.tokenizer import get_tokenizer

    tok = get_tokenizer(default_model_path())
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    fresh = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=49152, stop_token_ids=[2])
    built = xgrammar_backend.tokenizer_info(tok, 49152, [2])
    (entry,) = (tmp_path / "xgrammar").iterdir()
    calls = []
    real = xgr.TokenizerInfo.from_huggingface
    monkeypatch.setattr(xgr.TokenizerInfo, "from_huggingface", lambda *a, **k: calls.append(1) or real(*a, **k))
    read = xgrammar_backend.tokenizer_info(tok, 49152, [2])
    assert calls == []  # read back, not rebuilt
    for info in (built, read):
        assert info.dump_metadata() == fresh.dump_metadata()
        assert info.decoded_vocab == fresh.decoded_vocab
        assert info.stop_token_ids == [2] and info.special_token_ids == fresh.special_token_ids
    entry.write_text(entry.read_text()[:1000])  # truncated
    again = xgrammar_backend.tokenizer_info(tok, 49152, [2])
    assert calls == [1] and again.decoded_vocab == fresh.decoded_vocab
    assert xgrammar_backend.tokenizer_info(tok, 49152, [2, 0]).stop_token_ids == [0, 2]
    assert len(list((tmp_path / "xgrammar").iterdir())) == 2
    monkeypatch.setenv("PAGEDLLM_TOKENIZER_CACHE", "0")
    xgrammar_backend.tokenizer_info(tok, 49152, [7])
    assert len(list((tmp_path / "xgrammar").iterdir())) == 2
