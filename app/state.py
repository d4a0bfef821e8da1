"""What the routes share: the async engine, the tokenizer and the server's settings."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pageserve.app.errors import APIError, bad_request
from pageserve.app.http import off_loop_if
from pageserve.app.lora import Adapters
from pageserve.app.logprobs import TokenIdLabels, TokenText
from pageserve.app.media import MediaLoader, MediaSettings
from pageserve.app.reasoning import ReasoningParser, reasoning_parser_class
from pageserve.app.tool_parsers import DEFAULT_TOOL_PARSER, TOOL_PARSERS
from pageserve.app.response_store import ResponseStore
from pageserve.grammar.vocabulary import token_byte_table
from pageserve.runtime.async_engine import AsyncEngine
from pageserve.sampling.params import SamplingParams

# a prompt longer than this (characters, or token ids) is tokenized or checked in a worker thread
LONG_TEXT = 4096

# what a model's generation_config.json may set for requests that leave it unset (as vLLM)
GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
logger = logging.getLogger(__name__)


def check_generation_overrides(overrides: dict) -> dict:
    """--override-generation-config's fields and values, checked before the model loads."""
    unknown = sorted(set(overrides) - set(GENERATION_DEFAULTS))
    if unknown:
        raise ValueError(f"--override-generation-config cannot set {', '.join(unknown)}; it sets "
                         f"{', '.join(GENERATION_DEFAULTS)}")
    try:  # top_k 0 is transformers' "no top-k", as in a generation_config.json
        SamplingParams(**{**overrides, **({"top_k": -1} if overrides.get("top_k") == 0 else {})})
    except (TypeError, ValueError) as e:
        raise ValueError(f"--override-generation-config: {e}") from None
    return overrides


def generation_defaults(source: str, model_generation_config: dict, overrides: dict | None = None) -> dict:
    """--generation-config: `auto` takes the model's generation_config.json, a folder that
    folder's, `vllm` none (the API's own defaults); `overrides` (--override-generation-config)
    set or replace fields on top, as in vLLM."""
    overrides = check_generation_overrides(overrides or {})
    if source == "vllm":
        gen, where = {}, "the API's defaults"
    elif source == "auto":
        gen, where = model_generation_config, "the model's generation_config.json"
    else:
        path = Path(source) / "generation_config.json"
        try:
            gen, where = json.loads(path.read_text()), str(path)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"--generation-config {source}: cannot read {path}: {e}") from None
    if overrides:
        gen, where = {**gen, **overrides}, f"{where} and --override-generation-config"
    defaults = {k: gen[k] for k in GENERATION_DEFAULTS if gen.get(k) is not None}
    if defaults.get("top_k") == 0:  # transformers' "no top-k"
        defaults["top_k"] = -1
    try:  # checked once here rather than failing every request that leaves them unset
        SamplingParams(**defaults)
    except (TypeError, ValueError) as e:
        raise ValueError(f"the sampling defaults of {where} are not valid: {e}") from None
    if defaults:
        logger.info("sampling defaults from %s for requests that do not set them: %s", where,
                    ", ".join(f"{k}={v}" for k, v in defaults.items()))
    return defaults


@dataclass(frozen=True)
class ServerSettings:
    served_model_names: tuple[str, ...]
    model_path: str
    api_keys: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()
    # the Host names a browser's request may carry besides the local ones (None: any host)
    allowed_hosts: tuple[str, ...] | None = None
    max_request_body_bytes: int = 32 << 20
    max_num_queued_reqs: int = 1024
    log_requests: bool = True
    log_prompts: bool = False
    enable_auto_tool_choice: bool = False  # tool_choice auto (with --tool-call-parser)
    tool_call_parser: str = DEFAULT_TOOL_PARSER  # --tool-call-parser: how tool calls are written
    enable_frontend: bool = True  # the chat page at / (--disable-frontend)
    chat_template: str | None = None  # --chat-template, read: replaces the model's own
    generation_config: str = "auto"  # --generation-config: auto, vllm or a folder
    override_generation_config: dict = field(default_factory=dict)  # fields set on top of it
    max_stored_responses: int = 1024  # finished Responses API answers kept for previous_response_id
    max_stored_responses_mb: float = 256  # ... and the bytes they may take
    max_prompt_logprobs_tokens: int = 32768  # prompt tokens with logprobs in one request
    reasoning_parser: str | None = None  # --reasoning-parser: thinking goes to reasoning_content
    allowed_media_domains: tuple[str, ...] = ()  # hosts http(s) image URLs may name (none: data: URLs only)
    lora_modules: tuple = ()  # --lora-modules: app/lora.py's LoRAModule, read at start-up
    allow_runtime_lora_updating: bool = False  # /v1/load_lora_adapter and /v1/unload_lora_adapter served
    return_tokens_as_token_ids: bool = False  # every logprob entry names its token "token_id:N"

    def __post_init__(self):
        if not self.served_model_names:
            raise ValueError("at least one served model name is needed")
        if self.max_request_body_bytes < 1024:
            raise ValueError("--max-request-body-mb is too small")
        if self.max_num_queued_reqs < 1:
            raise ValueError("--max-num-queued-reqs must be >= 1")
        if self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_PARSERS)}")
        if self.max_stored_responses < 0:
            raise ValueError("--max-stored-responses must be >= 0")
        if self.max_stored_responses_mb < 0:
            raise ValueError("--max-stored-responses-mb must be >= 0")
        if self.max_prompt_logprobs_tokens < 0:
            raise ValueError("--max-prompt-logprobs-tokens must be >= 0")
        if self.reasoning_parser is not None:
            reasoning_parser_class(self.reasoning_parser)  # the names it knows, for a wrong one
        check_generation_overrides(self.override_generation_config)


