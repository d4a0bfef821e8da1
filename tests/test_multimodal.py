"""Images in, text out, through the paged engine: greedy parity with HF transformers (float32,
tiny random-weight models from the real configs, real processors) with one and two images a
prompt, prefill chunks that end inside an image, preemption by swap and by recompute, the
prefix cache keyed by the image, and the encoder cache's budget."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pageserve.loadtest.tiny_vlm import (QWEN_PLACEHOLDER, build_gemma3, build_idefics3, build_llava, build_llava_next,
                                         build_qwen2_5_vl, random_image)
from pageserve.runtime import LLM, SamplingParams
from pageserve.runtime.multimodal import DEFAULT_MAX_PIXELS, _upscaled_edge
from tests.conftest import assert_pool_clean

pytestmark = pytest.mark.engine

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # 2 layers, K and V, 16-token blocks, 2 KV heads of 16, float32


def chat(*parts: str) -> str:
    """A user turn; "<image>" marks where each image goes."""
    return f"<|im_start|>user\n{''.join(parts)}<|im_end|>\n<|im_start|>assistant\n"


def hf_processor(model_dir, hf_cls):
    """The model's HF processor; for Qwen2.5-VL its image processor with the token expansion
    of transformers' processor (which also wants torchvision for its video half)."""
    from transformers import AutoProcessor

    if hf_cls.__name__ == "Qwen2_5_VLForConditionalGeneration":
        from pageserve.runtime.models.qwen2_5_vl import Qwen2VLPrompts

        return Qwen2VLPrompts(str(model_dir))
    return AutoProcessor.from_pretrained(model_dir)


def hf_greedy(hf_cls, model_dir, text: str, images: list, max_new_tokens: int = 12) -> list[int]:
    proc = hf_processor(model_dir, hf_cls)
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
    (chat("<image><image> side by side"), [(6, 20, 20), (7, 50, 40)]),  # one run of image tokens
]

