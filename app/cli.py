"""`pageserve serve`, `pageserve generate` and `pageserve bench`."""

from __future__ import annotations

import argparse
import logging
import sys


def shown_default(action: argparse.Action) -> str | None:
    """A flag's default as --help and docs/serving.md show it; None where the flag has none to
    show (unset or off: its help says what happens then)."""
    if not action.option_strings or action.default is None or action.default is False \
            or action.default == argparse.SUPPRESS:
        return None
    if isinstance(action, argparse.BooleanOptionalAction):
        return "on" if action.default else "off"
    if isinstance(action.default, (list, tuple)):
        return " ".join(str(v) for v in action.default)
    return str(action.default)


class HelpFormatter(argparse.HelpFormatter):
    """Each flag's help followed by its default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = (action.help or "").replace(" (default: %(default)s)", "")  # BooleanOptionalAction's own
        default = shown_default(action)
        return help_text if default is None else f"{help_text} (default: {default.replace('%', '%%')})"


def _add_generate(sub) -> None:
    from pageserve.runtime.engine_args import EngineArgs

    p = sub.add_parser("generate", help="generate text offline and print it", formatter_class=HelpFormatter)
    p.add_argument("prompts", nargs="+", help="one or more prompts")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--ignore-eos", action="store_true")
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=_generate)


def _generate(ns: argparse.Namespace) -> int:
    from pageserve.runtime import LLM, SamplingParams
    from pageserve.runtime.engine_args import EngineArgs

    args = EngineArgs.from_cli_args(ns)
    params = SamplingParams(temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k,
                            max_tokens=ns.max_tokens, ignore_eos=ns.ignore_eos)
    llm = LLM(**vars(args))
    if ns.chat:
        prompts = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in ns.prompts]
    else:
        prompts = ns.prompts
    outs = llm.generate(prompts, params)
    for i, out in enumerate(outs):
        if len(outs) > 1:
            print(f"--- [{i}] finish_reason={out.outputs[0].finish_reason}")
        print(out.outputs[0].text)
    return 0


def _add_bench(sub) -> None:
    from pageserve.loadtest import (bench_accuracy, bench_cache, bench_engine, bench_http, bench_lora,
                                    bench_offline, bench_peer, bench_pp, bench_quant, bench_spec, bench_sampling,
                                    bench_serve, bench_structured, soak)

    p = sub.add_parser("bench", help="benchmarks")
    bench_sub = p.add_subparsers(dest="bench", required=True)
    for name, module, help_text in (
            ("offline", bench_offline, "offline throughput against HF generate"),
            ("accuracy", bench_accuracy, "next-token agreement and KL divergence against HF, per dtype"),
            ("engine", bench_engine, "the engine's own cost per step, with a null model"),
            ("cache", bench_cache, "prefix caching TTFT and swap vs recompute throughput"),
            ("http", bench_http, "concurrent streaming clients vs the offline engine, and TTFT"),
            ("sampling", bench_sampling, "what every logits processor costs beside a decode step"),
            ("serve", bench_serve, "a serving benchmark against any OpenAI-compatible server"),
            ("peer", bench_peer, "the same load against several servers side by side, rounds alternated"),
            ("structured", bench_structured, "decode speed with a JSON schema vs without; grammar compile"),
            ("quant", bench_quant, "one stream of the default model: bfloat16 against its 4-bit, INT8 and FP8 copies"),
            ("lora", bench_lora, "decode with 8 LoRA adapters in a 64-request batch against the base model alone"),
            ("spec", bench_spec, "n-gram speculative decoding against one token a step, default model"),
            ("pp", bench_pp, "pipeline stages with one batch in flight against one per stage, same run"),
            ("soak", soak, "minutes of mixed load, then errors, RSS growth and free KV blocks")):
        b = bench_sub.add_parser(name, help=help_text)
        module.add_args(b)
        # a benchmark with targets (the soak) exits non-zero when it misses one
        b.set_defaults(func=lambda ns, m=module: getattr(m, "exit_code", lambda result: 0)(m.main(ns)))


def _add_serve(sub) -> argparse.ArgumentParser:
    from pageserve.app import serve

    p = sub.add_parser("serve", help="serve the OpenAI-compatible API", formatter_class=HelpFormatter,
                       description="Serve MODEL (default: SmolLM2-135M-Instruct) over the OpenAI API. "
                                   "Every flag, at more length: docs/serving.md.")
    serve.add_args(p)
    p.set_defaults(func=serve.run)
    return p


def build_parser(config: str | None = None) -> argparse.ArgumentParser:
    """`config`: serve's --config file, whose values become serve's defaults."""
    parser = argparse.ArgumentParser(prog="pageserve", description="LLM inference with a paged KV cache")
    sub = parser.add_subparsers(dest="command", required=True)
    serve_parser = _add_serve(sub)
    if config is not None:
        from pageserve.app.config_file import apply_config

        apply_config(config, serve_parser)
    _add_generate(sub)
    _add_bench(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from pageserve.app.config_file import ConfigFileError, config_path

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    argv = sys.argv[1:] if argv is None else list(argv)
    config = None
    try:
        if argv[:1] == ["serve"]:
            config, argv = config_path(argv)
        parser = build_parser(config)
    except ConfigFileError as e:
        print(f"pageserve serve: error: {e}", file=sys.stderr)
        return 2
    ns, unknown = parser.parse_known_args(argv)
    if unknown:
        from pageserve.app.vllm_flags import explain

        why = explain(unknown) if ns.command == "serve" else None
        if why is None:
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        print(f"pageserve serve: error: {why}", file=sys.stderr)
        return 2
    from pageserve.runtime.models.loader import ModelLoadError

    try:
        return ns.func(ns)
    except (ModelLoadError, ValueError) as e:
        # one clear line for the user, not a traceback
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
