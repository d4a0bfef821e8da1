"""Reasoning parsers (`--reasoning-parser`): what a reasoning model writes between its think
tags is reasoning (`reasoning_content`), the rest is content, whole or streamed; the tags go
to neither. The semantics are those of vLLM's parsers of the same names:

- `deepseek_r1`: DeepSeek-R1's template opens `<think>` in the prompt, so the output starts in
  reasoning (a `<think>` the model writes anyway is dropped) until `</think>`; an output with
  no `</think>` is all reasoning.
- `qwen3`: Qwen3 writes `<think>...</think>` itself, first thing: a think block opens only at
  the start of the output (after whitespace at most), so an output that starts otherwise is
  all content, verbatim, tags written later (say in a tool call's arguments) included.

Both first look at where the prompt left off: a prompt whose last think tag is `<think>` with
only whitespace after it (templates that open the block, like R1's and Qwen3-Thinking-2507's)
starts the output in reasoning; one whose last is `</think>` (Qwen3's empty block for
`enable_thinking: false`) starts it in content, with no reasoning. After the first `</think>`
the output is content, verbatim, as in vLLM.

Text is split on the tags' text, so a tag split across tokens or deltas is found as well. For
the grammar of structured output and tool calls the end of reasoning is on token ids
(`end_token_ids`), as the engine sees the output: see `after_reasoning`."""

from __future__ import annotations

import dataclasses
import enum

from pageserve.grammar.matcher import reasoning_end_position
from pageserve.sampling.params import StructuredOutputsParams, ThinkingBudget


class ReasoningState(enum.IntEnum):
    REASONING = 0  # inside the think block
    OPEN = 1  # the output's start: a <think> there opens a block, anything else is content (qwen3)
    CONTENT = 2  # the reasoning is over: everything is content, verbatim


class ThinkingTokens:
    """Counts an output's thinking tokens as its pieces come: those up to the end of the thinking
    (its end marker included), all of them while it has not ended, none where it did not think."""

    __slots__ = ("end", "token_ids", "end_at")

    def __init__(self, end_token_ids: tuple[int, ...]):
        self.end, self.token_ids = end_token_ids, []
        self.end_at: int | None = None  # where the thinking ended in token_ids, once it has

    def add(self, token_ids) -> None:
        before = len(self.token_ids)
        self.token_ids.extend(token_ids)
        if self.end_at is None:
            self.end_at = reasoning_end_position(self.token_ids, self.end, max(0, before - len(self.end) + 1))

    def count(self, reasoned: bool) -> int:
        """`reasoned`: the output entered a think block (ReasoningStream.reasoned)."""
        if not reasoned:
            return 0
        return len(self.token_ids) if self.end_at is None else self.end_at


class ReasoningStream:
    """Splits one output's text deltas into (reasoning, content) pieces. Text that may be the
    start of a tag is held back until the next delta decides it, or the output ends."""

    __slots__ = ("start_tag", "end_tag", "state", "held", "reasoned")

    def __init__(self, start_tag: str, end_tag: str, state: ReasoningState):
        self.start_tag, self.end_tag = start_tag, end_tag
        self.state = state
        self.held = ""
        self.reasoned = state == ReasoningState.REASONING  # a think block was entered

    @property
    def reasoning_ended(self) -> bool:
        return self.state == ReasoningState.CONTENT

    def feed(self, delta: str, last: bool = False) -> tuple[str, str]:
        """The next piece of output text -> (reasoning, content) that it completes ("" for
        none). `last`: the output ends with this piece, so nothing is held back."""
        text, self.held = self.held + delta, ""
        reasoning: list[str] = []
        content: list[str] = []
        while text and self.state != ReasoningState.CONTENT:
            if self.state == ReasoningState.OPEN:
                text = self._start(text)
                if self.state == ReasoningState.OPEN:  # not decided yet: all of it is held
                    break
                continue
            at, tag = self._first_tag(text)
            if tag is None:
                keep = self._partial_tag(text)
                reasoning.append(text[:len(text) - keep])
                self.held = text[len(text) - keep:]
                break
            reasoning.append(text[:at])
            text = text[at + len(tag):]
            if tag == self.end_tag:  # a repeated start tag inside the block is dropped
                self.state = ReasoningState.CONTENT
        else:
            content.append(text)
        if last and self.held:
            (reasoning if self.state == ReasoningState.REASONING else content).append(self.held)
            self.held = ""
        return "".join(reasoning), "".join(content)

    def _start(self, text: str) -> str:
        """At the start of an output that may open a think block: a block opens only there
        (after whitespace at most), so a tag written later, say inside a tool call's arguments,
        stays content. Returns the text left after the decision, or holds it all."""
        body = text.lstrip()
        for tag, state in ((self.start_tag, ReasoningState.REASONING), (self.end_tag, ReasoningState.CONTENT)):
            if body.startswith(tag):
                self.state, self.reasoned = state, self.reasoned or state == ReasoningState.REASONING
                return body[len(tag):]
        if self.start_tag.startswith(body) or self.end_tag.startswith(body):  # whitespace or a tag's start
            self.held = text
            return ""
        self.state = ReasoningState.CONTENT
        return text

    def _first_tag(self, text: str) -> tuple[int, str | None]:
        found = [(i, tag) for tag in (self.start_tag, self.end_tag) if (i := text.find(tag)) != -1]
        return min(found) if found else (-1, None)

    def _partial_tag(self, text: str) -> int:
        """Length of the longest end of `text` that is the beginning of a tag."""
        longest = max(len(self.start_tag), len(self.end_tag)) - 1
        for k in range(min(longest, len(text)), 0, -1):
            tail = text[-k:]
            if self.start_tag.startswith(tail) or self.end_tag.startswith(tail):
                return k
        return 0