@dataclass
class ServerState:
    engine: AsyncEngine
    tokenizer: Any  # the transformers tokenizer: chat template rendering
    settings: ServerSettings
    max_model_len: int
    created: int = field(default_factory=lambda: int(time.time()))
    token_text: TokenText = field(init=False)
    token_id_labels: TokenIdLabels = field(init=False)  # return_tokens_as_token_ids

    sampling_defaults: dict = field(init=False)
    responses: ResponseStore = field(init=False)  # stored Responses API answers
    reasoning: ReasoningParser | None = field(init=False)  # splits thinking from the answer
    media: MediaLoader = field(init=False)  # images from the requests' URLs
    adapters: Adapters = field(init=False)  # LoRA adapters a request may name as its model

    def __post_init__(self):
        self.token_text = TokenText(token_byte_table(self.tokenizer))
        self.token_id_labels = TokenIdLabels(self.token_text.table)
        if self.settings.chat_template is not None:
            self.tokenizer.chat_template = self.settings.chat_template
        self.sampling_defaults = generation_defaults(self.settings.generation_config,
                                                     self.engine.generation_config,
                                                     self.settings.override_generation_config)
        self.responses = ResponseStore(self.settings.max_stored_responses,
                                       int(self.settings.max_stored_responses_mb * 2**20))
        self.media = MediaLoader(MediaSettings(tuple(d.lower() for d in self.settings.allowed_media_domains)))
        name = self.settings.reasoning_parser
        self.reasoning = reasoning_parser_class(name)(self.tokenizer) if name is not None else None
        self.adapters = Adapters(self.engine, self.settings.served_model_names)
        for module in self.settings.lora_modules:
            self.adapters.load_at_start(module)

    @property
    def model_name(self) -> str:
        return self.settings.served_model_names[0]

    def check_model(self, name: str | None) -> str:
        """The served name a request asks for (the first one when it names none): the model's,
        or a LoRA adapter's (`adapters.get(name)` gives it)."""
        if name is None or name == "":
            return self.model_name
        if name not in self.settings.served_model_names and self.adapters.get(name) is None:
            raise APIError(404, f"The model `{name}` does not exist.", param="model",
                           code="model_not_found")
        return name

    async def tokenize(self, text: str, add_special_tokens: bool = True, param: str | None = None,
                       keep_last: int | None = None) -> list[int]:
        """`param`: the request field of a prompt, which is refused when far longer than the
        context; None for /tokenize, which counts any text, as vLLM's does. `keep_last`: the
        prompt's last tokens only (truncate_prompt_tokens)."""
        return await off_loop_if(len(text) > LONG_TEXT,
                                 lambda: self.engine.tokenize(text, add_special_tokens, param, keep_last))

    async def tokenize_all(self, texts: list[str], param: str | list[str],
                           keep_last: int | None = None) -> list[list[int]]:
        """Many prompts (a completions or embeddings list), in a worker thread when together they
        are long (2,048 short ones held the event loop up to 3.4 s)."""
        return await off_loop_if(sum(map(len, texts)) > LONG_TEXT,
                                 lambda: self.engine.tokenize_all(texts, param, keep_last))

    def token_labels(self, body) -> TokenText:
        """How the request's logprob entries name tokens: by text, or as "token_id:N" where it or
        the server asks (return_tokens_as_token_ids)."""
        as_ids = getattr(body, "return_tokens_as_token_ids", None) or self.settings.return_tokens_as_token_ids
        return self.token_id_labels if as_ids else self.token_text

    def truncation(self, body) -> int | None:
        """How many of its prompt's last tokens a request keeps (vLLM's truncate_prompt_tokens: -1
        for the context length); None: all."""
        keep = getattr(body, "truncate_prompt_tokens", None)
        if keep is None:
            return None
        if keep == 0:
            raise bad_request("truncate_prompt_tokens must be at least 1, or -1 for the context length",
                              "truncate_prompt_tokens")
        if keep > self.max_model_len:
            raise bad_request(f"truncate_prompt_tokens ({keep}) is larger than the model's context length "
                              f"({self.max_model_len})", "truncate_prompt_tokens")
        return self.max_model_len if keep == -1 else keep

    def detokenize(self, token_ids: list[int]) -> str:
        # _decode: decode's own conversion of the list held the event loop 0.2 s for a million ids
        return getattr(self.tokenizer, "_decode", self.tokenizer.decode)(token_ids)

    async def detokenize_checked(self, token_ids: list[int], param: str) -> str:
        """A client's ids checked against the vocabulary and decoded: in a worker thread when they
        are many (a million held the event loop 0.3 s)."""
        def work() -> str:
            self.engine.check_token_ids(token_ids, param)
            return self.detokenize(token_ids)
        return await off_loop_if(len(token_ids) > LONG_TEXT, work)
