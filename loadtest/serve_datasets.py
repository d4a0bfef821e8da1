"""The prompts of `pageserve bench serve`: vLLM's `random`, `random-mm` (random prompts with
images), `sharegpt`, `prefix_repetition` and `custom` datasets.

The bench carries no tokenizer of its own. Where the server answers `POST /tokenize` and
`POST /detokenize` (pageserve and vLLM both do), lengths are counted and synthetic prompts cut
in the served model's own tokens. Where it does not, a word counts as one token: synthetic
prompts are words from a list of common English words (about one token each on Llama and Qwen
vocabularies) and a text's length is its word count."""

from __future__ import annotations

import asyncio
import json
import math
import random
from dataclasses import dataclass, replace

import httpx

WORDS = ("time year people way day man thing woman life child world school state family student "
         "group country problem hand part place case week company system program question work "
         "government number night point home water room mother area money story fact month lot "
         "right study book eye job word business issue side kind head house service friend father "
         "power hour game line end member law car city community name president team minute idea").split()

# vLLM's ShareGPT filter: both sides at least 4 tokens, the prompt at most 1024, both at most 2048
MIN_LEN, MAX_PROMPT_LEN, MAX_TOTAL_LEN = 4, 1024, 2048


@dataclass(slots=True)
class SampleRequest:
    prompt: str
    prompt_len: int  # tokens, as the dataset counted them (its images' not included)
    output_len: int  # the request's max_tokens
    images: tuple[str, ...] = ()  # data: URLs, sent as image_url parts after the text


class ServerTokens:
    """The served model's tokenizer, through the server's /tokenize and /detokenize."""

    def __init__(self, client: httpx.AsyncClient, model: str):
        self.client, self.model = client, model
        self.name = model
        self.gate = asyncio.Semaphore(16)

    async def encode(self, text: str, special: bool = False) -> list[int]:
        async with self.gate:
            r = await self.client.post("/tokenize", json={"model": self.model, "prompt": text,
                                                          "add_special_tokens": special})
        r.raise_for_status()
        return r.json()["tokens"]

    async def decode(self, ids: list[int]) -> str:
        async with self.gate:
            r = await self.client.post("/detokenize", json={"model": self.model, "tokens": ids})
        r.raise_for_status()
        return r.json()["prompt"]


class WordTokens:
    """A word for a token, for servers without /tokenize."""
    name = None

    async def encode(self, text: str, special: bool = False) -> list[str]:
        return text.split()

    async def decode(self, ids: list[str]) -> str:
        return " ".join(ids)


async def probe_tokens(client: httpx.AsyncClient, model: str) -> ServerTokens | WordTokens:
    tokens = ServerTokens(client, model)
    try:
        await tokens.decode(await tokens.encode("probe"))
        return tokens
    except (httpx.HTTPError, KeyError, ValueError):
        return WordTokens()


def length_range(length: int, ratio: float) -> tuple[int, int]:
    """vLLM's --random-range-ratio: lengths drawn uniformly from
    [floor(length * (1 - ratio)), ceil(length * (1 + ratio))], 0 <= ratio < 1."""
    return math.floor(length * (1 - ratio)), math.ceil(length * (1 + ratio))


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def _cut(tokens, rng: random.Random, n: int, lead: str = "") -> list:
    """`n` tokens of random words (`lead` before the first: a space joins it to earlier text as
    a word of its own)."""
    ids: list = []
    while len(ids) < n:  # every word is at least one token, so this runs once
        ids = await tokens.encode(lead + _words(rng, max(n, 1) + len(ids)))
    return ids[:n]


