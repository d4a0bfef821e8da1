"""The output items of one Responses API answer, built from what the model writes (reasoning,
text, function calls) in the order it writes them, with the stream events that announce each
step. A whole response is built the same way and its events dropped, so the streamed and the
whole answers cannot disagree."""

from __future__ import annotations

import uuid


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseOutput:
    """Feed it `reasoning`, `text` and `call` / `arguments` pieces, then `close`; `items` holds
    the output items (the open one's text written at its close: see `snapshot`), `drain()` the
    events (without sequence numbers) since the last drain. A call whose id is put in
    `failed_calls` before it closes (its arguments are not a valid call) closes `incomplete`."""

    def __init__(self):
        self.items: list[dict] = []
        self.failed_calls: set[str] = set()
        self._events: list[dict] = []
        self._open: dict | None = None  # the item being written
        self._pieces: list[str] = []  # the open item's text or argument pieces, joined at its close

    def snapshot(self) -> list[dict]:
        """The output items as far as they are written."""
        self._write_open()
        return self.items

    def drain(self) -> list[dict]:
        events, self._events = self._events, []
        return events

    def reasoning(self, text: str) -> None:
        if not text:
            return
        part = self._part("reasoning", "rs", {"type": "reasoning_text", "text": ""},
                          {"summary": [], "content": [], "encrypted_content": None})
        self._delta("response.reasoning_text.delta", part, text)

    @property
    def writing_text(self) -> bool:
        """A message's text is the item being written."""
        return self._open is not None and self._open["type"] == "message"

    def text(self, text: str, logprobs: list[dict] | None = None) -> None:
        if not text and not logprobs:
            return
        part = self._part("message", "msg", {"type": "output_text", "text": "", "annotations": [], "logprobs": []},
                          {"role": "assistant", "content": []})
        part["logprobs"].extend(logprobs or ())
        self._delta("response.output_text.delta", part, text, logprobs=logprobs or [])

    def call(self, call_id: str, name: str) -> None:
        self.close()
        item = {"id": item_id("fc"), "type": "function_call", "status": "in_progress", "call_id": call_id,
                "name": name, "arguments": ""}
        self._add(item)

    def arguments(self, text: str) -> None:
        if self._open is None or self._open["type"] != "function_call":
            raise RuntimeError("function call arguments with no call open")  # a bug of ours, never input
        if text:
            self._pieces.append(text)
            self._emit("response.function_call_arguments.delta", item_id=self._open["id"],
                       output_index=len(self.items) - 1, delta=text)

    def close(self, status: str = "completed") -> None:
        """Finish the open item (`incomplete` when the answer was cut short inside it)."""
        if self._open is None:
            return
        self._write_open()
        item, self._open = self._open, None
        index = len(self.items) - 1
        if item["type"] == "function_call":
            if item["call_id"] in self.failed_calls:
                status = "incomplete"
            self._emit("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                       name=item["name"], arguments=item["arguments"])
        else:
            part = item["content"][0]
            done = "response.output_text.done" if item["type"] == "message" else "response.reasoning_text.done"
            extra = {"logprobs": part["logprobs"]} if item["type"] == "message" else {}
            self._emit(done, item_id=item["id"], output_index=index, content_index=0, text=part["text"], **extra)
            self._emit("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                       part=_copy(part))
        item["status"] = status
        self._emit("response.output_item.done", output_index=index, item=_copy(item))

    # ---- the pieces ----

    def _part(self, kind: str, prefix: str, part: dict, fields: dict) -> dict:
        """The open item's content part, opening an item of `kind` first if another is open."""
        if self._open is not None and self._open["type"] == kind:
            return self._open["content"][0]
        self.close()
        item = {"id": item_id(prefix), "type": kind, "status": "in_progress", **fields}
        self._add(item)
        item["content"].append(part)
        self._emit("response.content_part.added", item_id=item["id"], output_index=len(self.items) - 1,
                   content_index=0, part=_copy(part))
        return part

    def _write_open(self) -> None:
        if self._open is None:
            return
        text = "".join(self._pieces)
        self._pieces = [text]
        if self._open["type"] == "function_call":
            self._open["arguments"] = text
        else:
            self._open["content"][0]["text"] = text

    def _add(self, item: dict) -> None:
        self.items.append(item)
        self._open = item
        self._pieces = []
        self._emit("response.output_item.added", output_index=len(self.items) - 1, item=_copy(item))

    def _delta(self, kind: str, part: dict, text: str, **extra) -> None:
        self._pieces.append(text)
        self._emit(kind, item_id=self._open["id"], output_index=len(self.items) - 1, content_index=0,
                   delta=text, **extra)

    def _emit(self, kind: str, **fields) -> None:
        self._events.append({"type": kind, **fields})


def _copy(value):
    """A snapshot of an item or part as it is now (the lists it holds go on growing)."""
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value
