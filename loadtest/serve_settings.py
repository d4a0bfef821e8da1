"""`pageserve bench serve`'s flags (vLLM's names, and pageserve's earlier ones as aliases) and
the settings they resolve to: see bench_serve.py."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from pageserve.loadtest.serve_datasets import parse_buckets
from pageserve.loadtest.serve_metrics import METRICS, SLO_METRICS

ENDPOINTS = {"completions": "completions", "/v1/completions": "completions",
             "chat": "chat", "/v1/chat/completions": "chat"}
BACKENDS = {"openai": "completions", "vllm": "completions", "openai-chat": "chat"}


def add_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add = parser.add_argument
    add("--base-url", default=None, help="the server (default: http://--host:--port)")
    add("--host", default="127.0.0.1")
    add("--port", type=int, default=8000)
    add("--backend", choices=sorted(BACKENDS), default=None,
        help="openai or vllm: /v1/completions; openai-chat: /v1/chat/completions (vLLM's other "
        "backends are not served)")
    add("--endpoint", choices=sorted(ENDPOINTS), default=None,
        help="the API path (vLLM's), or pageserve's short names completions / chat")
    add("--model", default=None, help="default: the server's first model")
    add("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY, as vLLM reads it)")
    add("--label", default=None, help="the saved file's name prefix (default: the backend)")
    add("--seed", type=int, default=0)
    add("--num-prompts", type=int, default=1000)
    add("--request-rate", type=float, default=float("inf"),
        help="requests/s; inf sends them all at once")
    add("--burstiness", type=float, default=1.0,
        help="gamma shape of the arrival gaps: 1 is Poisson, lower is burstier")
    add("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    add("--ignore-eos", action="store_true", help="always on for the random dataset, as vLLM")
    for name, kind in (("temperature", float), ("top-p", float), ("top-k", int)):
        add(f"--{name}", type=kind, default=None, help="sent with every request when given "
            "(otherwise the server's default)")
    add("--disable-tqdm", "--no-progress", dest="disable_tqdm", action="store_true")

    data = parser.add_argument_group("dataset")
    data.add_argument("--dataset-name", choices=("random", "random-mm", "sharegpt", "prefix_repetition", "custom"),
                      default=None,
                      help="default: random. random's prompts are common English words cut to the "
                      "token count through the server's /tokenize and /detokenize (vLLM's are random "
                      "token ids); custom's prompts go as a user message with the chat endpoint and as "
                      "they are with completions (vLLM applies the chat template on the client)")
    data.add_argument("--dataset-path", default=None, help="the sharegpt JSON or custom JSONL file")
    data.add_argument("--dataset", default=None, metavar="NAME_OR_PATH",
                      help="pageserve's older name: synthetic (= random), shared-prefix "
                      "(= prefix_repetition) or a JSONL path (= custom with --dataset-path)")
    data.add_argument("--disable-shuffle", action="store_true")
    data.add_argument("--no-oversample", action="store_true")
    data.add_argument("--input-len", default=None, metavar="N|MIN:MAX",
                      help="N: --random-input-len N, as vLLM; MIN:MAX: the random dataset's "
                      "prompts (prefix_repetition's suffixes) are uniform in [MIN, MAX] tokens")
    data.add_argument("--output-len", default=None, metavar="N|MIN:MAX",
                      help="N: every dataset's output length, as vLLM; MIN:MAX: uniform in "
                      "[MIN, MAX] for random and prefix_repetition")
    data.add_argument("--random-input-len", type=int, default=1024,
                      help="prompt tokens, counting those the server adds (BOS)")
    data.add_argument("--random-output-len", type=int, default=128)
    data.add_argument("--random-range-ratio", type=float, default=0.0,
                      help="lengths uniform in [len * (1 - r), len * (1 + r)], 0 <= r < 1")
    data.add_argument("--random-prefix-len", type=int, default=0,
                      help="tokens of one prefix that every random prompt starts with")
    data.add_argument("--prefix-repetition-prefix-len", "--prefix-len", dest="prefix_len", type=int,
                      default=256)
    data.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    data.add_argument("--prefix-repetition-num-prefixes", type=int, default=10,
                      help="prompts per prefix: --num-prompts // this")
    data.add_argument("--prefix-repetition-output-len", type=int, default=128)
    data.add_argument("--sharegpt-output-len", type=int, default=None,
                      help="default: the reply's length in the server's tokens, without special "
                      "tokens (vLLM counts them with its own tokenizer, BOS included)")
    data.add_argument("--custom-output-len", type=int, default=256,
                      help="for rows without output_tokens")
    data.add_argument("--random-mm-base-items-per-request", type=int, default=1,
                      help="random-mm: images a request (chat endpoint)")
    data.add_argument("--random-mm-bucket-config", default="{(448, 448, 1): 1.0}",
                      help="random-mm: {(height, width, 1): probability, ...}, the images' sizes")

    report = parser.add_argument_group("results")
    report.add_argument("--percentile-metrics", default=None,
                        help="comma-separated, of " + ", ".join(METRICS) + " (default ttft,tpot,itl)")
    report.add_argument("--metric-percentiles", default="99", help="comma-separated, e.g. 50,90,99")
    report.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                        help="SLOs a request must all meet to count: ttft, tpot, e2el in ms")
    for name, key in (("ttft", "ttft"), ("tpot", "tpot"), ("e2e", "e2el")):
        report.add_argument(f"--slo-{name}-ms", type=float, default=None, help=f"= --goodput {key}:MS")
    report.add_argument("--save-result", action="store_true",
                        help="write the result JSON, and a PNG of it beside (vLLM writes no PNG)")
    report.add_argument("--save-detailed", action="store_true",
                        help="keep the per-request lists (input_lens, ttfts, itls, errors, ...); "
                        "start_times are seconds since the start (vLLM's: perf_counter readings)")
    report.add_argument("--result-dir", default=None)
    report.add_argument("--result-filename", default=None,
                        help="default: LABEL-RATEqps[-concurrencyN]-MODEL-DATE.json")
    report.add_argument("--output-json", default=None, metavar="PATH",
                        help="= --save-result --result-filename PATH")
    report.add_argument("--output-png", default=None, metavar="PATH",
                        help="the plot (default: beside a saved result; '' for none)")
    report.add_argument("--machine-limits", nargs="?", const="", default=None, metavar="MODEL",
                        help="after the run, load MODEL (default: the default model) here and measure "
                        "this machine's limits for it (read bandwidth, memory floor of a decode step, "
                        "64-row matmul ceiling); the report sets ITL p50 and output tok/s against them. "
                        "For a server on this machine, serving that model")
    return parser


@dataclass(frozen=True)
class Settings:
    base_url: str
    model: str | None
    api_key: str | None
    endpoint: str  # "completions" or "chat"
    backend: str  # vLLM's name for it: openai, vllm or openai-chat
    label: str
    seed: int
    num_prompts: int
    request_rate: float
    burstiness: float
    max_concurrency: int | None
    ignore_eos: bool
    sampling: tuple[tuple[str, float], ...]
    progress: bool
    dataset_name: str
    dataset_path: str | None
    shuffle: bool
    oversample: bool
    random_input_len: int
    random_output_len: int
    random_range_ratio: float
    random_prefix_len: int
    input_range: tuple[int, int] | None  # MIN:MAX given: instead of the length and ratio
    output_range: tuple[int, int] | None
    prefix_len: int
    num_prefixes: int
    suffix_range: tuple[int, int]
    prefix_output_range: tuple[int, int]
    sharegpt_output_len: int | None
    custom_output_len: int
    goodput: tuple[tuple[str, float], ...]
    percentile_metrics: tuple[str, ...]
    metric_percentiles: tuple[float, ...]
    save_result: bool
    save_detailed: bool
    result_dir: str | None
    result_filename: str | None
    output_png: str | None  # None: beside a saved result; "": none
    machine_limits: str | None = None  # None: not measured; "": the default model
    mm_items_per_request: int = 0  # random-mm: images a request
    mm_buckets: tuple[tuple[int, int, float], ...] = ()  # random-mm: (height, width, probability)


def _length(text: str | None) -> tuple[int | None, tuple[int, int] | None]:
    """--input-len / --output-len: N (vLLM's) or MIN:MAX (pageserve's range)."""
    if text is None:
        return None, None
    lo, sep, hi = text.partition(":")
    try:
        lo, hi = int(lo), int(hi) if sep else None
    except ValueError:
        raise ValueError(f"a length is N or MIN:MAX, got {text!r}") from None
    if hi is None:
        if lo < 1:
            raise ValueError(f"a length must be positive, got {text!r}")
        return lo, None
    if not 0 < lo <= hi:
        raise ValueError(f"a length range is MIN:MAX with 0 < MIN <= MAX, got {text!r}")
    return None, (lo, hi)


def parse_goodput(pairs: list[str]) -> dict[str, float]:
    """vLLM's --goodput: KEY:VALUE pairs, a request-level metric and its SLO in milliseconds."""
    slos = {}
    for pair in pairs:
        name, sep, value = pair.partition(":")
        try:
            slos[name] = float(value)
        except ValueError:
            sep = ""
        if not sep or slos[name] != slos[name]:
            raise ValueError(f"--goodput takes KEY:VALUE pairs (a metric and milliseconds), got {pair!r}")
        if name not in SLO_METRICS:
            raise ValueError(f"--goodput: {name!r} is not one of {', '.join(SLO_METRICS)}")
        if slos[name] < 0:
            raise ValueError(f"--goodput: {name} must be non-negative, got {slos[name]}")
    return slos