async def random_dataset(cfg, tokens) -> list[SampleRequest]:
    rng = random.Random(cfg.seed)
    specials = len(await tokens.encode("", special=True))  # what the server adds (BOS), as vLLM
    in_lo, in_hi = cfg.input_range or length_range(max(0, cfg.random_input_len - specials),
                                                   cfg.random_range_ratio)
    out_lo, out_hi = cfg.output_range or length_range(cfg.random_output_len, cfg.random_range_ratio)
    out_lo, out_hi = max(out_lo, 1), max(out_hi, 1)
    if cfg.random_prefix_len + in_lo < 1:
        raise ValueError("--random-input-len is too small: the shortest prompt would have "
                         f"{cfg.random_prefix_len + in_lo} tokens")
    in_lens = [rng.randint(in_lo, in_hi) for _ in range(cfg.num_prompts)]
    out_lens = [rng.randint(out_lo, out_hi) for _ in range(cfg.num_prompts)]
    prefix = await _cut(tokens, rng, cfg.random_prefix_len) if cfg.random_prefix_len else []
    lead = " " if prefix else ""
    seeds = [rng.random() for _ in range(cfg.num_prompts)]  # drawn in order: tasks finish in any

    async def one(i: int) -> SampleRequest:
        body = await _cut(tokens, random.Random(seeds[i]), in_lens[i], lead)
        return SampleRequest(await tokens.decode(prefix + body), len(prefix) + in_lens[i], out_lens[i])
    return list(await asyncio.gather(*(one(i) for i in range(cfg.num_prompts))))


async def prefix_repetition_dataset(cfg, tokens) -> list[SampleRequest]:
    """vLLM's: `num_prefixes` prefixes, each shared by num_prompts // num_prefixes prompts."""
    per_prefix = cfg.num_prompts // cfg.num_prefixes
    if per_prefix == 0:
        raise ValueError(f"--num-prompts ({cfg.num_prompts}) must be at least "
                         f"--prefix-repetition-num-prefixes ({cfg.num_prefixes})")
    rng = random.Random(cfg.seed)
    plan = []
    for _ in range(cfg.num_prefixes):
        prefix = await _cut(tokens, rng, cfg.prefix_len)
        for _ in range(per_prefix):
            plan.append((prefix, rng.randint(*cfg.suffix_range), rng.randint(*cfg.prefix_output_range),
                         rng.random()))

    async def one(prefix, suffix_len, out_len, seed) -> SampleRequest:
        suffix = await _cut(tokens, random.Random(seed), suffix_len, " " if prefix else "")
        return SampleRequest(await tokens.decode(prefix + suffix), len(prefix) + suffix_len, out_len)
    requests = list(await asyncio.gather(*(one(*p) for p in plan)))
    if cfg.shuffle:
        rng.shuffle(requests)
    return requests


async def sharegpt_dataset(cfg, tokens) -> list[SampleRequest]:
    """The first turn of each conversation as the prompt; the reply's length in tokens as the
    output length (unless --sharegpt-output-len), vLLM's length filter, then oversampling."""
    with open(cfg.dataset_path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"{cfg.dataset_path}: a ShareGPT file is a JSON list of conversations")
    data = [d for d in data if isinstance(d, dict) and len(d.get("conversations") or []) >= 2]
    if cfg.shuffle:
        random.Random(cfg.seed).shuffle(data)
    fixed = cfg.sharegpt_output_len
    samples: list[SampleRequest] = []
    for start in range(0, len(data), 64):
        chunk = data[start:start + 64]
        prompts = [d["conversations"][0]["value"] for d in chunk]
        replies = [d["conversations"][1]["value"] for d in chunk]
        counts = await asyncio.gather(*(tokens.encode(p, special=True) for p in prompts),
                                      *([] if fixed else (tokens.encode(r) for r in replies)))
        for i, prompt in enumerate(prompts):
            prompt_len = len(counts[i])
            out_len = fixed or len(counts[len(chunk) + i])
            if (prompt_len < MIN_LEN or (not fixed and out_len < MIN_LEN) or prompt_len > MAX_PROMPT_LEN
                    or prompt_len + out_len > MAX_TOTAL_LEN):
                continue
            samples.append(SampleRequest(prompt, prompt_len, out_len))
            if len(samples) == cfg.num_prompts:
                return samples
    return _oversample(cfg, samples)


