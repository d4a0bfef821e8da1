"""OpenAI request bodies as pydantic models: strict types, ranges, unknown fields ignored.

Fields that vLLM accepts beyond OpenAI's (top_k, min_p, ignore_eos, stop_token_ids, ...) are
here too, so that a vLLM client works unchanged."""

from __future__ import annotations

from typing import Any, Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, field_validator, model_validator


def _integral(value):
    """JSON has one number type: 2.0 is the integer 2 (as JSON Schema's `integer` says)."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2 ** 63:
        return int(value)
    return value


def integer(**bounds):
    """An int field with bounds. The bounds sit inside the validator, so the JSON schema shows
    them as minimum / maximum."""
    return Annotated[int, Field(**bounds), BeforeValidator(_integral)]


TokenIds = list[integer(ge=0)]
PromptIds = Annotated[TokenIds, Field(min_length=1)]
PromptText = Annotated[str, Field(min_length=1)]
MAX_PROMPTS = 2048  # prompts (or inputs) in one request, as OpenAI's embeddings allow
MAX_STOP = 64  # stop strings, each at most MAX_STOP_LEN characters
MAX_STOP_LEN = 256
MAX_ALLOWED_TOKENS = 65_536  # allowed_token_ids: a step masks each row's vocabulary from them
MAX_GRAMMAR_CHARS = 64_000  # a regex for structured output


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data):
        """OpenAI clients send `null` for a field they leave unset: it takes the default."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ImageURL(_Body):
    url: str = Field(min_length=1)
    detail: Literal["auto", "low", "high"] | None = None


class ContentPart(_Body):
    """A text part, or an image (a data: URL, or an http(s) URL the server may fetch)."""
    type: Literal["text", "image_url"]
    text: str | None = None
    image_url: ImageURL | None = None
    # where in the client's body a part made from another API's (Anthropic's blocks) came from
    _source: str | None = PrivateAttr(default=None)

    @model_validator(mode="before")
    @classmethod
    def _known_type(cls, data):
        if isinstance(data, dict) and data.get("type") not in ("text", "image_url"):
            raise ValueError(f"content parts of type {data.get('type')!r} are not supported "
                             "(only 'text' and 'image_url')")
        return data

    @model_validator(mode="after")
    def _fields(self):
        if self.type == "text" and self.text is None:
            raise ValueError("a text part needs 'text'")
        if self.type == "image_url" and self.image_url is None:
            raise ValueError("an image_url part needs 'image_url': {'url': ...}")
        return self


class FunctionCall(_Body):
    name: str
    arguments: str = ""


class ToolCall(_Body):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # an earlier answer's thinking (vLLM's field; `reasoning` too)
    reasoning: str | None = None

    def text(self, image_placeholder: str = "") -> str:
        """The content as text, each image part as `image_placeholder`."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text if part.type == "text" else image_placeholder for part in self.content)

    def image_urls(self) -> list[tuple[int, str, str | None]]:
        """(part index, URL, where the part came from if it was made from another API's) of each
        image part."""
        if not isinstance(self.content, list):
            return []
        return [(j, part.image_url.url, part._source) for j, part in enumerate(self.content)
                if part.type == "image_url"]


class JsonSchemaFormat(_Body):
    name: str = Field("response", max_length=256)
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


def _refused(name: str, why: str):
    """A validator that refuses a vLLM field when it is set: dropped unseen, it would change the
    output."""
    def check(cls, value):
        if value:
            raise ValueError(why)
        return value
    return field_validator(name)(classmethod(check))


NO_GRAMMAR = "EBNF grammars are not supported: give a JSON schema, a regex or a choice"


class StructuredOutputsFields(_Body):
    """vLLM's `structured_outputs` object: one of these."""
    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = Field(None, max_length=MAX_GRAMMAR_CHARS)
    choice: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=1024)] | None = None
    json_object: bool | None = None
    grammar: Any = None  # refused by name, as structural tags are
    structural_tag: Any = None
    _no_grammar = _refused("grammar", NO_GRAMMAR)
    _no_structural_tag = _refused("structural_tag", "structural tags are not supported: give a JSON schema, a "
                                                    "regex or a choice, or tools")


# a function's name as every tool format here writes it; 128 as Anthropic takes (OpenAI: 64), for MCP names
TOOL_NAME = r"^[A-Za-z0-9_.:-]{1,128}$"


class FunctionDefinition(_Body):
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ChatTool(_Body):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"] = "function"
    function: FunctionName


