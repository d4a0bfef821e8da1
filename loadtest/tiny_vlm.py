"""Small random-weight vision-language models in Hugging Face format, built from the real
config classes with their real processors (saved beside the weights, as the hub has them),
for parity tests against transformers and for benchmarks with images."""

from __future__ import annotations

from pathlib import Path

import torch

from pageserve.loadtest.tiny_model import build_tokenizer

# renders OpenAI-style content parts ({"type": "image"} / {"type": "text"}) or a plain string
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<image>{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=1024, rms_norm_eps=1e-5, initializer_range=0.15)


def _tokenizer(path: Path, *image_tokens: str):
    tok = build_tokenizer(path)
    tok.add_special_tokens({"additional_special_tokens": list(image_tokens)})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_llava(path: Path, seed: int = 0) -> Path:
    """LLaVA-1.5's shape: a two-layer CLIP tower on 28x28 images in 7x7 patches (16 image
    tokens, the class token dropped), read at its second-to-last layer, a GeLU projector, a
    two-layer Llama."""
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(path, "<image>")
    image_token = tok.convert_tokens_to_ids("<image>")
    text = transformers.LlamaConfig(vocab_size=len(tok), eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                                    pad_token_id=tok.pad_token_id, **TEXT)
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=2, image_size=28, patch_size=7, projection_dim=32)
    cfg = transformers.LlavaConfig(text_config=text, vision_config=vision, image_token_index=image_token,
                                   vision_feature_layer=-2, vision_feature_select_strategy="default",
                                   projector_hidden_act="gelu", image_seq_length=16)
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(cfg)
    with torch.no_grad():  # a projector loud enough that the image moves the tiny model's answer
        model.model.multi_modal_projector.linear_2.weight.mul_(8)
    model.save_pretrained(path)
    images = transformers.CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    transformers.LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=7, num_additional_image_tokens=1,
                                vision_feature_select_strategy="default",
                                chat_template=CHAT_TEMPLATE).save_pretrained(path)
    return path


def build_llava_next(path: Path, seed: int = 0) -> Path:
    """LLaVA-NeXT's shape: build_llava's tower and language model, images tiled at the best of
    28x56, 56x28 or 56x56 pixels in 28x28 tiles plus a global view, the tiles' 4x4 features
    cut back to the image's aspect with a newline token after each row."""
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(path, "<image>")
    text = transformers.LlamaConfig(vocab_size=len(tok), eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                                    pad_token_id=tok.pad_token_id, **TEXT)
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=2, image_size=28, patch_size=7, projection_dim=32)
    pinpoints = [[28, 56], [56, 28], [56, 56]]
    cfg = transformers.LlavaNextConfig(text_config=text, vision_config=vision,
                                       image_token_index=tok.convert_tokens_to_ids("<image>"),
                                       vision_feature_layer=-2, vision_feature_select_strategy="default",
                                       image_grid_pinpoints=pinpoints, projector_hidden_act="gelu")
    torch.manual_seed(seed)
    model = transformers.LlavaNextForConditionalGeneration(cfg)
    with torch.no_grad():
        model.model.multi_modal_projector.linear_2.weight.mul_(8)
        model.model.image_newline.normal_(0, 1.0)
    model.save_pretrained(path)
    images = transformers.LlavaNextImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28},
                                                  image_grid_pinpoints=pinpoints)
    transformers.LlavaNextProcessor(image_processor=images, tokenizer=tok, patch_size=7, num_additional_image_tokens=1,
                                    vision_feature_select_strategy="default",
                                    chat_template=CHAT_TEMPLATE).save_pretrained(path)
    return path


def random_image(seed: int, width: int, height: int, mode: str = "RGB"):
    """A noise image (PIL) of the given size."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).convert(mode)


def build_idefics3(path: Path, seed: int = 0) -> Path:
    """Idefics3 / SmolVLM's shape: images split into up to 2x2 tiles of 32x32 and a global
    view, each tile a two-layer SigLIP-like tower on 4x4 patches (64), pixel-shuffled by 2 into
    16 image tokens, and a two-layer Llama."""
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    grid = [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]
    tok = _tokenizer(path, "<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>", *grid)
    images = transformers.Idefics3ImageProcessor(size={"longest_edge": 64}, max_image_size={"longest_edge": 32},
                                                 do_image_splitting=True)
    proc = transformers.Idefics3Processor(image_processor=images, tokenizer=tok, image_seq_len=16,
                                          chat_template=CHAT_TEMPLATE)
    text = transformers.LlamaConfig(vocab_size=len(tok), eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                                    pad_token_id=tok.pad_token_id, **TEXT)
    vision = transformers.Idefics3VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                               num_attention_heads=2, image_size=32, patch_size=4)
    cfg = transformers.Idefics3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), scale_factor=2,
                                      image_token_id=tok.convert_tokens_to_ids("<image>"))
    torch.manual_seed(seed)
    model = transformers.Idefics3ForConditionalGeneration(cfg)
    with torch.no_grad():
        model.model.connector.modality_projection.proj.weight.mul_(8)
    model.save_pretrained(path)
    proc.save_pretrained(path)
    return path


GEMMA3_TEMPLATE = CHAT_TEMPLATE.replace("<image>", "<start_of_image>")


def build_gemma3(path: Path, seed: int = 0) -> Path:
    """Gemma 3's shape: a two-layer SigLIP tower on 28x28 images in 7x7 patches, pooled 2x2 into 4
    image tokens that attend to each other both ways; a two-layer Gemma 3 text model with a
    sliding and a global layer (tests/test_gemma3_multimodal's)."""
    import transformers

    from pageserve.loadtest.tiny_model import ARCHITECTURES

    path.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(path, "<start_of_image>", "<end_of_image>", "<image_soft_token>")
    tok._set_model_specific_special_tokens({"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                            "image_token": "<image_soft_token>"})
    tok.chat_template = GEMMA3_TEMPLATE
    _, _, extra = ARCHITECTURES["gemma3_text"]
    # a narrower init than the others': at 0.15 this Gemma answers every prompt with one token
    text = {**TEXT, "initializer_range": 0.02, "vocab_size": len(tok), "eos_token_id": tok.eos_token_id,
            "bos_token_id": tok.bos_token_id, "pad_token_id": tok.pad_token_id, **extra}
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=28,
                  patch_size=7)
    ids = tok.convert_tokens_to_ids
    cfg = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                    boi_token_index=ids("<start_of_image>"), eoi_token_index=ids("<end_of_image>"),
                                    image_token_index=ids("<image_soft_token>"), eos_token_id=tok.eos_token_id)
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(cfg)
    with torch.no_grad():
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 2.0)
    model.save_pretrained(path)
    images = transformers.Gemma3ImageProcessor(size={"height": 28, "width": 28})
    transformers.Gemma3Processor(image_processor=images, tokenizer=tok, image_seq_length=4,
                                 chat_template=GEMMA3_TEMPLATE).save_pretrained(path)
    return path


