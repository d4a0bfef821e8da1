"""`pageserve bench accuracy`: how closely the engine's next-token distributions follow Hugging
Face transformers' on the same weights, position by position over generated text.

The engine (in the first of `--dtypes`) writes greedy answers to chat prompts until at least
`--positions` tokens are generated. Every sequence (prompt and answer) is then scored whole by
each side, teacher-forced: the engine in each of `--dtypes` (its logits through prompt logprobs)
and HF in float32 and bfloat16 (the dense weights of the same safetensors the engine loads). At
every generated position the report gives top-1 agreement (the same argmax) and the KL
divergence KL(reference || other) of each pair, so that a bfloat16 engine can be set against HF
bfloat16 and, for scale, HF bfloat16 against HF float32."""

from __future__ import annotations

import argparse
import gc
from pathlib import Path

import torch

from pageserve.loadtest.common import save_json

QUESTIONS = [
    "Explain how a paged KV cache works in an inference server.", "Write a short poem about the sea.",
    "What are the main causes of inflation?", "Give me a recipe for pancakes.",
    "Summarize the plot of Romeo and Juliet.", "How do vaccines train the immune system?",
    "Write a Python function that checks whether a number is prime.", "What is the capital of Australia and why?",
    "Describe the water cycle to a ten-year-old.", "List five tips for a job interview.",
    "Why is the sky blue?", "Compare TCP and UDP.", "What happened during the French Revolution?",
    "How does a binary search work?", "Translate 'good morning, how are you?' into French and Spanish.",
    "Write a haiku about autumn leaves.", "What is photosynthesis?", "How should I start learning the guitar?",
    "Explain recursion with an example.", "What are black holes?", "Give three arguments for remote work.",
    "How do I make a good cup of coffee?", "What is the difference between a virus and a bacterium?",
    "Write a limerick about a cat.",
]


def add_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--dtypes", default="bfloat16,float32",
                        help="the engine's --dtype values to score, each with a --kv-cache-dtype after a slash "
                             "where it is not auto (bfloat16/fp8); the first writes the answers")
    parser.add_argument("--positions", type=int, default=2000, help="generated positions to score, at least")
    parser.add_argument("--max-tokens", type=int, default=160, help="per answer")
    parser.add_argument("--output-json", default=None, metavar="PATH")
    return parser


def _engine(model: str | None, dtype: str):
    """dtype: a --dtype, or DTYPE/KV_CACHE_DTYPE"""
    from pageserve.runtime import LLM

    dtype, _, kv = dtype.partition("/")
    return LLM(model=model, dtype=dtype, kv_cache_dtype=kv or "auto", kv_cache_memory=0.5, max_model_len=1024)


def answers(llm, positions: int, max_tokens: int) -> list[tuple[list[int], int]]:
    """(prompt + answer token ids, prompt length) of greedy answers, until `positions` tokens."""
    from pageserve.sampling.params import SamplingParams

    seqs, total, i = [], 0, 0
    while total < positions:
        q = QUESTIONS[i % len(QUESTIONS)] + ("" if i < len(QUESTIONS) else f" (take {i // len(QUESTIONS) + 1})")
        text = llm.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                 tokenize=False)
        prompt = llm.tokenizer.encode(text, add_special_tokens=False)
        out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=max_tokens, temperature=0),
                           use_tqdm=False)[0].outputs[0]
        seqs.append((prompt + list(out.token_ids), len(prompt)))
        total += len(out.token_ids)
        i += 1
    return seqs


def engine_logits(llm, seqs: list[tuple[list[int], int]]) -> list[torch.Tensor]:
    """The engine's float32 logits at every generated position of each sequence (the rows that
    predict its answer tokens), read from the prompt-logprob pass of the whole sequence."""
    from pageserve.sampling.params import SamplingParams

    runner = llm.engine.runner
    model, rows = runner.model, []
    plain, scoring = model.compute_logits, runner._prompt_logprobs

    def compute_logits(hidden):
        logits = plain(hidden)
        if capturing:
            rows.append(logits.float().clone())
        return logits

    def prompt_logprobs(*args):
        nonlocal capturing
        capturing = True
        try:
            return scoring(*args)
        finally:
            capturing = False

    capturing = False
    model.compute_logits, runner._prompt_logprobs = compute_logits, prompt_logprobs
    out = []
    try:
        for ids, n in seqs:
            rows.clear()
            llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
            allrows = torch.cat(rows)  # position p predicts token p + 1, p = 0 .. len - 2
            out.append(allrows[n - 1:len(ids) - 1])
    finally:
        model.compute_logits, runner._prompt_logprobs = plain, scoring
    return out


def hf_logits(path: str, seqs: list[tuple[list[int], int]], dtype: torch.dtype) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    from pageserve.runtime.models.gguf_file import dense_copy

    model = AutoModelForCausalLM.from_pretrained(dense_copy(Path(path)), dtype=dtype).eval()
    out = []
    with torch.inference_mode():
        for ids, n in seqs:
            logits = model(torch.tensor([ids])).logits[0].float()
            out.append(logits[n - 1:len(ids) - 1])
    del model
    gc.collect()
    return out


def compare(ref: list[torch.Tensor], other: list[torch.Tensor]) -> dict:
    r, o = torch.cat(ref).double(), torch.cat(other).double()
    agree = (r.argmax(-1) == o.argmax(-1)).double()
    lp, lq = r.log_softmax(-1), o.log_softmax(-1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    return {"positions": len(r), "top1_agreement": agree.mean().item(), "mean_kl": kl.mean().item(),
            "max_kl": kl.max().item(), "p99_kl": kl.quantile(0.99).item()}


def main(ns: argparse.Namespace) -> dict:
    dtypes = ns.dtypes.split(",")
    ours, seqs, path = {}, None, None
    for dtype in dtypes:
        llm = _engine(ns.model, dtype)
        try:
            if seqs is None:
                seqs = answers(llm, ns.positions, ns.max_tokens)
                path = llm.engine.config.model.path
            ours[dtype] = engine_logits(llm, seqs)
        finally:
            llm.engine.shutdown()
            del llm
            gc.collect()
    hf = {"float32": hf_logits(path, seqs, torch.float32), "bfloat16": hf_logits(path, seqs, torch.bfloat16)}
    pairs = {}
    for ref_name, ref in hf.items():
        for dtype, logits in ours.items():
            pairs[f"pageserve {dtype} vs HF {ref_name}"] = compare(ref, logits)
    pairs["HF bfloat16 vs HF float32"] = compare(hf["float32"], hf["bfloat16"])
    print(f"{sum(len(x) for x in ours[dtypes[0]])} generated positions in {len(seqs)} answers "
          f"(written by pageserve in {dtypes[0]})")
    print(f"{'pair':<40} {'top-1 agreement':>16} {'mean KL':>10} {'p99 KL':>10} {'max KL':>10}")
    for name, c in pairs.items():
        print(f"{name:<40} {c['top1_agreement'] * 100:15.2f}% {c['mean_kl']:10.2e} {c['p99_kl']:10.2e} "
              f"{c['max_kl']:10.2e}")
    return save_json({"model": path, "dtypes": dtypes, "answers": len(seqs), "pairs": pairs}, ns.output_json)


if __name__ == "__main__":
    main(add_args(argparse.ArgumentParser(description=__doc__)).parse_args())