# family -> (builder, HF class, the image placeholder, max_model_len, KV blocks for the
# preemption test: the longest request's and a few more)
FAMILIES = {
    "llava": (build_llava, "LlavaForConditionalGeneration", "<image>", 128, 8),
    "llava_next": (build_llava_next, "LlavaNextForConditionalGeneration", "<image>", 256, 16),
    "idefics3": (build_idefics3, "Idefics3ForConditionalGeneration", "<image>", 256, 16),
    "gemma3": (build_gemma3, "Gemma3ForConditionalGeneration", "<start_of_image>", 128, 8),
    "qwen2_5_vl": (build_qwen2_5_vl, "Qwen2_5_VLForConditionalGeneration", QWEN_PLACEHOLDER, 256, 16),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """A tiny model of the family, its cases and HF's greedy answers to them."""
    import transformers

    build, hf_name, placeholder, max_len, kv_blocks = FAMILIES[request.param]
    model_dir = build(tmp_path_factory.mktemp(request.param))
    hf_cls = getattr(transformers, hf_name)

    def fmt(text: str) -> str:
        return text.replace("<image>", placeholder)
    cases = [(fmt(text), [random_image(*spec) for spec in specs]) for text, specs in CASES]
    expected = [hf_greedy(hf_cls, model_dir, text, images) for text, images in cases]
    return SimpleNamespace(name=request.param, dir=model_dir, hf_cls=hf_cls, max_len=max_len, kv_blocks=kv_blocks,
                           cases=cases, expected=expected, fmt=fmt, placeholder=placeholder)


def llm_for(family, **kw) -> LLM:
    kw = {"dtype": "float32", "kv_cache_memory": 0.01, "max_model_len": family.max_len, "debug_checks": True, **kw}
    return LLM(str(family.dir), **kw)


def prompt(text, images):
    return {"prompt": text, "multi_modal_data": {"image": images}}


def test_greedy_parity_chunked_inside_images(family):
    """Budgets of 7 and 16 tokens: every image's tokens are split across chunks (Gemma 3's, which
    attend to each other both ways, are moved whole to the next step instead)."""
    for budget in (7, 16):
        llm = llm_for(family, max_num_batched_tokens=budget)
        outs = llm.generate([prompt(*c) for c in family.cases], GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == family.expected, f"budget {budget}"
        assert_pool_clean(llm.engine)


def test_prompt_logprobs_match_hf(family):
    """Every prompt position's log-probability, image tokens and the text after them: Gemma 3's
    image tokens attending to each other both ways move these by 0.02-0.04 against a causal
    mask, far above the tolerance."""
    proc = hf_processor(family.dir, family.hf_cls)
    hf = family.hf_cls.from_pretrained(family.dir, dtype=torch.float32)
    llm = llm_for(family, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([prompt(*c) for c in family.cases], params, use_tqdm=False)
    for (text, images), out in zip(family.cases, outs):
        inputs = proc(text=[text], images=images, return_tensors="pt")
        ids = inputs["input_ids"][0]
        assert out.prompt_token_ids == ids.tolist()
        with torch.inference_mode():
            want = hf(**inputs).logits[0].log_softmax(-1)[torch.arange(len(ids) - 1), ids[1:]]
        got = torch.tensor([entry[int(t)].logprob for entry, t in zip(out.prompt_logprobs[1:], ids[1:])])
        torch.testing.assert_close(got, want, rtol=0, atol=2e-4)
    assert_pool_clean(llm.engine)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_parity_under_preemption(family, mode):
    blocks = family.kv_blocks
    llm = llm_for(family, kv_cache_memory=blocks * BLOCK_BYTES / 2 ** 30, preemption_mode=mode,
                  swap_space=(blocks if mode == "swap" else 0) * BLOCK_BYTES / 2 ** 30, max_num_batched_tokens=32)
    outs = llm.generate([prompt(*c) for c in family.cases * 2], GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    if mode == "recompute":
        assert llm.engine.scheduler.num_recomputed > 0
    assert [o.outputs[0].token_ids for o in outs] == family.expected * 2
    assert_pool_clean(llm.engine)


def test_the_image_changes_the_answer(family):
    """The tiny model's answers depend on the image: otherwise parity would prove little."""
    llm = llm_for(family)
    text, _ = family.cases[0]
    outs = llm.generate([prompt(text, [random_image(s, 40, 50)]) for s in range(6)], GREEDY, use_tqdm=False)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) > 1


def test_prefix_cache_keys_image_tokens_by_the_image(family):
    """The same image and question hit the cache; a different image with the same text hits
    only the blocks before the image, and gets its own answer (HF's for that image)."""
    text = family.fmt(chat("The quick brown fox jumps over the lazy dog. Paged attention keeps the KV cache in "
                           "blocks. <image> What is it?"))
    first, other = random_image(11, 40, 40), random_image(12, 40, 40)
    want_other = hf_greedy(family.hf_cls, family.dir, text, [other])
    llm = llm_for(family)
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


def test_encoder_cache_budget_holds_one_image_at_a_time(family):
    """A budget of the largest image's output: prompts take turns at their images, and every
    answer is still HF's; the cache never holds more than its budget."""
    probe = llm_for(family).engine.images
    one_image = max(item.nbytes for text, images in family.cases for item in probe.process(text, images)[1])
    llm = llm_for(family, max_num_batched_tokens=128, mm_encoder_cache_mb=one_image / 2 ** 20)
    cache = llm.engine.scheduler.encoder_cache
    peak = []
    schedule = llm.engine.scheduler.schedule

    def watched(*args):
        out = schedule(*args)
        peak.append(cache.used)
        return out

    llm.engine.scheduler.schedule = watched
    outs = llm.generate([prompt(*c) for c in family.cases], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == family.expected
    assert 0 < max(peak) <= one_image
    assert len(llm.engine.runner.images.outputs) <= 1
    assert_pool_clean(llm.engine)


def test_an_image_repeated_later_in_a_prompt_cannot_stall_it(family):
    """[a, b, a] under a budget of one and a half images: a's output, kept for its second copy,
    leaves no room for b; it goes (and is encoded again), and the answer is the one a budget
    for all three gives."""
    import threading

    a, b = random_image(21, 40, 50), random_image(22, 30, 30)
    case = prompt(family.fmt("<image> and <image> then <image>, say"), [a, b, a])
    probe = llm_for(family, max_model_len=1024)
    want = probe.generate([case], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    one_image = max(item.nbytes for item in probe.engine.images.process(case["prompt"], [a, b, a])[1])
    llm = llm_for(family, max_model_len=1024, mm_encoder_cache_mb=1.5 * one_image / 2 ** 20)
    got = []
    worker = threading.Thread(target=lambda: got.extend(llm.generate([case], GREEDY, use_tqdm=False)), daemon=True)
    worker.start()
    worker.join(120)
    assert got and got[0].outputs[0].token_ids == want
    assert llm.engine.scheduler.encoder_cache.used == 0
    assert_pool_clean(llm.engine)


def test_image_input_errors(family, tiny_llm):
    llm = llm_for(family, limit_mm_per_prompt='{"image": 1}')
    image = random_image(1, 30, 30)
    with pytest.raises(ValueError, match="2 images in one prompt; this server takes at most 1"):
        llm.generate(prompt(family.fmt(chat("<image><image>")), [image, image]), GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=f"has 0 image placeholders \\('{family.placeholder}'\\) for 1 images"):
        llm.generate(prompt(chat("no placeholder"), [image]), GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="takes no images"):
        tiny_llm.generate(prompt("<image>", [image]), GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="limit_mm_per_prompt takes"):
        LLM(str(family.dir), limit_mm_per_prompt='{"video": 1}')
    edge = _upscaled_edge(getattr(llm.engine.images.hf, "image_processor", None))
    assert bool(edge) == (family.name == "llava")  # CLIP's: scaled up whole before it is cropped
    if edge:
        thin = random_image(2, 1, DEFAULT_MAX_PIXELS // edge ** 2 + 10)
        with pytest.raises(ValueError, match="too thin"):
            llm.generate(prompt(family.fmt(chat("<image>")), [thin]), GREEDY, use_tqdm=False)
    # the engine serves on
    assert llm.generate(prompt(*family.cases[0]), GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert_pool_clean(llm.engine)


def test_idefics3_tower_reads_only_a_tiles_real_patches(tmp_path):
    """Tiles padded past their pixels (as HF batches them): the tower's output equals HF's
    Idefics3 vision transformer's, positions bucketed over the real patches only."""
    from transformers import Idefics3ForConditionalGeneration

    from pageserve.runtime.models.idefics3 import Idefics3VisionTower
    from pageserve.runtime.models.vision import load_exact

    model_dir = build_idefics3(tmp_path / "m")
    hf = Idefics3ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).model.vision_model
    tower = Idefics3VisionTower(hf.config.to_dict())
    load_exact(tower, hf.state_dict().items(), "vision tower")
    pixels = torch.randn(3, 3, 32, 32)
    mask = torch.zeros(3, 32, 32, dtype=torch.bool)
    mask[0] = True
    mask[1, :20, :32] = True  # 5 of 8 patch rows
    mask[2, :32, :12] = True  # 3 of 8 patch columns
    patches = mask.unfold(1, 4, 4).unfold(2, 4, 4).sum(dim=(-1, -2)) > 0
    with torch.inference_mode():
        want = hf(pixel_values=pixels, patch_attention_mask=patches).last_hidden_state
        got = tower(pixels, mask)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.unit
def test_encoder_cache_manager_budget_and_whole_images():
    """Chunks stop before an image whose output does not fit, or (whole_images) one they would
    cut; holds are shared by digest and released when computed, preempted or finished."""
    from pageserve.runtime.encoder_cache import EncoderCacheManager
    from pageserve.runtime.multimodal import ImageItem
    from pageserve.runtime.request import Request

    def item(digest, offset, length=4):
        return ImageItem(digest, offset, length, length, length * 100, {})

    def request(rid, *items):
        r = Request(rid, list(range(40)), SamplingParams(), 4, (), mm_items=items)
        return r

    a = request("a", item(b"x", 10), item(b"y", 20))
    b = request("b", item(b"x", 5))
    cache = EncoderCacheManager(budget_bytes=800)
    assert cache.schedulable(a, 0, 40) == 40  # both fit: 400 + 400
    cache.hold(a, 0, 40)
    assert cache.used == 800 and cache.schedulable(b, 0, 40) == 40  # b shares x
    cache.hold(b, 0, 40)
    assert cache.used == 800 and cache.refs == {b"x": 2, b"y": 1}
    c = request("c", item(b"z", 3))
    assert cache.schedulable(c, 0, 40) == 3  # z does not fit: the chunk stops before it
    a.num_computed_tokens = 24
    cache.release_done(a)
    assert cache.refs == {b"x": 1} and cache.take_freed() == [b"y"]
    assert cache.schedulable(c, 0, 40) == 40
    cache.release(b)
    assert cache.used == 0 and cache.take_freed() == [b"x"]
    whole = EncoderCacheManager(budget_bytes=10_000, whole_images=True)
    assert whole.schedulable(a, 0, 12) == 10  # would cut x: stop before it
    assert whole.schedulable(a, 0, 14) == 14
    assert whole.schedulable(a, 12, 1) == 0  # resumed inside x (a prefix hit): the rest at once or nothing
    assert whole.schedulable(a, 12, 2) == 2


@pytest.mark.unit
def test_outputs_kept_for_later_copies_go_when_they_leave_no_room():
    from pageserve.runtime.encoder_cache import EncoderCacheManager
    from pageserve.runtime.multimodal import ImageItem
    from pageserve.runtime.request import Request

    x, y, x2 = (ImageItem(d, o, 4, 4, 400, {}) for d, o in ((b"x", 2), (b"y", 10), (b"x", 20)))
    r = Request("r", list(range(40)), SamplingParams(), 4, (), mm_items=(x, y, x2))
    cache = EncoderCacheManager(budget_bytes=600)
    assert cache.schedulable(r, 0, 40) == 10  # y does not fit beside x
    cache.hold(r, 0, 10)
    r.num_computed_tokens = 10
    cache.release_done(r)
    assert cache.refs == {b"x": 1}  # kept for its copy at 20
    assert cache.schedulable(r, 10, 30) == 10  # x goes so that y fits; x comes back at 20
    assert cache.used == 0 and cache.take_freed() == [b"x"]
    other = Request("o", list(range(40)), SamplingParams(), 4, (), mm_items=(ImageItem(b"z", 0, 4, 4, 400, {}),))
    cache.hold(other, 0, 40)
    assert cache.schedulable(r, 10, 30) == 0  # another request's image: r waits, holding nothing


@pytest.mark.unit
def test_encoder_step_budget_lets_one_image_a_step_through():
    from pageserve.runtime.encoder_cache import EncoderCacheManager
    from pageserve.runtime.multimodal import ImageItem
    from pageserve.runtime.request import Request

    def request(rid, *offsets):
        items = tuple(ImageItem(rid.encode() + bytes([o]), o, 4, 4, 400, {}) for o in offsets)
        return Request(rid, list(range(40)), SamplingParams(), 4, (), mm_items=items)

    cache = EncoderCacheManager(budget_bytes=10_000, step_tokens=1)  # one image a step (the CPU default)
    a, b = request("a", 2, 10), request("b", 5)
    cache.begin_step()
    assert cache.schedulable(a, 0, 40) == 10  # the first image only: the chunk stops before the second
    cache.hold(a, 0, 10)
    assert cache.schedulable(b, 0, 40) == 5  # this step has encoded its image
    cache.begin_step()
    assert cache.schedulable(b, 0, 40) == 40
    wide = EncoderCacheManager(budget_bytes=10_000, step_tokens=8)
    wide.begin_step()
    assert wide.schedulable(a, 0, 40) == 40  # 8 tokens: both of a's


@pytest.mark.unit
def test_held_images_give_back_from_a_collection_inside_the_lock_and_count_own_copies():
    """A collection may run while take() holds the lock and free an item, whose finalizer gives
    its share back on that thread: the lock is re-entrant. An image's tensor that is a view of
    the batch's is copied, so what it keeps is what is counted."""
    import gc
    import threading

    from pageserve.runtime.multimodal import HeldImages, ImageItem, _own

    held = HeldImages(limit=10_000)
    item = ImageItem(b"d", 0, 4, 4, 400, {"pixel_values": torch.zeros(600, dtype=torch.uint8)})
    held.take([item], "p")
    cycle = [item]
    cycle.append(cycle)
    del item, cycle

    def collect_inside():
        with held._lock:
            gc.collect()  # the finalizer runs _give() here
    worker = threading.Thread(target=collect_inside, daemon=True)
    worker.start()
    worker.join(10)
    assert not worker.is_alive() and held.held == 0
    batch = torch.zeros(3, 100)
    own = _own({"pixel_values": batch[1], "sizes": [1, 2]})
    assert own["pixel_values"].untyped_storage().nbytes() == 400 and own["sizes"] == [1, 2]
    whole = torch.zeros(5)
    assert _own({"x": whole})["x"] is whole
