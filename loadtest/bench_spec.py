"""Speculative decoding on the default model against one token a step, in the same run, rounds
alternated (the machine drifts): output tokens per second of greedy requests, one stream at a
time and a batch of many. N-gram drafts by default; `--draft-layers L` drafts with the default
model's first L layers (loadtest/truncated_copy.py: the same tokenizer, embedding and head).

Loads, over files of this repository (500-1,500 tokens of code or text):
- "grounded": the file, then its first quarter again, to be continued (up to the rest of the
  file's length): an output that copies most of its input, as an edit of a pasted document does.
  The default model (135M) cannot follow an instruction to repeat a text (it writes code of its
  own), so the copy is set up by the prompt, which even small models continue;
- "instructed": the chat-template request "Repeat the following text exactly" with the file
  (up to --tokens): what the default model makes of it is mostly text of its own;
- "random": random token ids with ignore_eos, as `pageserve bench serve`'s random dataset.
Both engines are loaded once; each round runs the load on one, then the other.

    pageserve bench spec [--rounds 3] [--tokens 256] [--streams 1] [--load grounded,random] [--draft-layers 6]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from pageserve.loadtest.common import provenance, save_json

ROOT = Path(__file__).resolve().parent.parent
# files of this repository the grounded load pastes (code and prose)
GROUNDED_FILES = ("runtime/block_pool.py", "runtime/swap_space.py", "app/errors.py", "runtime/lora/request.py",
                  "docs/architecture.md")


def _files(llm, lo: int = 500, hi: int = 1500) -> list[list[int]]:
    """GROUNDED_FILES' token ids, cut to `hi`; those shorter than `lo` left out."""
    tok = llm.tokenizer
    ids = [tok((ROOT / name).read_text(), add_special_tokens=False)["input_ids"][:hi] for name in GROUNDED_FILES]
    return [i for i in ids if len(i) >= lo]


def instructed_prompts(llm, count: int) -> list[list[int]]:
    out = []
    for ids in _files(llm):
        messages = [{"role": "user", "content": "Repeat the following text exactly, with no comment:\n\n"
                     + llm.tokenizer.decode(ids)}]
        out.append(llm.apply_chat_template(messages))
    return (out * count)[:count]


def grounded_prompts(llm, count: int) -> list[tuple[list[int], int]]:
    """(prompt, max_tokens): a file, a line that announces it again, and its first quarter;
    max_tokens the rest of the file's length."""
    tok = llm.tokenizer
    out = []
    for ids in _files(llm):
        again = tok("\n\n----- the same file, once more -----\n\n", add_special_tokens=False)["input_ids"]
        out.append((ids + again + ids[:len(ids) // 4], len(ids) - len(ids) // 4))
    return (out * count)[:count]


def random_prompts(count: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(rng.randrange(100, 500))] for _ in range(count)]


def draft_copy(layers: str) -> Path:
    """Those of the default model's layers (truncated_copy.parse_layers), made once under the
    cache folder."""
    from pageserve.loadtest.truncated_copy import parse_layers, truncated_copy
    from pageserve.runtime.models.loader import cache_root, resolve_model

    out = cache_root() / "drafts" / f"default-layers-{layers.replace(',', '_')}"
    if (out / "model.gguf").exists():
        return out / "model.gguf"
    return truncated_copy(resolve_model(None), out, parse_layers(layers))


def tok_per_s(llm, prompts: list[tuple[list[int], int]], streams: int, ignore_eos: bool) -> float:
    """Output tokens per second of greedy requests (prompt, max_tokens), `streams` at a time."""
    from pageserve.runtime import SamplingParams

    generated, started = 0, time.perf_counter()
    for i in range(0, len(prompts), streams):
        batch = prompts[i:i + streams]
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=ignore_eos) for _, m in batch]
        outs = llm.generate([p for p, _ in batch], params, use_tqdm=False)
        generated += sum(len(o.outputs[0].token_ids) for o in outs)
    return generated / (time.perf_counter() - started)