def build_smolvlm_shape(path: Path, language_model: Path | None = None, image_splitting: bool = False,
                        seed: int = 0) -> Path:
    """SmolVLM-256M-Instruct's shape (Idefics3: a SigLIP-B/16 tower on 512x512 tiles, pixel
    shuffle by 4 into 64 tokens a tile, a SmolLM2-135M language model over a 49,280-token
    vocabulary): the language model and tokenizer of `language_model` (default: the default
    model, SmolLM2-135M-Instruct), the vision tower and connector random. For timing: its text is
    real language, its view of an image is not. image_splitting off: one 512x512 view of each
    image (SmolVLM's default splits a 448x448 image into 16 tiles and a global view)."""
    import transformers
    from safetensors.torch import load_file

    from pageserve.runtime.models.gguf_file import dense_copy
    from pageserve.runtime.models.loader import resolve_model

    path.mkdir(parents=True, exist_ok=True)
    lm = dense_copy(Path(language_model) if language_model else resolve_model(None))
    tok = transformers.AutoTokenizer.from_pretrained(lm)
    grid = [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]
    tok.add_special_tokens({"additional_special_tokens": ["<fake_token_around_image>", "<image>",
                                                          "<end_of_utterance>", "<global-img>", *grid]})
    images = transformers.Idefics3ImageProcessor(size={"longest_edge": 2048}, max_image_size={"longest_edge": 512},
                                                 do_image_splitting=image_splitting)
    proc = transformers.Idefics3Processor(image_processor=images, tokenizer=tok, image_seq_len=64,
                                          chat_template=tok.chat_template)
    text = transformers.AutoConfig.from_pretrained(lm).to_dict()
    text.update(vocab_size=49280, tie_word_embeddings=True)
    vision = transformers.Idefics3VisionConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                               num_attention_heads=12, image_size=512, patch_size=16)
    cfg = transformers.Idefics3Config(text_config=text, vision_config=vision.to_dict(), scale_factor=4,
                                      image_token_id=tok.convert_tokens_to_ids("<image>"), tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = transformers.Idefics3ForConditionalGeneration(cfg)
    weights = load_file(str(lm / "model.safetensors"))
    text_model = model.model.text_model
    with torch.no_grad():
        for name, tensor in weights.items():
            name = name.removeprefix("model.")
            if name == "embed_tokens.weight":  # the image tokens' rows stay random
                text_model.embed_tokens.weight[:tensor.shape[0]] = tensor
            elif name != "lm_head.weight":
                text_model.get_parameter(name).copy_(tensor)
    model.save_pretrained(path)
    proc.save_pretrained(path)
    return path


QWEN_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


def build_qwen2_5_vl(path: Path, seed: int = 0) -> Path:
    """Qwen2.5-VL's shape: images resized to multiples of 8 pixels (4-pixel patches merged 2x2
    into a token), a two-block vision tower whose first block attends within windows of 2x2
    tokens and whose second attends to the whole image, 2-D rotary positions in the tower, and
    a two-layer Qwen2 language model with M-RoPE (sections 2, 3, 3 of a 16-wide head). Saved
    with its image processor and tokenizer (transformers' Qwen2.5-VL processor also wants a video
    processor, which needs torchvision)."""
    import transformers

    path.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(path, "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
    tok.chat_template = CHAT_TEMPLATE.replace("<image>", QWEN_PLACEHOLDER)
    tok.save_pretrained(path)
    ids = tok.convert_tokens_to_ids
    text = {**TEXT, "vocab_size": len(tok), "eos_token_id": tok.eos_token_id, "bos_token_id": tok.bos_token_id,
            "pad_token_id": tok.pad_token_id,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}}
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, spatial_merge_size=2,
                  temporal_patch_size=2, window_size=16, fullatt_block_indexes=[1], out_hidden_size=64,
                  hidden_act="silu")
    cfg = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=ids("<|image_pad|>"),
                                        video_token_id=ids("<|video_pad|>"),
                                        vision_start_token_id=ids("<|vision_start|>"),
                                        vision_end_token_id=ids("<|vision_end|>"))
    torch.manual_seed(seed)
    transformers.Qwen2_5_VLForConditionalGeneration(cfg).save_pretrained(path)
    transformers.Qwen2VLImageProcessor(patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=8 * 8 * 4,
                                       max_pixels=64 * 64).save_pretrained(path)
    return path