def tag_token_ids(tokenizer, tag: str) -> tuple[int, ...]:
    """The ids a tag is written with: its own (added) token when the vocabulary has one, else
    the tokenizer's encoding of the tag alone (a model may merge it differently with the text
    around it; reasoning models have `</think>` as one token)."""
    vocab = tokenizer.get_vocab()
    if tag in vocab:
        return (vocab[tag],)
    encoded = tokenizer.encode(tag, add_special_tokens=False)
    ids = tuple(getattr(encoded, "ids", encoded))
    if not ids:
        raise ValueError(f"the tokenizer writes {tag!r} as no tokens")
    return ids


class ReasoningParser:
    """One per server, built from the model's tokenizer. Per request: `stream(prompt)` for a
    streamed output, `extract(text, prompt)` for a whole one, `after_reasoning(spec, prompt)`
    for its grammar. `prompt` is the text the model continues (the rendered chat template)."""

    name = ""
    start_tag = "<think>"
    end_tag = "</think>"
    first_state = ReasoningState.REASONING  # where an output starts when the prompt says nothing

    def __init__(self, tokenizer):
        self.end_token_ids = tag_token_ids(tokenizer, self.end_tag)  # ends reasoning in the engine
        self.start_token_ids = tag_token_ids(tokenizer, self.start_tag)

    def initial_state(self, prompt: str | None = None) -> ReasoningState:
        """Where the output starts: the prompt's last think tag decides when only whitespace
        follows it (the template opened or closed the block), else the parser's default."""
        if prompt:
            start, end = prompt.rfind(self.start_tag), prompt.rfind(self.end_tag)
            at, tag = max((start, self.start_tag), (end, self.end_tag))
            if at != -1 and not prompt[at + len(tag):].strip():
                return ReasoningState.REASONING if tag == self.start_tag else ReasoningState.CONTENT
        return self.first_state

    def stream(self, prompt: str | None = None) -> ReasoningStream:
        return ReasoningStream(self.start_tag, self.end_tag, self.initial_state(prompt))

    def extract(self, text: str, prompt: str | None = None) -> tuple[str | None, str | None]:
        """A whole output -> (reasoning, content): reasoning None when no think block was
        entered, content None when empty (as vLLM). The same split as streaming it."""
        stream = self.stream(prompt)
        reasoning, content = stream.feed(text, last=True)
        return (reasoning if stream.reasoned else None), (content or None)

    def after_reasoning(self, spec: StructuredOutputsParams | None,
                        prompt: str | None = None) -> StructuredOutputsParams | None:
        """A request's grammar as the engine should apply it: from the end of reasoning on
        (the engine waits for `end_token_ids` in the output), or from the first token when the
        prompt already closed the think block. Where the output may open a block itself (qwen3)
        and the start tag is one token, the engine lets the first token decide: that token opens
        the thinking, any other is the grammar's (a start tag of several tokens: it waits)."""
        state = self.initial_state(prompt)
        if spec is None or state == ReasoningState.CONTENT:
            return spec
        opener = self.start_token_ids[0] if state == ReasoningState.OPEN and len(self.start_token_ids) == 1 else None
        return dataclasses.replace(spec, reasoning_end=self.end_token_ids, reasoning_start=opener)


    def budget(self, tokens: int, prompt: str | None = None) -> ThinkingBudget | None:
        """At most `tokens` tokens of thinking for an output that continues `prompt`: None when
        the prompt closed the think block (nothing to bound), or when the output may open one
        whose start tag is several tokens (the engine cannot tell it opened)."""
        state = self.initial_state(prompt)
        if state == ReasoningState.CONTENT:
            return None
        if state == ReasoningState.OPEN:
            if len(self.start_token_ids) != 1:
                return None
            return ThinkingBudget(tokens, self.end_token_ids, self.start_token_ids[0])
        return ThinkingBudget(tokens, self.end_token_ids)


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    first_state = ReasoningState.REASONING


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    first_state = ReasoningState.OPEN


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    cls.name: cls for cls in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)}


def reasoning_parser_class(name: str) -> type[ReasoningParser]:
    """The parser named by --reasoning-parser; ValueError listing the names for another."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of: "
                         f"{', '.join(REASONING_PARSERS)}") from None