def resolve(ns: argparse.Namespace) -> Settings:
    """The command line, old names and new, as one set of settings; errors a user made raise
    ValueError."""
    name, path = ns.dataset_name, ns.dataset_path
    if ns.dataset is not None:
        if name is not None or path is not None:
            raise ValueError("--dataset is the older form of --dataset-name / --dataset-path: give one")
        legacy = {"synthetic": "random", "shared-prefix": "prefix_repetition"}
        name, path = (legacy[ns.dataset], None) if ns.dataset in legacy else ("custom", ns.dataset)
    name = name or "random"
    if name in ("random", "random-mm", "prefix_repetition") and path is not None:
        raise ValueError(f"the {name} dataset takes no --dataset-path")
    if name in ("sharegpt", "custom") and path is None:
        raise ValueError(f"the {name} dataset needs --dataset-path")
    in_n, in_range = _length(ns.input_len)
    out_n, out_range = _length(ns.output_len)
    endpoint = ENDPOINTS[ns.endpoint] if ns.endpoint else BACKENDS.get(ns.backend, "chat" if name == "random-mm"
                                                                         else "completions")
    if name == "random-mm" and endpoint != "chat":
        raise ValueError("the random-mm dataset sends images, which only the chat endpoint takes")
    if ns.random_mm_base_items_per_request < 1:
        raise ValueError("--random-mm-base-items-per-request must be at least 1")
    if ns.backend and BACKENDS[ns.backend] != endpoint:
        raise ValueError(f"--backend {ns.backend} does not serve the {endpoint} endpoint")
    backend = ns.backend or ("openai-chat" if endpoint == "chat" else "openai")
    goodput = parse_goodput(ns.goodput or [])
    for flag, key in (("slo_ttft_ms", "ttft"), ("slo_tpot_ms", "tpot"), ("slo_e2e_ms", "e2el")):
        value = getattr(ns, flag)
        if value is not None:
            goodput.update(parse_goodput([f"{key}:{value}"]))
    metrics = tuple((ns.percentile_metrics or "ttft,tpot,itl").split(","))
    if unknown := [m for m in metrics if m not in METRICS]:
        raise ValueError(f"--percentile-metrics: unknown {', '.join(unknown)} (of {', '.join(METRICS)})")
    try:
        percentiles = tuple(float(p) for p in ns.metric_percentiles.split(","))
    except ValueError:
        raise ValueError(f"--metric-percentiles takes numbers, got {ns.metric_percentiles!r}") from None
    if not all(0 <= p <= 100 for p in percentiles):
        raise ValueError("--metric-percentiles must be in [0, 100]")
    if ns.output_json is not None and ns.result_filename is not None:
        raise ValueError("--output-json is the older form of --save-result --result-filename: give one")
    if ns.max_concurrency is not None and ns.max_concurrency < 1:
        raise ValueError("--max-concurrency must be at least 1")
    if not 0.0 <= ns.random_range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {ns.random_range_ratio}")
    if not ns.request_rate > 0 or not ns.burstiness > 0:
        raise ValueError("--request-rate and --burstiness must be positive")
    output_len = out_n or ns.prefix_repetition_output_len
    return Settings(
        base_url=(ns.base_url or f"http://{ns.host}:{ns.port}").rstrip("/"), model=ns.model,
        api_key=ns.api_key or os.environ.get("OPENAI_API_KEY"), endpoint=endpoint,
        backend=backend, label=ns.label or backend,
        seed=ns.seed, num_prompts=ns.num_prompts, request_rate=ns.request_rate,
        burstiness=ns.burstiness, max_concurrency=ns.max_concurrency,
        ignore_eos=ns.ignore_eos or name in ("random", "random-mm"),
        sampling=tuple((k, getattr(ns, k)) for k in ("temperature", "top_p", "top_k")
                       if getattr(ns, k) is not None),
        progress=not ns.disable_tqdm, dataset_name=name, dataset_path=path,
        shuffle=not ns.disable_shuffle, oversample=not ns.no_oversample,
        random_input_len=in_n or ns.random_input_len, random_output_len=out_n or ns.random_output_len,
        random_range_ratio=ns.random_range_ratio, random_prefix_len=ns.random_prefix_len,
        input_range=in_range, output_range=out_range, prefix_len=ns.prefix_len,
        num_prefixes=ns.prefix_repetition_num_prefixes,
        suffix_range=in_range or (ns.prefix_repetition_suffix_len,) * 2,
        prefix_output_range=out_range or (output_len, output_len),
        sharegpt_output_len=out_n or ns.sharegpt_output_len,
        custom_output_len=out_n or ns.custom_output_len,
        goodput=tuple(sorted(goodput.items())), percentile_metrics=metrics,
        metric_percentiles=percentiles, save_result=ns.save_result or ns.output_json is not None,
        save_detailed=ns.save_detailed, result_dir=ns.result_dir,
        result_filename=ns.output_json if ns.output_json is not None else ns.result_filename,
        output_png=ns.output_png, machine_limits=ns.machine_limits,
        mm_items_per_request=ns.random_mm_base_items_per_request if name == "random-mm" else 0,
        mm_buckets=parse_buckets(ns.random_mm_bucket_config) if name == "random-mm" else ())
