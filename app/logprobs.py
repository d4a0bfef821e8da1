"""Log-probabilities in OpenAI's two shapes: chat (`content[]` of token, logprob, bytes and
top_logprobs) and completions (parallel `tokens`, `token_logprobs`, `top_logprobs` maps and
`text_offset` lists), and vLLM's `prompt_logprobs`."""

from __future__ import annotations


class TokenText:
    """Token id -> its bytes and its text, from the served tokenizer's byte table."""

    def __init__(self, table: list[bytes]):
        self.table = table
        self._chat: dict[int, tuple[str, list[int]]] = {}  # the tokens seen: their text and bytes

    def bytes(self, token_id: int) -> bytes:
        return self.table[token_id] if 0 <= token_id < len(self.table) else b""

    def text(self, token_id: int) -> str:
        return self.bytes(token_id).decode("utf-8", errors="replace")

    def label(self, token_id: int) -> str:
        """How a logprob entry names the token: its text."""
        return self.text(token_id)

    def chat(self, token_id: int) -> tuple[str, list[int]]:
        """The text and the byte list of a chat logprob entry, made once per token: a reply of
        128 choices with 20 alternatives has 1.3 million entries of a few thousand tokens."""
        found = self._chat.get(token_id)
        if found is None:
            found = self._chat[token_id] = (self.text(token_id), list(self.bytes(token_id)))
        return found


class TokenIdLabels(TokenText):
    """vLLM's return_tokens_as_token_ids: a logprob entry names its token "token_id:N", so that
    tokens whose bytes are not whole UTF-8 characters are told apart."""

    def label(self, token_id: int) -> str:
        return f"token_id:{token_id}"

    def chat(self, token_id: int) -> tuple[str, list[int]]:
        label = self.label(token_id)
        return label, list(label.encode())


def chat_logprobs(entries, tt: TokenText) -> dict:
    def item(token_id, logprob):
        text, raw = tt.chat(token_id)
        return {"token": text, "logprob": logprob, "bytes": raw}
    return {"content": [{**item(e.token_id, e.logprob),
                         "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries]}


def completion_logprobs(entries, tt: TokenText, prompt_entries=None, prompt_ids=(),
                        offset: int = 0) -> dict:
    """`prompt_entries` (echo): None for the first prompt token, then one per prompt token.
    `offset`: where the first token starts in the choice's text."""
    tokens, token_lps, tops, offsets = [], [], [], []
    pairs = []
    if prompt_entries is not None:
        pairs += [(tid, e) for tid, e in zip(prompt_ids, prompt_entries)]
    pairs += [(e.token_id, e) for e in entries]
    for tid, e in pairs:
        label = tt.label(tid)
        tokens.append(label)
        offsets.append(offset)
        offset += len(tt.text(tid))
        if e is None:
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(e.logprob)
        top = {tt.label(t): lp for t, lp in e.top}
        top.setdefault(label, e.logprob)  # OpenAI's map always holds the chosen token
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def prompt_logprobs(entries, prompt_ids, tt: TokenText) -> list:
    """vLLM's `prompt_logprobs`: None for the first prompt token, then for each a map of token id
    -> {logprob, rank, decoded_token}: the prompt's own token first, then the most likely ones."""
    out = []
    for tid, e in zip(prompt_ids, entries):
        if e is None:
            out.append(None)
            continue
        m = {str(tid): {"logprob": e.logprob, "rank": e.rank, "decoded_token": tt.label(tid)}}
        for rank, (t, lp) in enumerate(e.top, 1):  # (JSON's keys are strings)
            m.setdefault(str(t), {"logprob": lp, "rank": rank, "decoded_token": tt.label(t)})
        out.append(m)
    return out
