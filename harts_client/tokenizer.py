"""Tokenizers for the generator side: the project's byte tokenizer and Hugging Face `tokenizer.json`.

    tok = ByteTokenizer()                      # ships with the project: no download, vocab 256
    ids = tok.encode("calc 37+45") + [tok.eos_id]
    tok = load_tokenizer("runs/rl_tiny/hf/step-00000004")   # whatever the model directory carries
    check_vocab(tok, model_vocab=256)          # one line before any weights are built, when they do not fit

Byte ids one to one with 0, 1, 2 reserved for pad, bos, eos; `hf_files()` writes it as a fast
tokenizer; trajectories carry ids, never re-encoded text (docs/design/training-loop.md,
"Conversations, tokenizers and data").
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

__all__ = ["Tokenizer", "ByteTokenizer", "HFTokenizer", "load_tokenizer", "check_vocab"]


class Tokenizer(Protocol):
    """What the tasks and engines need of a tokenizer."""

    vocab_size: int
    bos_id: int | None
    eos_id: int
    pad_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what the ByteLevel pre-tokenizer uses)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = list(keep)
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(keep, map(chr, chars)))


class ByteTokenizer:
    """UTF-8 bytes as ids (vocabulary 256); ids 0, 1, 2 are `<|pad|>`, `<|bos|>`, `<|eos|>`."""

    vocab_size = 256
    pad_id, bos_id, eos_id = 0, 1, 2
    SPECIALS = {"<|pad|>": 0, "<|bos|>": 1, "<|eos|>": 2}

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of `text`; ValueError for a byte that is a special id."""
        ids = list(text.encode("utf-8"))
        for i, b in enumerate(ids):
            if b <= self.eos_id:
                raise ValueError(f"text: expected no control byte 0-2 (the special ids), got byte {b} at position {i}")
        return ids

    def decode(self, ids: list[int]) -> str:
        """Text of the byte ids; special ids are dropped, invalid UTF-8 becomes U+FFFD."""
        return bytes(int(i) for i in ids if int(i) > self.eos_id).decode("utf-8", "replace")

    def hf_files(self) -> dict[str, str]:
        """{file name: text} of the same tokenizer in the Hugging Face fast-tokenizer format."""
        b2u = _bytes_to_unicode()
        vocab = {**self.SPECIALS, **{b2u[b]: b for b in range(self.eos_id + 1, 256)}}
        added = [{"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
                  "special": True} for s, i in self.SPECIALS.items()]
        tokenizer = {
            "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
            "post_processor": None,
            "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                      "vocab": vocab, "merges": []},
        }
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "harts_tokenizer": "bytes", "bos_token": "<|bos|>",
                  "eos_token": "<|eos|>", "pad_token": "<|pad|>", "model_max_length": 1 << 20,
                  "add_bos_token": False, "add_eos_token": False}
        specials = {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>"}
        return {"tokenizer.json": json.dumps(tokenizer, ensure_ascii=False), "tokenizer_config.json": json.dumps(config, indent=1),
                "special_tokens_map.json": json.dumps(specials, indent=1)}

    def save(self, directory: str | Path) -> None:
        """Write `hf_files()` into `directory` (created)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        for name, text in self.hf_files().items():
            (directory / name).write_text(text, encoding="utf-8")


class HFTokenizer:
    """A Hugging Face `tokenizer.json` (the `tokenizers` package; no transformers, no torch).

    Args:
        directory: holds tokenizer.json; eos/bos/pad come from tokenizer_config.json (else
            generation_config.json / config.json ids).
    """

    def __init__(self, directory: str | Path):
        try:
            from tokenizers import Tokenizer as _Tok
        except ImportError as exc:
            raise ValueError(f"{directory}: a tokenizer.json needs the `tokenizers` package, got {exc}") from None
        directory = Path(directory)
        self._tok = _Tok.from_file(str(directory / "tokenizer.json"))
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        cfg = _read_json(directory / "tokenizer_config.json")
        gen = {**_read_json(directory / "config.json"), **_read_json(directory / "generation_config.json")}

        def special(name: str) -> int | None:
            tok = cfg.get(name)
            if isinstance(tok, dict):
                tok = tok.get("content")
            if isinstance(tok, str) and self._tok.token_to_id(tok) is not None:
                return int(self._tok.token_to_id(tok))
            value = gen.get(f"{name}_id")
            if isinstance(value, list):
                value = value[0] if value else None
            return None if value is None else int(value)

        eos = special("eos_token")
        if eos is None:
            raise ValueError(f"{directory}: expected an eos token in tokenizer_config.json or generation_config.json, got none")
        self.eos_id = eos
        self.bos_id = special("bos_token")
        pad = special("pad_token")
        self.pad_id = eos if pad is None else pad

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)


def _read_json(path: Path) -> dict:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def load_tokenizer(directory: str | Path) -> ByteTokenizer | HFTokenizer:
    """The tokenizer a model directory carries (docs/design/training-loop.md, "Conversations, tokenizers and data").

    Raises:
        ValueError: no tokenizer.json / tokenizer_config.json naming the byte tokenizer.
    """
    directory = Path(directory)
    if _read_json(directory / "tokenizer_config.json").get("harts_tokenizer") == "bytes":
        return ByteTokenizer()
    if (directory / "tokenizer.json").is_file():
        return HFTokenizer(directory)
    raise ValueError(f"{directory}: expected a tokenizer (tokenizer.json, or a tokenizer_config.json naming "
                     "harts_tokenizer 'bytes'), got none")


def check_vocab(tokenizer, model_vocab: int, *, model: str = "model") -> None:
    """ValueError (one line) when `tokenizer` (or a conversation format) and a model of `model_vocab`
    ids do not fit: the tokenizer has ids the model cannot embed, or it is the byte tokenizer and the
    model can sample ids it cannot decode (any vocabulary but its 256).

    Args:
        model: what the message calls the model (its name or directory).
    """
    tok = getattr(tokenizer, "tokenizer", tokenizer)  # a PlainFormat's tokenizer
    size = int(getattr(tokenizer, "vocab_size", tok.vocab_size))
    if model_vocab < size:
        raise ValueError(f"model.name: expected a model vocabulary of at least the tokenizer's {size} ids, got "
                         f"vocab_size {model_vocab} ({model}); use the model's own tokenizer (model.tokenizer)")
    if isinstance(tok, ByteTokenizer) and model_vocab != tok.vocab_size:
        raise ValueError(f"model.name: expected vocab_size {tok.vocab_size} for the byte tokenizer (it decodes byte ids "
                         f"only), got {model_vocab} ({model}); give the model's tokenizer.json (model.tokenizer, or "
                         "a tokenizer in the model directory)")
