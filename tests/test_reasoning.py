"""Reasoning parsers (app/reasoning.py): the whole-text split, the streamed split at every split
point, where the prompt leaves the output, the end marker's token ids, and the registry."""

from __future__ import annotations

import random

import pytest

from pageserve.app.reasoning import (REASONING_PARSERS, DeepSeekR1ReasoningParser, Qwen3ReasoningParser,
                                     ReasoningState, reasoning_parser_class)
from pageserve.loadtest.tiny_model import build_tokenizer
from pageserve.sampling.params import StructuredOutputsParams

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def plain_tokenizer(tmp_path_factory):
    """The tiny model's BPE tokenizer: `</think>` is several tokens."""
    return build_tokenizer(tmp_path_factory.mktemp("plain-tok"))


@pytest.fixture(scope="module")
def think_tokenizer(tmp_path_factory):
    """The same with `<think>` and `</think>` added as tokens of their own, as in R1 and Qwen3."""
    tok = build_tokenizer(tmp_path_factory.mktemp("think-tok"))
    tok.add_tokens(["<think>", "</think>"])
    return tok


@pytest.fixture(scope="module")
def r1(think_tokenizer):
    return DeepSeekR1ReasoningParser(think_tokenizer)


@pytest.fixture(scope="module")
def qwen3(think_tokenizer):
    return Qwen3ReasoningParser(think_tokenizer)


R1_CASES = [  # output -> (reasoning, content)
    ("I think</think>Answer", ("I think", "Answer")),
    ("<think>I think</think>Answer", ("I think", "Answer")),  # an R1 that writes the tag itself
    ("<think>\nI think\n</think>\n\nAnswer", ("\nI think\n", "\n\nAnswer")),  # nothing stripped
    ("I only think", ("I only think", None)),  # no end: all reasoning (cut short)
    ("</think>Answer", ("", "Answer")),
    ("I think</think>", ("I think", None)),
    ("a</think>b</think>c<think>d", ("a", "b</think>c<think>d")),  # after the end: verbatim
    ("a<b</thin</thinking></think>c", ("a<b</thin</thinking>", "c")),  # lookalikes are text
    ("<<think>x<</think><", ("<x<", "<")),
    ("", ("", None)),
]
QWEN3_CASES = [
    ("<think>I think</think>Answer", ("I think", "Answer")),
    ("<think>\n\n</think>\n\nAnswer", ("\n\n", "\n\nAnswer")),
    ("Answer only", (None, "Answer only")),  # no think block: all content
    ("<think>cut short", ("cut short", None)),
    ("Hi <think>r</think> there", (None, "Hi <think>r</think> there")),  # a block opens first or never
    ("stray</think>text", (None, "stray</think>text")),
    ("</think>text", (None, "text")),
    ("\n <think>r</think>a", ("r", "a")),  # whitespace before the block is dropped
    ("  Hi", (None, "  Hi")),
    ('<tool_call>{"a": "<think>x</think>"}', (None, '<tool_call>{"a": "<think>x</think>"}')),
    ("<think>a</think>b<think>c</think>", ("a", "b<think>c</think>")),
    ("<thin>k</think", (None, "<thin>k</think")),
    ("", (None, None)),
]
TAG_PIECES = ["<think>", "</think>", "<", "</", "<th", "</thi", "think>", ">", "a", "b c", "\n", "é", "🙂"]


def _streamed(parser, text: str, pieces: list[str], prompt: str | None = None) -> tuple[str | None, str | None]:
    """Feed `pieces` (which join to `text`); the pieces handed out, joined."""
    assert "".join(pieces) == text
    stream = parser.stream(prompt)
    reasoning, content = [], []
    for piece in pieces + [None]:
        r, c = stream.feed(piece) if piece is not None else stream.feed("", last=True)
        reasoning.append(r)
        content.append(c)
    joined_r, joined_c = "".join(reasoning), "".join(content)
    return (joined_r if stream.reasoned else None), (joined_c or None)


