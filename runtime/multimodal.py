"""Images into the engine. Before a request is queued, the model's own Hugging Face processor
turns the prompt text (one placeholder per image) and the images into token ids, with each
image's placeholder expanded into its image tokens, and into pixel tensors. Each image becomes
an `ImageItem`: where its tokens sit in the prompt, a digest of its pixels (the prefix cache
keys those tokens by it), and its tensors for the vision encoder. In a step, the runner encodes
the images whose tokens the step computes (once each; `EncoderOutputs` keeps the output until
the scheduler's EncoderCacheManager lets it go) and writes their rows over those tokens'
embeddings."""

from __future__ import annotations

import hashlib
import threading
import time
import weakref
from dataclasses import dataclass, field

import torch

from pageserve.runtime.input_processor import InvalidRequest

# a decoded image may hold at most this many pixels (PIL's own bomb limit is 89 M)
DEFAULT_MAX_PIXELS = 40_000_000
# the processor tensors that the server's requests in flight may hold together
MAX_HELD_IMAGE_BYTES = 8 << 30


class ImagesHeldError(RuntimeError):
    """The requests in flight hold as many processed images as the server keeps: retry."""


class HeldImages:
    """The bytes of processor tensors (ImageItem.data) that requests in flight hold. A request
    keeps its images' tensors until it ends (a preempted one encodes them again), so the queue's
    requests with their images each could hold more than the machine has: Qwen2.5-VL's float32
    patches are 24 bytes a pixel, 77 MB for a 4,096-token image. Each item's share is given back
    when its tensors are freed, however its request ended."""

    def __init__(self, limit: int = MAX_HELD_IMAGE_BYTES):
        self.limit, self.held = limit, 0
        # re-entrant: a collection while the lock is held may free an item and give its share back
        self._lock = threading.RLock()

    def take(self, items, param: str) -> None:
        """Count `items` (just made) as held: InvalidRequest if they alone pass the limit,
        ImagesHeldError if they would beside what is held."""
        sizes = [sum(t.nbytes for t in item.data.values() if isinstance(t, torch.Tensor)) for item in items]
        total = sum(sizes)
        if total > self.limit:
            raise InvalidRequest(f"the prompt's images become {total / 2 ** 20:.0f} MiB of tensors, more than "
                                 f"the {self.limit / 2 ** 20:.0f} MiB this server holds", param)
        with self._lock:
            fits = self.held + total <= self.limit
            if fits:
                self.held += total
        if not fits:
            raise ImagesHeldError("the requests in flight hold as many images as the server keeps "
                                  f"({self.limit / 2 ** 20:.0f} MiB of tensors): retry")
        for item, size in zip(items, sizes):
            tensors = [t for t in item.data.values() if isinstance(t, torch.Tensor)]
            if tensors:  # the dict holds them all: they go together
                weakref.finalize(tensors[0], self._give, size)
            else:
                self._give(size)

    def _give(self, size: int) -> None:
        with self._lock:
            self.held -= size


@dataclass(frozen=True, slots=True, eq=False)
class ImageItem:
    """One image of a prompt: its tokens are prompt positions [offset, offset + length); the
    encoder's output rows go, in order, to the positions of that span marked in `embed_mask`
    (all of them when it is None: some models put text tokens, row and column markers, inside
    an image's span)."""
    digest: bytes
    offset: int
    length: int
    num_embeds: int
    nbytes: int  # of its encoder output, which the encoder cache budgets
    data: dict = field(repr=False)  # the processor's tensors for this image alone
    embed_mask: torch.Tensor | None = field(default=None, repr=False)

    @property
    def end(self) -> int:
        return self.offset + self.length


