"""Tokenizers (harts_client.tokenizer): the project's byte tokenizer, its Hugging Face form, and
foreign tokenizer.json directories."""
from __future__ import annotations

import json

import pytest

from harts_client.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

TEXTS = ["calc 37+45", "at 5: higher\n", "héllo ☃ \t\x7f\x03 end", ""]


def test_bytes_round_trip_and_specials():
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id) == (256, 0, 1, 2)
    for text in TEXTS:
        ids = tok.encode(text)
        assert all(2 < i < 256 for i in ids) and tok.decode(ids) == text
    assert tok.decode([1] + tok.encode("up") + [2, 0]) == "up"
    with pytest.raises(ValueError, match="control byte"):
        tok.encode("a\x02b")


def test_hf_files_load_in_tokenizers_and_transformers_with_the_same_ids(tmp_path):
    pytest.importorskip("tokenizers")
    tok = ByteTokenizer()
    tok.save(tmp_path)
    hf = HFTokenizer(tmp_path)
    assert (hf.vocab_size, hf.pad_id, hf.bos_id, hf.eos_id) == (256, 0, 1, 2)
    for text in TEXTS:
        assert hf.encode(text) == tok.encode(text) and hf.decode(tok.encode(text) + [2]) == text
    assert isinstance(load_tokenizer(tmp_path), ByteTokenizer)
    transformers = pytest.importorskip("transformers")
    fast = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert fast.eos_token_id == 2 and fast.pad_token_id == 0 and len(fast) == 256
    assert fast(TEXTS[2], add_special_tokens=False).input_ids == tok.encode(TEXTS[2])


def test_foreign_tokenizer_json_is_used_as_it_is(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    t = tokenizers.Tokenizer(models.WordLevel({"<unk>": 0, "</s>": 1, "up": 2, "down": 3}, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.add_special_tokens(["</s>"])
    t.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, HFTokenizer) and tok.eos_id == 1 and tok.pad_id == 1 and tok.bos_id is None
    assert tok.encode("up down up") == [2, 3, 2] and tok.decode([2, 1, 3]) == "up down"
    (tmp_path / "tokenizer_config.json").write_text("{}")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 1]}))
    assert HFTokenizer(tmp_path).eos_id == 3


def test_a_directory_without_a_tokenizer_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="expected a tokenizer"):
        load_tokenizer(tmp_path)
