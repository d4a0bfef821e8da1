"""Builds small random-weight models in Hugging Face format, with a real BPE tokenizer."""

from __future__ import annotations

from pathlib import Path

import torch

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention keeps the KV cache in fixed-size blocks.",
    "Continuous batching lets a request join at any step and leave as soon as it is done.",
    "def add(a, b):\n    return a + b\n",
    "你好，世界！ Unicode text and emoji 🙂 must survive the tokenizer.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000.",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(path: Path, vocab_size: int = 384):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size,
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   bos_token="<|im_start|>", pad_token="<|endoftext|>",
                                   unk_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return fast


# per architecture: the transformers classes, and what the tiny model adds to the common shape
# (MoE: 4 experts, top 2, smaller expert MLPs; Qwen3: a head_dim that is not hidden / heads)
ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 12}),  # every layer, cut by the prompts
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 24}),
    # LongRoPE with an attention factor (max 1024 over original 256), short factors below 256
    "phi3": ("Phi3Config", "Phi3ForCausalLM",
             {"original_max_position_embeddings": 256,
              "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                                  "short_factor": [1.0 + 0.15 * i for i in range(8)],
                                  "long_factor": [2.0 + i for i in range(8)]}}),
    # Phi-4-mini's shape of RoPE, LongRoPE over the first half of each head (partial_rotary_factor),
    # and the Phi-3 4k models' sliding window (12 tokens here)
    "phi3_partial": ("Phi3Config", "Phi3ForCausalLM",
                     {"original_max_position_embeddings": 256, "partial_rotary_factor": 0.5, "sliding_window": 12,
                      "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                          "short_factor": [1.0 + 0.3 * i for i in range(4)],
                                          "long_factor": [2.0 + i for i in range(4)]}}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                   "shared_expert_intermediate_size": 80}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                   "norm_topk_prob": True, "head_dim": 24}),
    # windows of 12 tokens (under a 16-token block) on the sliding layers, which the tests'
    # 40+-token prompts overrun; a query scale that is not head_dim's; tied embeddings; caps low
    # enough to bend the random weights' scores and logits
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               {"head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 12,
                "layer_types": ["sliding_attention", "full_attention"], "attn_logit_softcapping": 2.0,
                "final_logit_softcapping": 5.0, "tie_word_embeddings": True}),
    # the global layer's RoPE: its own base with linear scaling; the sliding one's: the local base
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM",
                    {"head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 12,
                     "layer_types": ["sliding_attention", "full_attention"], "tie_word_embeddings": True,
                     "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                         "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                            "rope_theta": 1000000.0}}}),
}


def build_tiny_model(path: Path, arch: str = "llama", seed: int = 0, weights_dtype: torch.dtype | None = None,
                     **overrides) -> Path:
    """A 2-layer model with GQA; weights drawn wide enough that greedy choices are not ties,
    saved in float32 or `weights_dtype` (bfloat16: a checkpoint as most models ship)."""
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(path)
    config_cls, model_cls, extra = ARCHITECTURES[arch]
    common = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  rms_norm_eps=1e-5, initializer_range=0.15, eos_token_id=tok.eos_token_id,
                  bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id,
                  tie_word_embeddings=False)
    common.update(extra)
    common.update(overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**common))
    if weights_dtype is not None:
        model = model.to(weights_dtype)
    model.save_pretrained(path, safe_serialization=True)
    return path