def image_digest(image) -> bytes:
    """A digest of a PIL image's pixels, mode and size."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{image.mode}:{image.size[0]}x{image.size[1]}:".encode())
    h.update(image.tobytes())
    return h.digest()


def _upscaled_edge(processor) -> int | None:
    """The length an image processor scales every image's shorter side to, keeping its aspect,
    before it crops the middle (CLIP's, LLaVA-1.5's); None for the others (LLaVA-NeXT's tiles
    the image first; Qwen2-VL's `shortest_edge` is a pixel count)."""
    if processor is None or not getattr(processor, "do_center_crop", False) \
            or getattr(processor, "image_grid_pinpoints", None):
        return None
    size = getattr(processor, "size", None)
    edge = size.get("shortest_edge") if isinstance(size, dict) else getattr(size, "shortest_edge", None)
    return edge if isinstance(edge, int) and edge > 0 else None


def _own(data: dict) -> dict:
    """An image's tensors, each its own copy where it is a view of the batch's (LLaVA-NeXT's
    patches, padded to the prompt's largest image): the batch is freed with the processor's
    output, and what the image keeps is what HeldImages counts."""
    return {k: v.clone() if isinstance(v, torch.Tensor) and v.untyped_storage().nbytes() > v.nbytes else v
            for k, v in data.items()}


def _rgb(image):
    """The image in RGB, what is transparent on white, as a viewer shows it (and vLLM makes
    RGBA images): dropping the alpha would show the colours under it, often black or noise."""
    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        from PIL import Image

        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def image_token_runs(ids: list[int], token: int) -> list[tuple[int, int]]:
    """(offset, length) of each run of `token` in `ids`."""
    runs, i, n = [], 0, len(ids)
    while i < n:
        if ids[i] == token:
            j = i
            while j < n and ids[j] == token:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    return runs


def counted_image_spans(ids: list[int], token: int, counts: list[int]) -> list[tuple[int, int]]:
    """(offset, length) of each image, given how many image tokens each has: the image tokens in
    order, cut into runs of those lengths (two images side by side make one run of tokens)."""
    positions = [i for i, t in enumerate(ids) if t == token]
    if len(positions) != sum(counts):
        raise ValueError(f"{len(positions)} image tokens for images of {sum(counts)}")
    spans, at = [], 0
    for n in counts:
        if positions[at + n - 1] - positions[at] != n - 1:
            raise ValueError("an image's tokens are not contiguous")
        spans.append((positions[at], n))
        at += n
    return spans


def equal_image_spans(ids: list[int], token: int, num_images: int) -> list[tuple[int, int]]:
    """counted_image_spans where every image has as many tokens as the others (one resolution)."""
    total = sum(1 for t in ids if t == token)
    if not num_images or total % num_images:
        raise ValueError(f"{total} image tokens for {num_images} images")
    return counted_image_spans(ids, token, [total // num_images] * num_images)


def mrope_positions(items, start: int, n: int) -> torch.Tensor:
    """[3, n] M-RoPE positions (t, h, w) of a request's tokens [start, start + n): a text token's
    are its index plus what the images before it added (each moves the text after it on by its
    grid's largest side, not by its token count); an image's tokens are (0, row, column) of its
    token grid after the text before it. Output tokens are text."""
    out = torch.arange(start, start + n).expand(3, n).clone()
    shift = 0  # what the images so far added to the text positions
    for item in items:
        t, h, w = item.data["mrope_grid"]
        delta = max(h, w) - item.length
        lo, hi = max(start, item.offset), min(start + n, item.end)
        if lo < hi:
            i = torch.arange(lo - item.offset, hi - item.offset)
            grid = torch.stack([i // (h * w), i // w % h, i % w])
            out[:, lo - start:hi - start] = item.offset + shift + grid
        if item.end < start + n:
            out[:, max(item.end - start, 0):] += delta
        shift += delta
    return out


class MultiModalProcessor:
    """The model's HF processor and the per-model rules: its class's `image_token` (config ->
    the image token id), `image_placeholder` (None: the processor's image_token), and
    `image_inputs` (the processor's output -> each image's span in the prompt and tensors)."""

    def __init__(self, path: str, model_cls, hf_config: dict, hidden_size: int, dtype: torch.dtype,
                 max_images: int, encoder_cache_bytes: int, max_image_tokens: int | None = None,
                 max_pixels: int = DEFAULT_MAX_PIXELS):
        """max_image_tokens: the most tokens one image may take (its tokens must fit in one step
        where the model's image tokens attend to each other); None: no limit."""
        from transformers import AutoProcessor

        own = getattr(model_cls, "processor", None)  # a model's own, where transformers' cannot load
        self.hf = own(path) if own is not None else AutoProcessor.from_pretrained(path)
        self.model_cls = model_cls
        self.image_token_id = model_cls.image_token(hf_config)
        self.placeholder = model_cls.image_placeholder or getattr(self.hf, "image_token", None)
        if not self.placeholder:
            raise ValueError(f"{path}: the processor names no image token")
        self.row_bytes = hidden_size * torch.empty((), dtype=dtype).element_size()
        self.max_images = max_images
        self.encoder_cache_bytes = encoder_cache_bytes
        self.max_pixels = max_pixels
        self.max_image_tokens = max_image_tokens

    def check_images(self, images: list, param: str) -> None:
        """A processor that scales an image's shortest side to a fixed length (CLIP's, LLaVA-1.5's)
        scales a thin image up before it crops: a 1 x 20,000 image became 336 x 6.7 million
        floats. Such an image is refused where what the processor makes passes max_pixels."""
        if len(images) > self.max_images:
            raise InvalidRequest(f"{len(images)} images in one prompt; this server takes at most "
                                 f"{self.max_images} (--limit-mm-per-prompt)", param)
        edge = _upscaled_edge(getattr(self.hf, "image_processor", None))
        for i, image in enumerate(images):
            w, h = image.size
            if w * h > self.max_pixels:
                raise InvalidRequest(f"image {i} has {w}x{h} pixels, more than the {self.max_pixels} "
                                     "this server decodes", param)
            if edge and edge * edge * max(w, h) > self.max_pixels * max(min(w, h), 1):
                raise InvalidRequest(f"image {i} ({w}x{h}) is too thin: this model's processor scales its "
                                     f"shorter side to {edge} pixels, which makes more than the "
                                     f"{self.max_pixels} pixels this server decodes", param)

    def process(self, text: str, images: list, add_special_tokens: bool = True,
                param: str = "prompt") -> tuple[list[int], tuple[ImageItem, ...]]:
        """Token ids of the prompt with each image's tokens in place, and the images. The text
        must hold exactly one placeholder per image."""
        self.check_images(images, param)
        found = text.count(self.placeholder)
        if found != len(images):
            raise InvalidRequest(f"the prompt has {found} image placeholders ({self.placeholder!r}) for "
                                 f"{len(images)} images", param)
        images = [_rgb(im) for im in images]
        kwargs = {"images": images} if images else {}
        try:
            out = self.hf(text=[text], return_tensors="pt", add_special_tokens=add_special_tokens, **kwargs)
        except (ValueError, TypeError, OSError) as e:
            raise InvalidRequest(f"the images could not be processed: {e}", param) from None
        ids = out["input_ids"][0].tolist()
        if not images:
            return ids, ()
        items = []
        spans = self.model_cls.image_inputs(out, ids, self.image_token_id, len(images), self.hf)
        for image, (offset, length, data) in zip(images, spans, strict=True):
            mask = torch.tensor(ids[offset:offset + length]) == self.image_token_id
            n = int(mask.sum())
            items.append(ImageItem(image_digest(image), offset, length, n, n * self.row_bytes, _own(data),
                                   None if n == length else mask))
        for i, item in enumerate(items):
            if self.max_image_tokens is not None and item.length > self.max_image_tokens:
                raise InvalidRequest(f"image {i} becomes {item.length} tokens, which this model computes in one "
                                     f"step; a step holds at most {self.max_image_tokens} "
                                     "(--max-num-batched-tokens)", param)
            if item.nbytes > self.encoder_cache_bytes:
                raise InvalidRequest(f"image {i} becomes {item.num_embeds} tokens, whose encoder output "
                                     f"({item.nbytes / 2 ** 20:.1f} MiB) is more than the encoder cache holds "
                                     f"({self.encoder_cache_bytes / 2 ** 20:.1f} MiB, --mm-encoder-cache-mb)",
                                     param)
        return ids, tuple(items)


class EncoderOutputs:
    """The runner's side: encoder outputs by image digest, computed when a step first needs
    them and dropped when the scheduler says so."""

    def __init__(self, bf16: bool = False):
        """bf16: the encoder's matmuls in bfloat16 (--dtype auto on CPUs with AVX512-BF16, where
        the language model's are too)."""
        self.bf16 = bf16
        self.outputs: dict[bytes, torch.Tensor] = {}
        self.seconds: dict[str, float] = {}  # request id -> spent encoding its images, since take_seconds

    def free(self, digests: list[bytes]) -> None:
        for d in digests:
            self.outputs.pop(d, None)

    def take_seconds(self) -> dict[str, float]:
        s, self.seconds = self.seconds, {}
        return s

    def prepare(self, model, requests, positions: torch.Tensor, meta,
                device: torch.device) -> tuple[torch.Tensor, tuple | None, dict[str, float]]:
        """What a step needs of the images: its positions (M-RoPE (t, h, w) triples where the
        model takes them), the rows of the image tokens it computes and their embeddings (None:
        none), and the seconds each request spent in the encoder. Sets meta.key_limit where the
        model's image tokens attend to each other."""
        if getattr(model, "mrope_section", None):
            positions = torch.cat([mrope_positions(r.mm_items, r.start_pos, len(r.token_ids)) for r in requests],
                                  dim=1).to(device)
        if not any(r.mm_items for r in requests):
            return positions, None, {}
        starts = [0]
        for r in requests:
            starts.append(starts[-1] + len(r.token_ids))
        images = self.step_embeddings(model, requests, starts, device)
        if images is not None and getattr(model, "images_attend_both_ways", False):
            meta.key_limit = self.key_limit(requests, starts, positions)
        return positions, images, self.take_seconds()

    def step_embeddings(self, model, requests, starts: list[int],
                        device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows of the step's flat batch, their embeddings) for the image tokens the step
        computes, or None when it computes none. `starts`: each request's first row."""
        rows, values = [], []
        for r, first in zip(requests, starts):
            lo, hi = r.start_pos, r.start_pos + len(r.token_ids)
            for item in r.mm_items:
                a, b = max(lo, item.offset), min(hi, item.end)
                if a >= b:
                    continue
                out = self._encode(model, item, r.request_id)
                span = torch.arange(a, b)
                if item.embed_mask is None:
                    index = span - item.offset
                else:
                    rank = torch.cumsum(item.embed_mask.long(), 0) - 1
                    keep = item.embed_mask[a - item.offset:b - item.offset]
                    span, index = span[keep], rank[a - item.offset:b - item.offset][keep]
                rows.append(span - lo + first)
                values.append(out[index.to(out.device)])
        if not rows:
            return None
        return torch.cat(rows).to(device), torch.cat(values)

    @staticmethod
    def key_limit(requests, starts: list[int], positions: torch.Tensor) -> torch.Tensor:
        """AttentionMetadata.key_limit for a model whose image tokens attend to each other:
        each token's own position, an image token's its image's last."""
        limit = positions.clone()
        for r, first in zip(requests, starts):
            lo, hi = r.start_pos, r.start_pos + len(r.token_ids)
            for item in r.mm_items:
                a, b = max(lo, item.offset), min(hi, item.end)
                if a < b:
                    limit[a - lo + first:b - lo + first] = item.end - 1
        return limit

    def _encode(self, model, item: ImageItem, request_id: str) -> torch.Tensor:
        out = self.outputs.get(item.digest)
        if out is None:
            t = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
                out = model.encode_image(item.data)
            if out.shape[0] != item.num_embeds:
                raise RuntimeError(f"the vision encoder gave {out.shape[0]} rows for an image of "
                                   f"{item.num_embeds} tokens")
            self.outputs[item.digest] = out
            self.seconds[request_id] = self.seconds.get(request_id, 0.0) + time.perf_counter() - t
        return out