def _every_split(text: str):
    yield [text]
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    yield list(text)  # one character at a time
    rng = random.Random(len(text))
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 5))))
        yield [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


@pytest.mark.parametrize("name, cases", [("r1", R1_CASES), ("qwen3", QWEN3_CASES)])
def test_whole_and_streamed_at_every_split(name, cases, request):
    parser = request.getfixturevalue(name)
    for text, expected in cases:
        assert parser.extract(text) == expected, text
        for pieces in _every_split(text):
            assert _streamed(parser, text, pieces) == expected, (text, pieces)


def _reference(name: str, text: str) -> tuple[str | None, str | None]:
    """The split written out plainly, for random texts: R1 reasons until the first </think>
    (dropping <think> tags); Qwen3 reasons only when the output starts with <think> (whitespace
    before it dropped), an output starting with </think> drops it, any other is all content."""
    if name == "qwen3":
        body = text.lstrip()
        if body.startswith("</think>"):
            return None, body[len("</think>"):] or None
        if not body.startswith("<think>"):
            return None, text or None
        text = body[len("<think>"):]
    reasoning, found, content = text.partition("</think>")
    return reasoning.replace("<think>", ""), content or None


@pytest.mark.parametrize("name", ["r1", "qwen3"])
def test_random_texts_split_as_written_out(name, request):
    """Random texts of tags, tag fragments and text, whole, one character at a time and cut at
    random: always the plain reference's split."""
    parser = request.getfixturevalue(name)
    rng = random.Random(7)
    for _ in range(500):
        text = "".join(rng.choice(TAG_PIECES) for _ in range(rng.randint(0, 12)))
        expected = _reference(name, text)
        assert parser.extract(text) == expected, text
        assert _streamed(parser, text, list(text)) == expected, text
        cut = rng.randint(0, len(text))
        assert _streamed(parser, text, [text[:cut], text[cut:]]) == expected, (text, cut)


def test_held_text_waits_for_the_next_delta(r1):
    """A delta ending in what may start a tag keeps it back; the next delta decides."""
    stream = r1.stream()
    assert stream.feed("abc</th") == ("abc", "")
    assert stream.feed("ink>de") == ("", "de")
    assert stream.reasoning_ended
    stream = r1.stream()
    assert stream.feed("x<") == ("x", "")
    assert stream.feed("y") == ("<y", "")
    assert stream.feed("</") == ("", "")
    assert stream.feed("", last=True) == ("</", "")  # the output ended: it was text after all


def test_the_prompt_decides_where_the_output_starts(r1, qwen3):
    r1_prompt = "<｜User｜>Hi<｜Assistant｜><think>\n"
    qwen3_thinking = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    qwen3_no_thinking = qwen3_thinking + "<think>\n\n</think>\n\n"
    qwen3_open = qwen3_thinking + "<think>\n"  # Qwen3-Thinking-2507's template opens the block
    history = ("<|im_start|>assistant\n<think>\nold\n</think>\n\ncall<|im_end|>\n<|im_start|>user\n"
               "result<|im_end|>\n<|im_start|>assistant\n")
    assert r1.initial_state(r1_prompt) == ReasoningState.REASONING
    assert r1.initial_state(None) == ReasoningState.REASONING
    assert qwen3.initial_state(qwen3_thinking) == ReasoningState.OPEN
    assert qwen3.initial_state(qwen3_no_thinking) == ReasoningState.CONTENT
    assert qwen3.initial_state(qwen3_open) == ReasoningState.REASONING
    assert qwen3.initial_state(history) == ReasoningState.OPEN  # an old turn's block decides nothing
    assert r1.initial_state(history) == ReasoningState.REASONING
    # enable_thinking false: all content, tags included, and no reasoning at all
    assert qwen3.extract("Answer</think>", qwen3_no_thinking) == (None, "Answer</think>")
    assert r1.extract("Answer", qwen3_no_thinking) == (None, "Answer")
    assert qwen3.extract("r</think>c", qwen3_open) == ("r", "c")
    assert _streamed(qwen3, "r</think>c", ["r</thi", "nk>c"], qwen3_open) == ("r", "c")


def test_grammar_waits_unless_the_prompt_closed_the_block(r1, qwen3):
    spec = StructuredOutputsParams(json={"type": "object"}, source="response_format")
    gated = qwen3.after_reasoning(spec, "<|im_start|>assistant\n")
    assert gated.reasoning_end == qwen3.end_token_ids and gated.json == spec.json and gated.source == spec.source
    assert gated.cache_key() == spec.cache_key()  # the same compiled grammar
    assert r1.after_reasoning(spec, "<think>\n").reasoning_end == r1.end_token_ids
    assert qwen3.after_reasoning(spec, "<think>\n\n</think>\n\n") is spec
    assert r1.after_reasoning(None, "x") is None


def test_end_token_ids_come_from_the_tokenizer(think_tokenizer, plain_tokenizer):
    assert DeepSeekR1ReasoningParser(think_tokenizer).end_token_ids == (
        think_tokenizer.convert_tokens_to_ids("</think>"),)
    several = Qwen3ReasoningParser(plain_tokenizer).end_token_ids
    assert len(several) > 1 and plain_tokenizer.decode(list(several)) == "</think>"
    # the tokenizers library's own Tokenizer works as well as transformers' wrapper
    assert Qwen3ReasoningParser(think_tokenizer.backend_tokenizer).end_token_ids == (
        think_tokenizer.convert_tokens_to_ids("</think>"),)
    assert Qwen3ReasoningParser(plain_tokenizer.backend_tokenizer).end_token_ids == several


def test_registry_and_unknown_names():
    assert set(REASONING_PARSERS) == {"deepseek_r1", "qwen3"}
    assert reasoning_parser_class("qwen3") is Qwen3ReasoningParser
    with pytest.raises(ValueError, match="unknown reasoning parser 'r1'; choose one of: deepseek_r1, qwen3"):
        reasoning_parser_class("r1")


def test_reasoning_end_is_checked():
    spec = StructuredOutputsParams(choice=["a"], reasoning_end=[5, 6])
    assert spec.reasoning_end == (5, 6)
    for bad in ([], [-1], ["x"], 5, [True]):
        with pytest.raises(ValueError, match="reasoning_end"):
            StructuredOutputsParams(choice=["a"], reasoning_end=bad)

