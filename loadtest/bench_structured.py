"""What structured output costs: decode speed with a JSON schema against without, and how long
a grammar takes to compile, cold and cached. Default model, offline engine, one run.

- Decode: --batch chat requests of the same prompts, each generating exactly --max-tokens
  tokens. Without a schema, EOS is ignored; with one, the schema asks for more items than
  --max-tokens can hold, so neither side ends early and both produce the same token count. The
  two alternate in rounds (this machine's speed drifts); the ratio is the median over rounds.
- Compile: each of the fifty test schemas once on a fresh compiler (cold: regex and automaton
  over the whole vocabulary), then again (cached); also "any JSON object" and a tool call."""

from __future__ import annotations

import argparse
import statistics
import time

from pageserve.loadtest.common import save_json
from pageserve.loadtest.schemas import fifty_schemas

LONG = {"type": "object", "properties": {"items": {"type": "array", "minItems": 200, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                     "qty": {"type": "integer", "minimum": 0, "maximum": 999}},
    "required": ["name", "qty"], "additionalProperties": False}}}, "required": ["items"],
    "additionalProperties": False}


def add_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output-json", default=None, metavar="PATH")
    return parser


def _run(llm, conversations, params) -> tuple[float, int]:
    t0 = time.perf_counter()
    outs = llm.chat(conversations, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    return elapsed, sum(len(c.token_ids) for o in outs for c in o.outputs)


def compile_times(tokenizer) -> dict:
    from pageserve.grammar.compiler import GrammarCompiler
    from pageserve.app.tool_parsers import tool_format
    from pageserve.grammar.regexes import json_object_regex
    from pageserve.sampling.params import StructuredOutputsParams

    compiler = GrammarCompiler(tokenizer)
    t0 = time.perf_counter()
    compiler.submit("a").result()  # builds the vocabulary once
    vocab_s = time.perf_counter() - t0
    cold, cached = [], []
    for _, schema in fifty_schemas():
        spec = StructuredOutputsParams(json=schema)
        t0 = time.perf_counter()
        compiler.submit(compiler.regex(spec)).result()
        cold.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        compiler.submit(compiler.regex(spec)).result()
        cached.append(time.perf_counter() - t0)
    extra = {}
    weather = [("get_weather", fifty_schemas()[3][1])]
    for name, regex in (("json_object", json_object_regex()),
                        ("tool_call", tool_format("hermes").forced_regex(weather, True))):
        t0 = time.perf_counter()
        compiler.submit(regex).result()
        extra[name] = round(time.perf_counter() - t0, 3)
    compiler.shutdown()
    return {"vocabulary_build_s": round(vocab_s, 3),
            "schema_cold_ms": {"median": round(statistics.median(cold) * 1e3, 1), "max": round(max(cold) * 1e3, 1)},
            "schema_cached_us": {"median": round(statistics.median(cached) * 1e6, 1),
                                 "max": round(max(cached) * 1e6, 1)},
            "cold_s": extra}


def main(args) -> dict:
    from pageserve.runtime import LLM
    from pageserve.sampling.params import SamplingParams, StructuredOutputsParams

    llm = LLM(args.model, dtype=args.dtype, kv_cache_memory=1.0, max_model_len=2048,
              max_num_seqs=max(args.batch, 1))
    conversations = [[{"role": "user", "content": f"List {10 + i} things to buy at the market, as JSON."}]
                     for i in range(args.batch)]
    plain = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    schema = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(json=LONG))
    _run(llm, conversations[:2], plain)  # warm both paths (and compile the schema)
    _run(llm, conversations[:2], schema)
    rounds = []
    for i in range(args.rounds):
        t_plain, n_plain = _run(llm, conversations, plain)
        t_schema, n_schema = _run(llm, conversations, schema)
        assert n_plain == n_schema == args.batch * args.max_tokens, (n_plain, n_schema)
        rounds.append((n_plain / t_plain, n_schema / t_schema))
        print(f"round {i}: without schema {rounds[-1][0]:.1f} tok/s, with schema {rounds[-1][1]:.1f} tok/s, "
              f"slowdown {1 - rounds[-1][1] / rounds[-1][0]:+.1%}")
    ratio = statistics.median(s / p for p, s in rounds)
    compiles = compile_times(llm.engine.tokenizer)
    result = {"batch": args.batch, "max_tokens": args.max_tokens,
              "plain_tok_s": [round(p, 1) for p, _ in rounds], "schema_tok_s": [round(s, 1) for _, s in rounds],
              "schema_over_plain_median": round(ratio, 3), "compile": compiles}
    print(f"decode at batch {args.batch} with a JSON schema: {ratio:.3f}x the speed without one "
          f"({1 - ratio:.1%} slower; target under 10%)")
    print(f"grammar compile: vocabulary once {compiles['vocabulary_build_s']} s; a schema cold median "
          f"{compiles['schema_cold_ms']['median']} ms (max {compiles['schema_cold_ms']['max']} ms), cached median "
          f"{compiles['schema_cached_us']['median']} us; cold json_object {compiles['cold_s']['json_object']} s, "
          f"tool call {compiles['cold_s']['tool_call']} s")
    return save_json(result, args.output_json)


if __name__ == "__main__":
    main(add_args(argparse.ArgumentParser(description=__doc__)).parse_args())
