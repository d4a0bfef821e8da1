"""Incremental detokenization: whole characters only, stop strings caught across token
boundaries and never handed out early; the engine's streamed deltas join to its final text."""

from __future__ import annotations

import dataclasses
import random

import pytest

from pageserve.grammar.vocabulary import backend_tokenizer
from pageserve.runtime.detokenizer import IncrementalDetokenizer
from pageserve.runtime.outputs import RequestMetrics, RequestOutput
from pageserve.sampling.params import RequestOutputKind, SamplingParams

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tokenizer():
    from pageserve.runtime.models.loader import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model(None))


def _stream(tok, ids, stop=(), include=False, prompt=(1,)):
    detok = IncrementalDetokenizer(backend_tokenizer(tok), list(prompt), list(stop), include, True)
    pieces, found = [], None
    for t in ids:
        found = detok.add_token(t)
        pieces.append(detok.take_delta(finished=found is not None))
        if found:
            break
    else:
        pieces.append(detok.take_delta(finished=True))
    return pieces, found, detok


@pytest.mark.parametrize("text", ["你好，世界！今天天气很好。", "emoji 🙂🚀👨‍👩‍👧 done", "naïve café — ünïcödé",
                                  "Plain ASCII, with  two spaces and\nnew lines."])
def test_token_by_token_joins_to_the_whole_decode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces, _, _ = _stream(tokenizer, ids)
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)
    assert len(ids) > len(text.encode()) / 4  # several tokens, some splitting characters


def test_stop_string_across_tokens_is_cut_and_never_leaked(tokenizer):
    text = "The answer is forty-two. END OF STORY and more text after it"
    ids = tokenizer.encode(text, add_special_tokens=False)
    # the stop string spans several tokens
    assert len(tokenizer.encode(" END OF STORY", add_special_tokens=False)) >= 3
    pieces, found, _ = _stream(tokenizer, ids, stop=["END OF STORY"])
    assert found == "END OF STORY"
    assert "".join(pieces) == "The answer is forty-two. "
    for i in range(len(pieces)):  # no prefix handed out ever contains the start of the stop
        assert "END" not in "".join(pieces[:i + 1])
    pieces, found, _ = _stream(tokenizer, ids, stop=["END OF STORY"], include=True)
    assert "".join(pieces) == "The answer is forty-two. END OF STORY"


def test_held_back_text_is_released_when_the_stop_does_not_come(tokenizer):
    ids = tokenizer.encode("a b c ab abc", add_special_tokens=False)
    pieces, found, _ = _stream(tokenizer, ids, stop=["abcd"])
    assert found is None and "".join(pieces) == "a b c ab abc"
    # 'abc' might have been the start of 'abcd': held back until the end
    assert not "".join(pieces[:-1]).endswith("abc")


def test_requests_with_the_same_stop_strings_share_their_prefixes(tokenizer):
    """64 stop strings of 256 characters make 16K prefixes (3 MB): a thousand requests (or an
    n = 128 one's sequences) with the same stops held a set each, 3.4 GB in all."""
    stops = [f"{i:03d}" + "x" * 253 for i in range(64)]
    tok = backend_tokenizer(tokenizer)
    a, b = (IncrementalDetokenizer(tok, [5], list(stops), False, True) for _ in range(2))
    assert a.stop_prefixes is b.stop_prefixes and len(a.stop_prefixes) == 16200


def test_earliest_of_several_stop_strings_wins(tokenizer):
    ids = tokenizer.encode("one two three four", add_special_tokens=False)
    _, found, detok = _stream(tokenizer, ids, stop=["four", "two"])
    assert found == "two" and detok.text == "one "


def test_first_output_token_keeps_its_leading_space(tokenizer):
    prompt = tokenizer.encode("Hello", add_special_tokens=False)
    ids = tokenizer.encode(" world", add_special_tokens=False)
    pieces, _, _ = _stream(tokenizer, ids, prompt=prompt)
    assert "".join(pieces) == " world"


