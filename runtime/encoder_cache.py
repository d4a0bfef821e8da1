"""The scheduler's account of the vision encoder's outputs the runner keeps (--mm-encoder-cache-mb):
a step may compute an image's tokens only while its encoder output is held. A request holds an
image from the step that first computes its tokens until its tokens are all computed (then
they live in the KV cache), or until it is preempted or finishes. Requests sharing an image
share one output. The runner drops an output when no request holds it (`take_freed`)."""

from __future__ import annotations

from pageserve.runtime.request import Request


class EncoderCacheManager:
    def __init__(self, budget_bytes: int, whole_images: bool = False, step_tokens: int | None = None):
        """whole_images: an image's tokens are computed in one step, never split across chunks
        (models whose image tokens attend to each other both ways). step_tokens: the image
        tokens a step may encode (vLLM's max_num_encoder_input_tokens); a step may always
        encode one image. None: no limit."""
        self.budget = budget_bytes
        self.whole_images = whole_images
        self.step_tokens = step_tokens
        self.step_left = step_tokens  # what this step may still encode
        self.used = 0
        self.refs: dict[bytes, int] = {}  # digest -> requests holding it
        self.sizes: dict[bytes, int] = {}
        self.held: dict[str, set[bytes]] = {}  # request id -> the digests it holds
        self._freed: list[bytes] = []

    def schedulable(self, req: Request, start: int, num_new: int) -> int:
        """How many of `num_new` tokens from `start` the request may compute this step: the
        chunk ends before the first image it reaches whose output does not fit in what is left
        (and, with whole_images, before an image it would cut). Where that leaves none while
        the request holds outputs, those are of images it has computed, kept for their copies
        later in the prompt (no image it is partway through is before the one that stops it):
        they go, to be encoded again when reached, so that they cannot keep the request (and
        the budget they hold, every other one) waiting for good."""
        if not req.mm_items:
            return num_new
        tokens, no_room = self._schedulable(req, start, num_new)
        if not tokens and no_room and self.held.get(req.request_id):
            self.release(req)
            tokens, _ = self._schedulable(req, start, num_new)
        return tokens

    def _schedulable(self, req: Request, start: int, num_new: int) -> tuple[int, bool]:
        """(tokens, whether the chunk stops at an image for want of room in the budget)."""
        held = self.held.get(req.request_id, ())
        need = encode = 0
        counted: set[bytes] = set()
        for item in req.mm_items:
            if item.offset >= start + num_new:
                break
            if item.end <= start:
                continue
            if self.whole_images and item.end > start + num_new:
                return max(0, item.offset - start), False
            d = item.digest
            if d in held or d in self.refs or d in counted:
                continue
            no_room = self.used + need + item.nbytes > self.budget
            if no_room or not self._may_encode(encode + item.num_embeds, first=not encode):
                return max(0, item.offset - start), no_room
            need += item.nbytes
            encode += item.num_embeds
            counted.add(d)
        return num_new, False

    def _may_encode(self, tokens: int, first: bool) -> bool:
        """Within this step's encoder budget (a step's first image always is)."""
        if self.step_left is None:
            return True
        return tokens <= self.step_left or (first and self.step_left == self.step_tokens)

    def begin_step(self) -> None:
        self.step_left = self.step_tokens

    def hold(self, req: Request, start: int, num_new: int) -> None:
        """The request computes [start, start + num_new) this step: hold the images it reaches."""
        if not req.mm_items:
            return
        held = self.held.setdefault(req.request_id, set())
        for item in req.mm_items:
            if item.offset >= start + num_new:
                break
            d = item.digest
            if item.end <= start or d in held:
                continue
            held.add(d)
            if d not in self.refs:
                self.refs[d], self.sizes[d] = 0, item.nbytes
                self.used += item.nbytes
                if self.step_left is not None:
                    self.step_left = max(0, self.step_left - item.num_embeds)
            self.refs[d] += 1

    def release_done(self, req: Request) -> None:
        """After a step: the images whose tokens are all computed go."""
        held = self.held.get(req.request_id)
        if held:
            done = {i.digest for i in req.mm_items if i.end <= req.num_computed_tokens}
            # an image repeated later in the prompt stays held until its last copy is computed
            done -= {i.digest for i in req.mm_items if i.end > req.num_computed_tokens}
            for d in held & done:
                self._drop(req, d)

    def release(self, req: Request) -> None:
        """The request was preempted or finished: everything it holds goes."""
        for d in list(self.held.get(req.request_id, ())):
            self._drop(req, d)
        self.held.pop(req.request_id, None)

    def _drop(self, req: Request, digest: bytes) -> None:
        self.held[req.request_id].discard(digest)
        self.refs[digest] -= 1
        if not self.refs[digest]:
            del self.refs[digest]
            self.used -= self.sizes.pop(digest)
            self._freed.append(digest)

    def take_freed(self) -> list[bytes]:
        freed, self._freed = self._freed, []
        return freed