async def custom_dataset(cfg, tokens) -> list[SampleRequest]:
    """A JSONL file of {"prompt": ..., optional "output_tokens"}: a row's output_tokens (or the
    older output_len) wins over --custom-output-len."""
    rows = []
    with open(cfg.dataset_path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise ValueError(f"{cfg.dataset_path}:{n}: each line needs a string 'prompt'")
            rows.append(row)
    if cfg.shuffle:
        random.Random(cfg.seed).shuffle(rows)
    if cfg.num_prompts > 0:
        rows = rows[:cfg.num_prompts]
    counts = await asyncio.gather(*(tokens.encode(r["prompt"], special=True) for r in rows))
    samples = [SampleRequest(r["prompt"], len(c), _output_len(r, cfg.custom_output_len))
               for r, c in zip(rows, counts)]
    return _oversample(cfg, samples)


def _output_len(row: dict, default: int) -> int:
    value = row.get("output_tokens", row.get("output_len"))
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"output_tokens must be a positive integer, got {value!r}")
    return value


def _oversample(cfg, samples: list[SampleRequest]) -> list[SampleRequest]:
    """vLLM's: too few samples are topped up with repeats of random ones, unless --no-oversample."""
    if not samples:
        raise ValueError(f"{cfg.dataset_path}: no usable prompt in the dataset")
    if cfg.oversample and 0 < len(samples) < cfg.num_prompts:
        rng = random.Random(cfg.seed)
        samples += [replace(rng.choice(samples)) for _ in range(cfg.num_prompts - len(samples))]
    return samples


def parse_buckets(text: str) -> tuple[tuple[int, int, float], ...]:
    """vLLM's --random-mm-bucket-config: {(height, width, frames): probability}; frames is 1 for
    an image (video is not served). Returns (height, width, probability) with the probabilities
    summing to 1."""
    import ast

    try:
        config = ast.literal_eval(text)
        buckets = tuple((int(h), int(w), float(p)) for (h, w, t), p in config.items() if t == 1 and p > 0)
        ok = bool(buckets) and all(h > 0 and w > 0 for h, w, _ in buckets) and \
            all(t == 1 for (_, _, t) in config)
    except (ValueError, SyntaxError, TypeError, AttributeError):
        ok = False
    if not ok:
        raise ValueError("--random-mm-bucket-config is {(height, width, 1): probability, ...} (images only), "
                         f"got {text!r}")
    total = sum(p for _, _, p in buckets)
    return tuple((h, w, p / total) for h, w, p in buckets)


def random_image_url(rng: random.Random, height: int, width: int) -> str:
    """A noise image as a JPEG data: URL."""
    import base64
    import io

    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(rng.getrandbits(32)).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=85)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


async def random_mm_dataset(cfg, tokens) -> list[SampleRequest]:
    """vLLM's random-mm: the random dataset's prompts, each with --random-mm-base-items-per-request
    noise images of sizes drawn from --random-mm-bucket-config."""
    samples = await random_dataset(cfg, tokens)
    rng = random.Random(cfg.seed + 1)
    sizes = [(h, w) for h, w, _ in cfg.mm_buckets]
    weights = [p for _, _, p in cfg.mm_buckets]
    for sample in samples:
        picks = rng.choices(sizes, weights, k=cfg.mm_items_per_request)
        sample.images = tuple(random_image_url(rng, h, w) for h, w in picks)
    return samples


BUILDERS = {"random": random_dataset, "random-mm": random_mm_dataset, "prefix_repetition": prefix_repetition_dataset,
            "sharegpt": sharegpt_dataset, "custom": custom_dataset}


async def build_dataset(cfg, tokens) -> list[SampleRequest]:
    return await BUILDERS[cfg.dataset_name](cfg, tokens)