def add_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=256,
                   help="output tokens a request (instructed and random; grounded: the rest of its file)")
    p.add_argument("--streams", type=int, default=1, help="requests decoded together")
    p.add_argument("--requests", type=int, default=None, help="requests a round (default: 2 x streams, at least 3)")
    p.add_argument("--load", default="grounded,random", help="grounded, instructed, random (comma-separated)")
    p.add_argument("--speculative-config", default='{"method": "ngram", "num_speculative_tokens": 4}')
    p.add_argument("--draft-layers", default=None,
                   help='draft with some of the default model\'s layers instead (method draft_model): "6" the '
                        'first six, "0-3,26-29" those')
    p.add_argument("--dtype", default="auto")
    p.add_argument("--output-json", default=None)
    return p


def main(args: argparse.Namespace) -> dict:
    from pageserve.runtime import LLM

    spec_config = json.loads(args.speculative_config)
    if args.draft_layers:
        spec_config = {"method": "draft_model", "model": str(draft_copy(args.draft_layers)),
                       "num_speculative_tokens": spec_config.get("num_speculative_tokens", 4)}
    common = dict(dtype=args.dtype, max_model_len=4096, kv_cache_memory=1.0, max_num_seqs=max(args.streams, 1),
                  enable_prefix_caching=False)
    engines = {"plain": LLM(None, **common), "spec": LLM(None, speculative_config=spec_config, **common)}
    n = args.requests or max(3, 2 * args.streams)
    loads = {}
    for name in args.load.split(","):
        if name == "grounded":
            loads[name] = (grounded_prompts(engines["plain"], n), False)
        elif name == "instructed":
            loads[name] = ([(q, args.tokens) for q in instructed_prompts(engines["plain"], n)], False)
        else:
            loads[name] = ([(q, args.tokens) for q in random_prompts(n, engines["plain"].engine.config.model.vocab_size)],
                           True)
    for llm in engines.values():  # warm-up
        tok_per_s(llm, [(random_prompts(1, 1000, seed=9)[0], 8)], 1, True)
    runs = {load: {e: [] for e in engines} for load in loads}
    accepted = {load: [0, 0, 0] for load in loads}  # drafts, draft tokens, accepted tokens
    for _ in range(args.rounds):
        for load, (prompts, ignore_eos) in loads.items():
            for name, llm in engines.items():
                before = engines["spec"].engine.stats().spec
                runs[load][name].append(tok_per_s(llm, prompts, args.streams, ignore_eos))
                after = engines["spec"].engine.stats().spec
                for i, field in enumerate(("num_drafts", "num_draft_tokens", "num_accepted_tokens")):
                    accepted[load][i] += getattr(after, field) - getattr(before, field)
    stats = engines["spec"].engine.stats().spec
    result = {"machine": {**provenance(), "threads": torch.get_num_threads()},
              "speculative_config": spec_config, "streams": args.streams, "requests": n,
              "tokens": args.tokens, "rounds": args.rounds, "tok_per_s": runs,
              "acceptance": {load: dict(zip(("drafts", "draft_tokens", "accepted_tokens"), a))
                             for load, a in accepted.items()},
              "accepted_per_position": stats.accepted_per_position}
    print(f"{args.streams} stream(s), {n} requests of up to {args.tokens} tokens a round, {args.rounds} rounds:")
    for load in loads:
        plain, spec = statistics.median(runs[load]["plain"]), statistics.median(runs[load]["spec"])
        result.setdefault("ratio", {})[load] = spec / plain
        drafts, proposed, took = accepted[load]
        print(f"  {load:<9} one token a step {plain:7.1f} tok/s, {spec_config['method']} {spec:7.1f} tok/s: "
              f"{spec / plain:.2f}x   (rounds speculative/plain: "
              f"{' '.join(f'{a:.0f}/{b:.0f}' for a, b in zip(runs[load]['spec'], runs[load]['plain']))}); "
              f"drafts accepted {took} of {proposed} tokens, mean acceptance length "
              f"{1 + took / drafts if drafts else 0:.2f}")
    print(f"  accepted by position in a run: {stats.accepted_per_position}")
    return save_json(result, args.output_json)


if __name__ == "__main__":
    main(add_args(argparse.ArgumentParser(description=__doc__,
                                          formatter_class=argparse.RawDescriptionHelpFormatter)).parse_args())
