"""What sampling costs beside a decode step, at batch 64 on the default model.

Two measurements in one run, alternated in rounds (this machine's speed drifts):
- the engine's decode step with 64 running requests, greedy with no processor (the model
  forward and the least sampling), and the same step with every processor on (temperature,
  top-k, top-p, min-p, presence / frequency / repetition penalties, logit bias, min_tokens,
  logprobs, a seed on half the rows);
- the sampler alone on the same batch shape: building the step's sampling metadata and
  sampling [64, vocab] float32 logits with every processor on."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pageserve.loadtest.common import save_json


def add_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20, help="timed decode steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output-json", default=None, metavar="PATH")
    return parser


def every_processor(i: int, vocab: int):
    from pageserve.sampling.params import RequestOutputKind, SamplingParams

    return SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, presence_penalty=0.5,
                          frequency_penalty=0.3, repetition_penalty=1.1,
                          logit_bias={(17 * i + j) % vocab: 2.0 for j in range(8)}, min_tokens=4,
                          max_tokens=10_000, ignore_eos=True, logprobs=5,
                          seed=i if i % 2 else None, output_kind=RequestOutputKind.FINAL_ONLY)


def plain():
    from pageserve.sampling.params import RequestOutputKind, SamplingParams

    return SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True,
                          output_kind=RequestOutputKind.FINAL_ONLY)


def decode_step_ms(llm, make_params, args) -> float:
    engine = llm.engine
    vocab = engine.config.model.vocab_size
    ids = [engine.add_request([(7 * i + j) % 1000 + 100 for j in range(args.prompt_len)],
                              make_params(i, vocab) if make_params is every_processor else plain())
           for i in range(args.batch)]
    while any(engine.requests[r].num_computed_tokens < engine.requests[r].num_prompt_tokens for r in ids):
        engine.step()
    for _ in range(3):
        engine.step()  # all decoding now
    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    elapsed = (time.perf_counter() - t0) / args.steps
    for r in ids:
        engine.abort_request(r)
    engine.step()
    return elapsed * 1000


def sampler_ms(args, vocab: int, device: torch.device) -> float:
    from pageserve.sampling.penalties import TokenCounts
    from pageserve.sampling.sampler import SampleRow, SamplingMetadata, sample

    gen = torch.Generator().manual_seed(0)
    counts = TokenCounts(vocab, device)
    params = [every_processor(i, vocab) for i in range(args.batch)]
    tokens = [torch.randint(0, vocab, (args.prompt_len + 20,), generator=gen).tolist() for _ in params]
    logits = torch.randn(args.batch, vocab, generator=gen)
    own = {i: torch.Generator().manual_seed(i) for i in range(1, args.batch, 2)}
    times = []
    for step in range(args.steps + 3):
        t0 = time.perf_counter()
        rows = [SampleRow(f"r{i}", p, tokens[i], args.prompt_len, (0,)) for i, p in enumerate(params)]
        meta = SamplingMetadata(rows, device, vocab, own, counts)
        ids, logprobs = sample(logits, meta, gen)
        ids.tolist()
        if step >= 3:
            times.append(time.perf_counter() - t0)
    return statistics.mean(times) * 1000


def main(args) -> dict:
    from pageserve.runtime import LLM

    llm = LLM(model=args.model, dtype=args.dtype, kv_cache_memory=1.0, max_num_seqs=args.batch,
              max_model_len=2048)
    vocab = llm.engine.config.model.vocab_size
    rounds = []
    for i in range(args.rounds):
        base = decode_step_ms(llm, plain, args)
        full = decode_step_ms(llm, every_processor, args)
        alone = sampler_ms(args, vocab, torch.device("cpu"))
        rounds.append((base, full, alone))
        print(f"round {i}: decode step {base:.1f} ms plain, {full:.1f} ms with every processor; "
              f"sampler alone {alone:.1f} ms")
    base = statistics.median(r[0] for r in rounds)
    full = statistics.median(r[1] for r in rounds)
    alone = statistics.median(r[2] for r in rounds)
    result = {"batch": args.batch, "vocab": vocab, "decode_step_plain_ms": round(base, 2),
              "decode_step_all_processors_ms": round(full, 2), "sampler_alone_ms": round(alone, 2),
              "step_increase": round(full / base - 1, 3), "sampler_share_of_step": round(alone / full, 3)}
    print(f"batch {args.batch}: every processor adds {result['step_increase'] * 100:.1f}% to a decode "
          f"step; the sampler alone is {result['sampler_share_of_step'] * 100:.1f}% of the step "
          f"(target < 15%)")
    return save_json(result, args.output_json)


if __name__ == "__main__":
    main(add_args(argparse.ArgumentParser(description=__doc__)).parse_args())