def test_engine_deltas_join_to_the_final_text(tiny_llm):
    engine = tiny_llm.engine
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 380) for _ in range(rng.randint(3, 40))] for _ in range(6)]
    finals = tiny_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                               use_tqdm=False)
    delta = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, output_kind=RequestOutputKind.DELTA,
                           prompt_logprobs=1)
    ids = [engine.add_request(p, delta) for p in prompts]
    texts, tokens = {i: "" for i in ids}, {i: [] for i in ids}
    firsts = set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            texts[out.request_id] += out.outputs[0].text
            tokens[out.request_id] += out.outputs[0].token_ids
            # the streamed output is built positionally: each field holds what its name says
            assert out.prompt_token_ids == prompts[ids.index(out.request_id)] and out.prompt is None
            assert isinstance(out.metrics, RequestMetrics) and out.embedding is None and out.lora_request is None
            assert out.finished == (len(tokens[out.request_id]) == 40)
            assert (out.prompt_logprobs is not None) == (out.request_id not in firsts)  # with the first delta only
            firsts.add(out.request_id)
    for rid, final in zip(ids, finals):
        assert texts[rid] == final.outputs[0].text
        assert tokens[rid] == final.outputs[0].token_ids
    assert [f.name for f in dataclasses.fields(RequestOutput)] == [
        "request_id", "prompt", "prompt_token_ids", "outputs", "finished", "metrics", "embedding", "prompt_logprobs",
        "lora_request"]


def test_engine_stop_string_sets_stop_reason(tiny_llm):
    free = tiny_llm.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0]
    stop = free.text[10:13]
    assert len(stop) == 3 and stop not in free.text[:10]
    out = tiny_llm.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                                      stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.text == free.text[:10]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert len(out.token_ids) < len(free.token_ids)


def test_embeddings_match_hf_mean_pooled_hidden_states(tiny_llm, tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    engine = tiny_llm.engine
    prompts = [[5, 6, 7, 8], list(range(3, 150))]  # the second spans chunked-prefill steps
    ids = [engine.add_embedding_request(p) for p in prompts]
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step()})
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
    for rid, p in zip(ids, prompts):
        with torch.no_grad():
            hidden = hf.model(torch.tensor([p])).last_hidden_state[0]
        ref = torch.nn.functional.normalize(hidden.mean(0), dim=0)
        ours = torch.tensor(outs[rid].embedding)
        assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()


