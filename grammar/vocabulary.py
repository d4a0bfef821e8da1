"""The vocabulary a grammar is compiled against: the real bytes of every token."""

from __future__ import annotations


def vocabulary_tokens(tokenizer) -> tuple[int, dict[bytes, list[int]], int]:
    """(EOS id, bytes -> token ids, number of token ids) for an outlines-core Vocabulary.
    Byte-level BPE characters are mapped back to bytes and SentencePiece's '▁' to a space (see
    `token_byte_table`), so a multi-byte character split over tokens is matched byte by byte.
    Special and added tokens are left out: a grammar never writes them."""
    from runtime.detokenizer import token_byte_table  # here: importing runtime loads torch

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
