"""The engine's own cost per step, with the model taken out: a null model whose forward returns
at once and whose logits are one fixed row. What is left is scheduling, block allocation, step
inputs, sampling, detokenization, stop checks and outputs: the part of every step that is not
the model, at N running requests."""

from __future__ import annotations

import argparse
import time

import torch

from pageserve.loadtest.common import distinct_prompts, save_json


def add_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", default=None, help="model directory or .gguf (its config, tokenizer "
                        "and vocabulary; default: the default model)")
    parser.add_argument("--num-seqs", type=int, default=64, help="running requests")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output-json", default=None, metavar="PATH")
    return parser


def null_model(llm) -> None:
    """Replace the model's forward and lm_head with ones that cost nothing: hidden states of
    zeros and one fixed row of logits (random, so that greedy picks varied tokens)."""
    model = llm.engine.runner.model
    hidden_size, vocab = model.cfg.hidden_size, model.cfg.vocab_size
    row = torch.randn(vocab, generator=torch.Generator().manual_seed(0))
    model.forward = lambda input_ids, positions, meta, kv_caches: torch.zeros(
        input_ids.shape[0], hidden_size)
    model.compute_logits = lambda hidden: row.expand(hidden.shape[0], vocab)


def main(args: argparse.Namespace) -> dict:
    from pageserve.runtime import LLM, SamplingParams

    llm = LLM(model=args.model, dtype="float32", kv_cache_memory=1.0, max_num_seqs=args.num_seqs)
    null_model(llm)
    vocab = llm.engine.config.model.vocab_size
    prompts = distinct_prompts(vocab, args.num_seqs, args.prompt_len)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    step_times: list[float] = []
    engine = llm.engine
    step = engine.step

    def timed_step():
        t = time.perf_counter()
        out = step()
        step_times.append(time.perf_counter() - t)
        return out

    engine.step = timed_step
    llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    rounds = []
    for _ in range(args.rounds):
        step_times.clear()
        llm.generate(prompts, params, use_tqdm=False)
        # the steps where every request was running and decoding: all but the first and last few
        full = sorted(step_times[2:-2])
        rounds.append({"steps": len(step_times), "p50_ms": full[len(full) // 2] * 1e3,
                       "mean_ms": sum(full) / len(full) * 1e3})
    result = {"num_seqs": args.num_seqs, "output_len": args.output_len, "rounds": rounds,
              "p50_ms": sorted(r["p50_ms"] for r in rounds)[len(rounds) // 2]}
    print(f"engine overhead (null model), {args.num_seqs} running requests: "
          + ", ".join(f"p50 {r['p50_ms']:.2f} ms / mean {r['mean_ms']:.2f} ms a step" for r in rounds))
    return save_json(result, args.output_json)


if __name__ == "__main__":
    main(add_args(argparse.ArgumentParser(description=__doc__)).parse_args())
