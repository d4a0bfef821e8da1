"""What the routes share: the async engine, the tokenizer and the server's settings."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from pageserve.app.errors import APIError
from pageserve.app.logprobs import TokenText
from pageserve.grammar.vocabulary import token_byte_table
from pageserve.runtime.async_engine import AsyncEngine

# a prompt longer than this (characters) is tokenized in a worker thread, off the event loop
LONG_TEXT = 4096


@dataclass(frozen=True)
class ServerSettings:
    served_model_names: tuple[str, ...]
    model_path: str
    api_keys: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()
    max_request_body_bytes: int = 32 << 20
    max_num_queued_reqs: int = 1024
    log_requests: bool = True
    log_prompts: bool = False
    enable_auto_tool_choice: bool = False  # tool_choice auto (with --tool-call-parser)
    enable_frontend: bool = True  # the chat page at / (--disable-frontend)

    def __post_init__(self):
        if not self.served_model_names:
            raise ValueError("at least one served model name is needed")
        if self.max_request_body_bytes < 1024:
            raise ValueError("--max-request-body-mb is too small")
        if self.max_num_queued_reqs < 1:
            raise ValueError("--max-num-queued-reqs must be >= 1")


@dataclass
class ServerState:
    engine: AsyncEngine
    tokenizer: Any  # the transformers tokenizer: chat template rendering
    settings: ServerSettings
    max_model_len: int
    created: int = field(default_factory=lambda: int(time.time()))
    token_text: TokenText = field(init=False)

    def __post_init__(self):
        self.token_text = TokenText(token_byte_table(self.tokenizer))

    @property
    def model_name(self) -> str:
        return self.settings.served_model_names[0]

    def check_model(self, name: str | None) -> str:
        """The served name a request asks for (the first one when it names none)."""
        if name is None or name == "":
            return self.model_name
        if name not in self.settings.served_model_names:
            raise APIError(404, f"The model `{name}` does not exist.", param="model",
                           code="model_not_found")
        return name

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > LONG_TEXT:
            return await asyncio.to_thread(self.engine.tokenize, text, add_special_tokens)
        return self.engine.tokenize(text, add_special_tokens)

    def detokenize(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)
