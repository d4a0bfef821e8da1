"""The real bytes of every token: what a grammar is compiled against, and what logprobs
report. Torch-free, so that grammar, runtime and app can all use it."""

from __future__ import annotations

import json
import re

from tokenizers import Tokenizer


def backend_tokenizer(tokenizer) -> Tokenizer:
    """The Rust `tokenizers.Tokenizer` behind a transformers fast tokenizer."""
    return tokenizer if isinstance(tokenizer, Tokenizer) else tokenizer.backend_tokenizer


def vocabulary_tokens(tokenizer) -> tuple[int, dict[bytes, list[int]], int]:
    """(EOS id, bytes -> token ids, number of token ids) for an outlines-core Vocabulary.
    Byte-level BPE characters are mapped back to bytes and SentencePiece's '▁' to a space (see
    `token_byte_table`), so a multi-byte character split over tokens is matched byte by byte.
    Special and added tokens are left out: a grammar never writes them."""
    table = token_byte_table(tokenizer)
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no EOS token; structured output needs one")
    by_bytes: dict[bytes, list[int]] = {}
    for token_id, raw in enumerate(table):
        if raw and token_id not in special:
            by_bytes.setdefault(raw, []).append(token_id)
    return eos, by_bytes, len(table)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level BPE alphabet: each byte is shown as one printable character."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def token_byte_table(tokenizer) -> list[bytes]:
    """The real bytes of every token id: byte-level BPE characters mapped back to bytes,
    SentencePiece's '▁' turned into a space and its <0xNN> byte tokens into that byte; added
    (special) tokens as their text."""
    backend = backend_tokenizer(tokenizer)
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders") or []}
    byte_level = "ByteLevel" in kinds
    to_byte = {c: b for b, c in _bytes_to_unicode().items()}
    added = {i for i in backend.get_added_tokens_decoder()}
    vocab = backend.get_vocab(with_added_tokens=True)
    table = [b""] * (max(vocab.values()) + 1 if vocab else 0)
    for text, i in vocab.items():
        if i in added:
            table[i] = text.encode()
        elif byte_level and all(c in to_byte for c in text):
            table[i] = bytes(to_byte[c] for c in text)
        elif _BYTE_TOKEN.fullmatch(text):
            table[i] = bytes([int(text[3:5], 16)])
        else:
            table[i] = text.replace("\u2581", " ").encode()
    return table


_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
