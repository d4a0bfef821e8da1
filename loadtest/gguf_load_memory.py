"""The memory a large GGUF file takes to load and to serve on this machine: a random-weight
model of a real model's shape (Llama 3 8B's by default; Qwen1.5-MoE-A2.7B's, a mixture of
experts) written in a mix like llama.cpp's Q4_K_M (Q4_K matrices; Q6_K attn_v and ffn_down in
its "more bits" layers and the output matrix), Q3_K_M, IQ4_XS, Q4_0, or all F16, then loaded by
pageserve (float32 arithmetic, the C kernels) in a child process, which prints the peak
resident memory of the start-up, the resident memory once serving, and the seconds; one greedy
request proves it serves.

    python -m pageserve.loadtest.gguf_load_memory --shape llama3-8b --mix q4_k_m
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

SHAPES = {  # hidden, layers, heads, KV heads, intermediate, vocabulary
    "llama3-8b": (4096, 32, 32, 8, 14336, 128256),
    "smollm2-1.7b": (2048, 24, 32, 32, 8192, 49152),
    "smollm2-135m": (576, 30, 9, 3, 1536, 49152),
    "qwen1.5-moe-a2.7b": (2048, 24, 16, 16, 5632, 151936),
}
# mixtures of experts, in Qwen2-MoE's layout (q/k/v biases, a shared expert of the intermediate
# size above): shape -> (experts, experts a token, an expert's intermediate size)
MOE = {"qwen1.5-moe-a2.7b": (60, 4, 1408)}


def random_blocks(rng: np.random.Generator, qtype, rows: int, columns: int) -> np.ndarray:
    """[rows, bytes a row] of random codes in GGML type `qtype` with small, sane scales."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[qtype]
    assert columns % block == 0, f"{columns} columns are not whole {qtype.name} blocks"
    raw = rng.integers(0, 256, (rows, columns // block, size), dtype=np.uint8)
    T = gguf.GGMLQuantizationType
    # the byte offsets of the type's half-float scales, and a value for them that keeps values small
    halves = {T.Q4_0: ((0,), 0.02), T.Q8_0: ((0,), 0.002), T.Q5_0: ((0,), 0.005), T.Q5_1: ((0, 2), 0.005),
              T.IQ4_NL: ((0,), 2e-4), T.Q4_K: ((0, 2), 0.001), T.Q5_K: ((0, 2), 0.001),
              T.Q6_K: ((208,), 0.001), T.Q3_K: ((108,), 0.001), T.IQ4_XS: ((0,), 5e-5)}
    if qtype == T.F16:  # values of a trained model's spread
        return (rng.standard_normal((rows, columns), np.float32) * 0.02).astype(np.float16).view(np.uint8)
    if qtype not in halves:
        raise ValueError(f"no random blocks for {qtype.name}")
    if qtype == T.Q6_K:
        raw[:, :, 192:208] = rng.integers(1, 8, (rows, columns // block, 16), dtype=np.uint8)  # int8 scales
    offsets, value = halves[qtype]
    for at in offsets:
        raw[:, :, at:at + 2] = np.full((*raw.shape[:2], 1), value, np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


# llama.cpp's mixes (llama_tensor_get_type, roughly): mix -> (file type, the main type, and for the
# layers given "more bits" and the rest: attn_v's and ffn_down's, then attn_output's and output's)
MIXES = {"q4_k_m": ("MOSTLY_Q4_K_M", "Q4_K", ("Q6_K", "Q4_K"), ("Q6_K", "Q4_K"), "Q4_K", "Q6_K"),
         "q3_k_m": ("MOSTLY_Q3_K_M", "Q3_K", ("Q5_K", "Q4_K"), ("Q5_K", "Q4_K"), "Q4_K", "Q6_K"),
         "iq4_xs": ("MOSTLY_IQ4_XS", "IQ4_XS", ("Q5_K", "Q5_K"), ("IQ4_XS", "IQ4_XS"), "IQ4_XS", "Q6_K"),
         "f16": ("MOSTLY_F16", "F16", ("F16", "F16"), ("F16", "F16"), "F16", "F16"),
         "q4_0": ("MOSTLY_Q4_0", "Q4_0", ("Q8_0", "Q4_0"), ("Q8_0", "Q4_0"), "Q4_0", "Q8_0")}


def write_model(path: Path, shape: str, mix: str, seed: int = 0) -> Path:
    import gguf

    hidden, layers, heads, kv_heads, inter, vocab = SHAPES[shape]
    head_dim = hidden // heads
    T = gguf.GGMLQuantizationType
    rng = np.random.default_rng(seed)
    moe = MOE.get(shape)
    w = gguf.GGUFWriter(str(path), arch="qwen2moe" if moe else "llama")
    w.add_context_length(8192)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    if moe:
        w.add_expert_count(moe[0])
        w.add_expert_used_count(moe[1])
        w.add_expert_feed_forward_length(moe[2])
        w.add_expert_shared_feed_forward_length(inter)
    file_type, main, attn_v, ffn_down, attn_output, output = MIXES[mix]
    w.add_file_type(gguf.LlamaFileType[file_type])
    w.add_tokenizer_model("llama")
    w.add_token_list(["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
                     + [f"t{i}" for i in range(vocab - 259)])
    w.add_token_types([gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
                      + [gguf.TokenType.BYTE] * 256 + [gguf.TokenType.NORMAL] * (vocab - 259))
    w.add_token_scores([0.0] * vocab)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)

    def more_bits(i: int) -> int:  # llama.cpp's use_more_bits for attn_v and ffn_down: 0 (more) or 1
        return 0 if i < layers // 8 or i >= 7 * layers // 8 or (i - layers // 8) % 3 == 2 else 1

    def matrix(name: str, rows: int, columns: int, qtype: str = main, experts: int = 0) -> None:
        if columns % gguf.GGML_QUANT_SIZES[T[qtype]][0]:  # llama.cpp's fallback: rows not whole superblocks
            qtype = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}.get(qtype, "IQ4_NL")
        blocks = random_blocks(rng, T[qtype], rows * max(experts, 1), columns)
        w.add_tensor(name, blocks.reshape(experts, rows, -1) if experts else blocks, raw_dtype=T[qtype])

    def experts(i: int) -> None:  # Qwen2-MoE's: a router, stacked experts, a gated shared expert
        count, _, size = moe
        w.add_tensor(f"blk.{i}.ffn_gate_inp.weight", rng.standard_normal((count, hidden), np.float32) * 0.02)
        matrix(f"blk.{i}.ffn_gate_exps.weight", size, hidden, experts=count)
        matrix(f"blk.{i}.ffn_up_exps.weight", size, hidden, experts=count)
        matrix(f"blk.{i}.ffn_down_exps.weight", hidden, size, ffn_down[more_bits(i)], experts=count)
        w.add_tensor(f"blk.{i}.ffn_gate_inp_shexp.weight", rng.standard_normal(hidden, np.float32) * 0.02)
        matrix(f"blk.{i}.ffn_gate_shexp.weight", inter, hidden)
        matrix(f"blk.{i}.ffn_up_shexp.weight", inter, hidden)
        matrix(f"blk.{i}.ffn_down_shexp.weight", hidden, inter, ffn_down[more_bits(i)])

    matrix("token_embd.weight", vocab, hidden)
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        matrix(f"blk.{i}.attn_q.weight", heads * head_dim, hidden)
        matrix(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden)
        matrix(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden, attn_v[more_bits(i)])
        matrix(f"blk.{i}.attn_output.weight", hidden, heads * head_dim, attn_output)
        if moe:
            for part, rows in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
                w.add_tensor(f"blk.{i}.attn_{part}.bias", np.zeros(rows * head_dim, np.float32))
            experts(i)
            continue
        matrix(f"blk.{i}.ffn_gate.weight", inter, hidden)
        matrix(f"blk.{i}.ffn_up.weight", inter, hidden)
        matrix(f"blk.{i}.ffn_down.weight", hidden, inter, ffn_down[more_bits(i)])
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    matrix("output.weight", vocab, hidden, output)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


CHILD = """
import json, resource, sys, time
import psutil
t = time.perf_counter()
from pageserve.runtime import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="float32", max_model_len=512, max_num_seqs=4, kv_cache_memory=0.25, swap_space=0)
load = time.perf_counter() - t
rss = psutil.Process().memory_info().rss
params = SamplingParams(temperature=0, max_tokens=int(sys.argv[2]), ignore_eos=True)
ms = []
for _ in range(int(sys.argv[3])):
    t = time.perf_counter()
    out = llm.generate([[1, 300, 301, 302]], params, use_tqdm=False)[0].outputs[0].token_ids
    ms.append((time.perf_counter() - t) / len(out) * 1e3)
print(json.dumps({"load_s": load, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "serving_rss_bytes": rss, "tokens": len(out), "ms_a_token": ms}))
"""


def measure(model: Path, tokens: int = 16, rounds: int = 1) -> dict:
    """Starts pageserve on `model` in a child process (the first start reads the tokenizer into
    the cache: the second is timed), which decodes one stream of `tokens` `rounds` times."""
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", CHILD, str(model), str(tokens), str(rounds)],
                              capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=list(SHAPES), default="llama3-8b")
    p.add_argument("--mix", choices=list(MIXES), default="q4_k_m")
    p.add_argument("--dir", type=Path, default=None, help="where the file is written (default: the cache)")
    p.add_argument("--out", type=Path, default=None, help="also write the result here as JSON")
    p.add_argument("--tokens", type=int, default=16, help="tokens a decode round (one stream)")
    p.add_argument("--rounds", type=int, default=1, help="decode rounds, each timed (ms_a_token: one each)")
    args = p.parse_args()
    from pageserve.runtime.models.loader import cache_root

    folder = args.dir or cache_root() / "synthetic"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{args.shape}-{args.mix}.gguf"
    if not path.is_file():
        t = time.perf_counter()
        write_model(path, args.shape, args.mix)
        print(f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - t:.0f} s")
    hidden, layers, heads, kv_heads, inter, vocab = SHAPES[args.shape]
    kv = kv_heads * hidden // heads
    ffn = 3 * hidden * inter + (3 * hidden * MOE[args.shape][0] * MOE[args.shape][2] if args.shape in MOE else 0)
    params = 2 * vocab * hidden + layers * (hidden * (hidden + 2 * kv) + hidden * hidden + ffn)
    result = {"shape": args.shape, "mix": args.mix, "parameters": params, "file_bytes": path.stat().st_size,
              "float32_bytes": 4 * params, **measure(path, args.tokens, args.rounds)}
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