def _byte_fallback_tokenizer():
    """A Llama/Mistral-style tokenizer: BPE with byte fallback tokens <0xNN>."""
    from tokenizers import Tokenizer, decoders
    from tokenizers.models import BPE

    vocab = {"a": 0, "b": 1, **{f"<0x{b:02X}>": 2 + b for b in range(256)}}
    tok = Tokenizer(BPE(vocab=vocab, merges=[], byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    return tok


def _llama_style_tokenizer():
    """SentencePiece as Llama's tokenizer.json has it: '▁' for spaces, byte fallback, the
    first leading space stripped, special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders
    from tokenizers.models import BPE

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ["▁the", "▁a", "▁cat", "s", "ing", "▁", "▁▁", "x", "中", "\n"]:
        vocab[piece] = len(vocab)
    tok = Tokenizer(BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return tok


@pytest.mark.parametrize("kind", ["default model", "llama-style"])
def test_deferred_decoding_gives_the_streams_text(tokenizer, kind):
    """A final-only request without stop strings is decoded once at the end: the same text as
    token by token, through whole texts, random ids, stray bytes and special tokens."""
    tok = backend_tokenizer(tokenizer) if kind == "default model" else _llama_style_tokenizer()
    vocab = tok.get_vocab_size()
    texts = ["你好，世界！", " emoji 🙂👨‍👩‍👧", "naïve — ünïcödé", "two  spaces\n\nlines", "<|im_end|> x <s>"]
    rng = random.Random(0)
    at_once = 0
    for trial in range(600):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(6))]
        if trial % 3 == 0:  # whole characters after any prompt (one that ends inside one too)
            ids = tok.encode(rng.choice(texts) + rng.choice(texts), add_special_tokens=False).ids
        else:  # any ids, or mostly the byte tokens (characters split and broken)
            ids = [rng.randrange(vocab if trial % 3 == 1 else 300) for _ in range(rng.randrange(1, 30))]
        skip = trial % 2 == 0
        streamed = IncrementalDetokenizer(tok, prompt, [], False, skip)
        deferred = IncrementalDetokenizer(tok, prompt, [], False, skip, deferred=True)
        for t in ids:
            assert streamed.add_token(t) is None and deferred.add_token(t) is None
        quick = IncrementalDetokenizer(tok, prompt, [], False, skip, deferred=True).decode_at_once(ids)
        text = streamed.take_delta(finished=True)
        assert deferred.take_delta(finished=True) == text, (ids, prompt, skip)
        assert quick in (None, text), (ids, prompt, skip)
        at_once += quick is not None
        if trial % 3 == 0:  # whole characters: always the one-call way
            assert quick is not None
    assert at_once >= 200  # the whole texts at least
    with pytest.raises(ValueError, match="stop strings"):
        IncrementalDetokenizer(tok, [], ["x"], False, True, deferred=True)


def test_stray_byte_tokens_never_raise_or_leak_the_prompt():
    tok = _byte_fallback_tokenizer()
    a, e4, b8, ad = 0, 2 + 0xE4, 2 + 0xB8, 2 + 0xAD
    # a character completed, then a lone lead byte, then a letter: the stream cannot continue
    pieces, _, detok = _stream(tok, [a, e4, b8, ad, e4, a], prompt=[1])
    text = "".join(pieces)
    assert text.startswith("a中") and text.endswith("a")
    # a prompt that ends inside a character: its bytes must not show up in the output
    pieces, _, _ = _stream(tok, [e4, a], prompt=[a, 1, e4, b8])
    assert "b" not in "".join(pieces) and "ab" not in "".join(pieces)


def test_many_long_stop_strings_stay_cheap(tokenizer):
    import time

    stops = [f"never-seen-{i:03d}-" + "x" * 200 for i in range(64)]
    ids = tokenizer.encode("word " * 400, add_special_tokens=False)
    start = time.perf_counter()
    pieces, found, _ = _stream(tokenizer, ids, stop=stops)
    per_token = (time.perf_counter() - start) / len(ids)
    assert found is None and "".join(pieces) == "word " * 400
    assert per_token < 2e-3, per_token  # a budget, not a benchmark: 100x what it takes here


def test_stop_strings_seen_before_min_tokens_stay_ignored(tokenizer):
    detok = IncrementalDetokenizer(backend_tokenizer(tokenizer), [1], ["\n", "END_OF_TEXT"], False, True)
    first, second = (tokenizer.encode(t, add_special_tokens=False) for t in ("hello\n", " world"))
    for t in first:
        assert detok.add_token(t, check_stop=False) is None  # before min_tokens
    for t in second:
        assert detok.add_token(t, check_stop=True) is None  # the old "\n" is not matched now
    assert detok.take_delta(finished=True) == "hello\n world"


def test_the_engine_tokenizes_whole_texts_whatever_tokenizer_json_turns_on(tiny_model_dir, tmp_path):
    """A tokenizer.json may turn padding or truncation on (transformers also sets them on the
    shared tokenizer per call): the engine's texts are tokenized by a copy with neither, each
    text alone, several at once or in threads."""
    import concurrent.futures
    import json
    import shutil

    from pageserve.runtime import LLM

    shutil.copytree(tiny_model_dir, tmp_path / "m")
    spec = json.loads((tmp_path / "m" / "tokenizer.json").read_text())
    spec["padding"] = {"strategy": "BatchLongest", "direction": "Right", "pad_to_multiple_of": None,
                       "pad_id": 0, "pad_type_id": 0, "pad_token": "<pad>"}
    spec["truncation"] = {"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0}
    (tmp_path / "m" / "tokenizer.json").write_text(json.dumps(spec))
    plain = backend_tokenizer(LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory=0.01).engine.tokenizer)
    engine = LLM(str(tmp_path / "m"), dtype="float32", kv_cache_memory=0.01).engine
    texts = ["hi", "hello there, how are you today?" * 4, "", "x<|endoftext|>y \u00e9 \U0001F642"]
    want = [plain.encode(t).ids for t in texts]
    assert len(want[1]) > 8 and engine.tokenize_all(texts) == want
    assert [engine.tokenize(t) for t in texts] == want
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        assert list(pool.map(engine.tokenize, texts * 8)) == want * 8
