"""Greedy reference outputs from Hugging Face transformers on the same weights."""

from __future__ import annotations

from pathlib import Path

import torch


def hf_greedy(model_dir, prompts: list[list[int]], max_new_tokens: int, dtype=torch.float32,
              hf_model=None) -> list[list[int]]:
    """One prompt at a time (no padding), EOS not stopping: the plain reference. `model_dir`:
    any model directory of ours (a GGUF file's: its float32 copy, gguf_file.dense_copy)."""
    from transformers import AutoModelForCausalLM

    from pageserve.runtime.models.gguf_file import dense_copy

    model = hf_model or AutoModelForCausalLM.from_pretrained(str(dense_copy(Path(model_dir))), dtype=dtype)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                 temperature=None, top_p=None, top_k=None)
            outs.append(gen[0, len(p):].tolist())
    return outs


def hf_float8_kv(model_dir, scales: dict, **kw):
    """HF float32 whose attention reads K and V as a float8 KV cache with `scales` (per layer
    index (k_scale, v_scale), one value or one a KV head) holds them: each value rounded to
    float8 e4m3 at value / scale, times the scale. transformers reads a checkpoint's KV-cache
    scales but does not apply them, so this is the reference for them."""
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def through_float8(x, s):
        s = s.reshape(1, -1, 1, 1)
        return (x / s).to(torch.float8_e4m3fn).to(x.dtype) * s

    def attention(module, query, key, value, attention_mask, **kwargs):
        ks, vs = scales[module.layer_idx]
        return sdpa_attention_forward(module, query, through_float8(key, ks), through_float8(value, vs),
                                      attention_mask, **kwargs)

    AttentionInterface.register("pageserve_float8_kv", attention)
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                attn_implementation="pageserve_float8_kv", **kw).eval()


def hf_token_logprobs(model, seqs: list[tuple[list[int], list[int]]]) -> list[torch.Tensor]:
    """Teacher-forced: each (prompt, answer)'s log-probability of every answer token, and of the
    most likely token at that position ([answer, 2])."""
    out = []
    with torch.inference_mode():
        for prompt, answer in seqs:
            lp = model(torch.tensor([prompt + answer])).logits[0, len(prompt) - 1:-1].float().log_softmax(-1)
            out.append(torch.stack([lp.gather(1, torch.tensor(answer)[:, None])[:, 0], lp.max(-1).values], 1))
    return out
