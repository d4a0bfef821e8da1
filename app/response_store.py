"""Finished responses kept in memory for `previous_response_id`, `GET` and `DELETE
/v1/responses/{id}`: a bounded map in least-recently-used order (`--max-stored-responses`).
Nothing is written to disk: stored responses end with the process."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response: dict  # the response object as it was returned
    input_items: tuple[dict, ...]  # this request's own input items, each with its id
    conversation: tuple[dict, ...]  # every item up to and including this response's output


class ResponseStore:
    def __init__(self, max_responses: int):
        if max_responses < 0:
            raise ValueError("--max-stored-responses must be >= 0")
        self.max_responses = max_responses
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._responses)

    def put(self, stored: StoredResponse) -> None:
        if self.max_responses == 0:
            return
        rid = stored.response["id"]
        self._responses[rid] = stored
        self._responses.move_to_end(rid)
        while len(self._responses) > self.max_responses:
            self._responses.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._responses.get(response_id)
        if stored is not None:
            self._responses.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        return self._responses.pop(response_id, None) is not None

    def find_item(self, item_id: str) -> dict | None:
        """An item (input or output) of any stored response, for an `item_reference`; the most
        recent response first."""
        for stored in reversed(self._responses.values()):
            for item in stored.conversation:
                if item.get("id") == item_id:
                    return item
        return None