class TokenFields(_Body):
    """vLLM's sampling fields that bound or bend which tokens are drawn: chat, completions and
    the Responses API take them all."""
    stop_token_ids: Annotated[TokenIds, Field(max_length=256)] | None = None
    include_stop_str_in_output: bool = False
    min_tokens: integer(ge=0) = 0
    skip_special_tokens: bool = True
    logit_bias: Annotated[dict[str, float], Field(max_length=1024)] | None = None
    allowed_token_ids: Annotated[TokenIds, Field(min_length=1, max_length=MAX_ALLOWED_TOKENS)] | None = None
    bad_words: Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_LEN)]],
                         Field(max_length=MAX_STOP)] | None = None
    # refused by name, not ignored: each would change what is written
    use_beam_search: bool = False
    logits_processors: list | None = None
    _no_beam_search = _refused("use_beam_search", "beam search is not supported: ask for n sequences with "
                                                  "logprobs and pick")
    _no_logits_processors = _refused("logits_processors", "custom logits processors are not run: the server "
                                                          "applies only its own sampling fields")


class SamplingFields(TokenFields):
    """Sampling fields shared by chat and completions."""

    model: str | None = None
    n: integer(ge=1, le=128) = 1
    temperature: float | None = Field(None, ge=0, le=100)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: integer(ge=-1) | None = None
    min_p: float | None = Field(None, ge=0, le=1)
    seed: integer(ge=0, lt=2 ** 63) | None = None
    stop: Annotated[str, Field(max_length=MAX_STOP_LEN)] | Annotated[
        list[Annotated[str, Field(max_length=MAX_STOP_LEN)]], Field(max_length=MAX_STOP)] | None = None
    ignore_eos: bool = False
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    prompt_logprobs: integer(ge=0, le=20) | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: str | None = Field(None, min_length=1)
    truncate_prompt_tokens: integer(ge=-1) | None = None  # vLLM's: keep the prompt's last N tokens
    priority: integer(ge=-2 ** 63, lt=2 ** 63) = 0  # --scheduling-policy priority: the lowest first
    # structured output: OpenAI's response_format, vLLM's structured_outputs and guided_* fields
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsFields | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = Field(None, max_length=MAX_GRAMMAR_CHARS)
    guided_choice: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=1024)] | None = None
    guided_grammar: Any = None
    _no_guided_grammar = _refused("guided_grammar", NO_GRAMMAR)
    return_token_ids: bool | None = None  # vLLM's: the prompt's and each choice's token ids too
    return_tokens_as_token_ids: bool | None = None  # vLLM's: logprob entries name tokens "token_id:N"


def _not_both_prompts(cls, data):
    """vLLM's rule: a template cannot both continue the last message and open a new one."""
    if isinstance(data, dict) and data.get("continue_final_message") is True \
            and data.get("add_generation_prompt") is True:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
    return data


class ChatCompletionRequest(SamplingFields):
    _prompts = model_validator(mode="before")(classmethod(_not_both_prompts))
    messages: list[ChatMessage] = Field(min_length=1, max_length=4096)
    max_tokens: integer(ge=1) | None = None
    max_completion_tokens: integer(ge=1) | None = None
    logprobs: bool = False
    top_logprobs: integer(ge=0, le=20) | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: Annotated[list[ChatTool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the template
    documents: Annotated[list[dict[str, str]], Field(max_length=1024)] | None = None  # vLLM's: the template's
    chat_template: str | None = None  # vLLM's per-request template: refused, as vLLM does by default
    _no_request_template = _refused("chat_template", "a chat template sent with a request is not run: start the "
                                                     "server with --chat-template")
    # the template's reasoning_effort (and enable_thinking: false for "none"), as vLLM passes it
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    thinking_token_budget: integer(ge=0) | None = None  # vLLM's: at most this many tokens of thinking


class CompletionRequest(SamplingFields):
    prompt: PromptText | Annotated[list[PromptText], Field(min_length=1, max_length=MAX_PROMPTS)] | PromptIds | \
        Annotated[list[PromptIds], Field(min_length=1, max_length=MAX_PROMPTS)]
    max_tokens: integer(ge=1) | None = 16
    echo: bool = False
    logprobs: integer(ge=0, le=20) | None = None
    suffix: str | None = None
    best_of: integer(ge=1) | None = None

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, best_of, info):
        n = info.data.get("n")
        if best_of is not None and n is not None and best_of != n:  # (n None: n's own error is reported)
            raise ValueError(f"best_of must be at least n ({n})" if best_of < n else
                             f"best_of {best_of} > n {n} is not supported: the server does not rank sequences "
                             "(ask for n and pick)")
        return best_of


class EmbeddingRequest(_Body):
    model: str | None = None
    input: PromptText | Annotated[list[PromptText], Field(min_length=1, max_length=MAX_PROMPTS)] | PromptIds | \
        Annotated[list[PromptIds], Field(min_length=1, max_length=MAX_PROMPTS)]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: integer(ge=1) | None = None
    user: str | None = None
    truncate_prompt_tokens: integer(ge=-1) | None = None


class TokenizeRequest(_Body):
    model_config = ConfigDict(json_schema_extra={"oneOf": [
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"}}}]})

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=4096)] | None = None
    tools: Annotated[list[ChatTool], Field(max_length=128)] | None = None  # rendered with messages
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    _prompts = model_validator(mode="before")(classmethod(_not_both_prompts))

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        return self


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: TokenIds
