"""Images in, text out, through the paged engine: greedy parity with HF transformers (float32,
tiny random-weight models from the real configs, real processors) with one and two images a
prompt, prefill chunks that end inside an image, preemption by swap and by recompute, the
prefix cache keyed by the image, and the encoder cache's budget."""

from __future__ import annotations

import pytest
import torch

from pageserve.loadtest.tiny_vlm import build_llava, random_image
from pageserve.runtime import LLM, SamplingParams
from tests.conftest import assert_pool_clean

pytestmark = pytest.mark.engine

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # 2 layers, K and V, 16-token blocks, 2 KV heads of 16, float32


def chat(*parts: str) -> str:
    """A user turn; "<image>" marks where each image goes."""
    return f"<|im_start|>user\n{''.join(parts)}<|im_end|>\n<|im_start|>assistant\n"


def hf_greedy(hf_cls, model_dir, text: str, images: list, max_new_tokens: int = 12) -> list[int]:
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(model_dir)
    inputs = proc(text=[text], images=images or None, return_tensors="pt", add_special_tokens=True)
    model = hf_cls.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    with torch.inference_mode():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


CASES = [  # (text, images): one image, two images, text before and after, an image first
    (chat("Describe <image> please."), [(1, 40, 50)]),
    (chat("Compare <image> with <image>: which is brighter?"), [(2, 30, 30), (3, 64, 48)]),
    (chat("<image>"), [(4, 28, 28)]),
    (chat("The quick brown fox jumps over the lazy dog. <image> Paged attention keeps blocks."), [(5, 33, 80)]),
]


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    from transformers import LlavaForConditionalGeneration

    model_dir = build_llava(tmp_path_factory.mktemp("llava"))
    cases = [(text, [random_image(*spec) for spec in specs]) for text, specs in CASES]
    expected = [hf_greedy(LlavaForConditionalGeneration, model_dir, text, images) for text, images in cases]
    return model_dir, cases, expected


def prompt(text, images):
    return {"prompt": text, "multi_modal_data": {"image": images}}


def test_llava_greedy_parity_chunked_inside_images(llava):
    """Budgets of 7 and 16 tokens: every image's 16 tokens are split across chunks."""
    model_dir, cases, expected = llava
    for budget in (7, 16):
        llm = LLM(str(model_dir), dtype="float32", kv_cache_memory=0.01, max_model_len=256,
                  max_num_batched_tokens=budget, debug_checks=True)
        outs = llm.generate([prompt(*c) for c in cases], GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected, f"budget {budget}"
        assert_pool_clean(llm.engine)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_llava_parity_under_preemption(llava, mode):
    model_dir, cases, expected = llava
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory=8 * BLOCK_BYTES / 2 ** 30, max_model_len=128,
              swap_space=(8 if mode == "swap" else 0) * BLOCK_BYTES / 2 ** 30, preemption_mode=mode,
              max_num_batched_tokens=32, debug_checks=True)
    outs = llm.generate([prompt(*c) for c in cases * 2], GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    if mode == "recompute":
        assert llm.engine.scheduler.num_recomputed > 0
    assert [o.outputs[0].token_ids for o in outs] == expected * 2
    assert_pool_clean(llm.engine)


def test_the_image_changes_the_answer(llava):
    """The tiny model's answers depend on the image: otherwise parity would prove little."""
    model_dir, cases, expected = llava
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory=0.01, max_model_len=256, debug_checks=True)
    text, _ = cases[0]
    outs = llm.generate([prompt(text, [random_image(s, 40, 50)]) for s in range(6)], GREEDY, use_tqdm=False)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) > 1


def test_prefix_cache_keys_image_tokens_by_the_image(llava):
    """The same image and question hit the cache; a different image with the same text hits
    only the blocks before the image, and gets its own answer (HF's for that image)."""
    from transformers import LlavaForConditionalGeneration

    model_dir, cases, expected = llava
    text = chat("The quick brown fox jumps over the lazy dog. Paged attention keeps the KV cache in blocks. "
                "<image> What is it?")
    first, other = random_image(11, 40, 40), random_image(12, 40, 40)
    want_other = hf_greedy(LlavaForConditionalGeneration, model_dir, text, [other])
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory=0.01, max_model_len=256, debug_checks=True)
    ids, items = llm.engine.images.process(text, [first])
    image_block = items[0].offset // 16 * 16  # tokens before the image's first block
    assert image_block >= 16
    a = llm.generate(prompt(text, [first]), GREEDY, use_tqdm=False)[0]
    b = llm.generate(prompt(text, [first]), GREEDY, use_tqdm=False)[0]
    c = llm.generate(prompt(text, [other]), GREEDY, use_tqdm=False)[0]
    assert a.metrics.num_cached_tokens == 0
    assert b.metrics.num_cached_tokens >= items[0].end // 16 * 16 > image_block
    assert b.outputs[0].token_ids == a.outputs[0].token_ids
    assert c.metrics.num_cached_tokens == image_block
    assert c.outputs[0].token_ids == want_other != a.outputs[0].token_ids
    assert_pool_clean(llm.engine)


def test_encoder_cache_budget_holds_one_image_at_a_time(llava):
    """A budget of one image's output: prompts take turns at their images, and every answer is
    still HF's; the cache never holds more than its budget."""
    model_dir, cases, expected = llava
    one_image = 16 * 64 * 4
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory=0.01, max_model_len=256, max_num_batched_tokens=128,
              mm_encoder_cache_mb=one_image / 2 ** 20, debug_checks=True)
    cache = llm.engine.scheduler.encoder_cache
    peak = []
    step = llm.engine.step

    def watched():
        out = step()
        peak.append(cache.used)
        return out

    llm.engine.step = watched
    outs = llm.generate([prompt(*c) for c in cases], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert max(peak) <= one_image
    assert not llm.engine.runner.images.outputs or len(llm.engine.runner.images.outputs) <= 1
    assert_pool_clean(llm.engine)


def test_image_input_errors(llava, tiny_llm):
    model_dir, cases, _ = llava
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory=0.01, max_model_len=256,
              limit_mm_per_prompt='{"image": 1}')
    image = random_image(1, 30, 30)
    with pytest.raises(ValueError, match="2 images in one prompt; this server takes at most 1"):
        llm.generate(prompt(chat("<image><image>"), [image, image]), GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=r"has 0 image placeholders \('<image>'\) for 1 images"):
        llm.generate(prompt(chat("no placeholder"), [image]), GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="takes no images"):
        tiny_llm.generate(prompt("<image>", [image]), GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="limit_mm_per_prompt takes"):
        LLM(str(model_dir), limit_mm_per_prompt='{"video": 1}')
    # the engine serves on
    assert llm.generate(prompt(*cases[0]), GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert_pool_clean(llm.engine)
