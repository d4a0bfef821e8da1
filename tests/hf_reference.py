"""Greedy reference outputs from Hugging Face transformers on the same weights."""

from __future__ import annotations

import torch


def hf_greedy(model_dir, prompts: list[list[int]], max_new_tokens: int, dtype=torch.float32,
              hf_model=None) -> list[list[int]]:
    """One prompt at a time (no padding), EOS not stopping: the plain reference."""
    from transformers import AutoModelForCausalLM

    model = hf_model or AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
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
