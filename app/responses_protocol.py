"""The Responses API's request body (POST /v1/responses) as pydantic models, with the same
habits as app/protocol.py: strict types, unknown fields ignored. Input items and content parts of
a type it does not take are named in the error."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, field_validator, model_validator

from pageserve.app.protocol import MAX_STOP, MAX_STOP_LEN, TOOL_NAME, PromptText, TokenFields, _Body, integer

_TEXT_FORMAT = "is chat's and completions' field: the Responses API takes the output's format as text.format"


def _only(kind: str, allowed: tuple[str, ...]):
    """A before-validator that names an unsupported `type` instead of listing every union member."""
    def check(cls, data):
        if isinstance(data, dict) and data.get("type", allowed[0]) not in allowed:
            raise ValueError(f"{kind} of type {data.get('type')!r} are not supported "
                             f"(only {', '.join(repr(a) for a in allowed)})")
        return data
    return model_validator(mode="before")(classmethod(check))


class InputTextPart(_Body):
    type: Literal["input_text", "output_text", "text"]
    text: str
    _check = _only("content parts", ("input_text", "output_text", "text"))


class InputImagePart(_Body):
    type: Literal["input_image"]
    image_url: str = Field(min_length=1)  # a data: URL, or an http(s) URL the server may fetch
    detail: Literal["auto", "low", "high"] | None = None


INPUT_PART_TYPES = ("input_text", "output_text", "text", "input_image")
InputPart = Annotated[InputTextPart | InputImagePart, Field(discriminator="type")]


def _known_parts(parts):
    if isinstance(parts, list):
        for part in parts:
            if isinstance(part, dict) and part.get("type") not in INPUT_PART_TYPES:
                raise ValueError(f"content parts of type {part.get('type')!r} are not supported "
                                 f"(only {', '.join(repr(t) for t in INPUT_PART_TYPES)})")
    return parts


class ReasoningText(_Body):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class MessageItem(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputPart]
    id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _parts(cls, value):
        return _known_parts(value)


class FunctionCallItem(_Body):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=256)
    name: str
    arguments: str = ""
    id: str | None = None


class FunctionCallOutputItem(_Body):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=256)
    output: str | list[InputTextPart]
    id: str | None = None


class ReasoningItem(_Body):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningText] = []
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None


class ItemReference(_Body):
    type: Literal["item_reference"]
    id: str


INPUT_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning", "item_reference")
InputItem = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem | ItemReference,
                      Field(discriminator="type")]


def _typed_items(items):
    """A message item may leave out its `type` (OpenAI's EasyInputMessage); other types are named."""
    if not isinstance(items, list):
        return items
    out = []
    for i, item in enumerate(items):
        if isinstance(item, dict):
            kind = item.get("type", "message" if "role" in item else None)
            if kind not in INPUT_ITEM_TYPES:
                raise ValueError(f"items of type {kind!r} (item {i}) are not supported "
                                 f"(only {', '.join(INPUT_ITEM_TYPES)})")
            item = {**item, "type": kind}
        out.append(item)
    return out


class ResponsesFunctionTool(_Body):
    type: Literal["function"]
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None
    _check = _only("tools", ("function",))


class ResponsesNamedTool(_Body):
    type: Literal["function"]
    name: str


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str = Field("response", max_length=256)
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(_Body):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(_Body):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


IncludeValue = Literal["message.output_text.logprobs", "reasoning.encrypted_content", "message.input_image.image_url",
                       "web_search_call.action.sources", "web_search_call.results", "code_interpreter_call.outputs",
                       "computer_call_output.output.image_url", "file_search_call.results"]  # OpenAI's


def _chat_format(value, name: str):
    if value is not None:
        raise ValueError(f"{name} {_TEXT_FORMAT}")
    return value


class ResponsesRequest(TokenFields):
    """OpenAI's Responses API request; the sampling fields vLLM accepts beyond OpenAI's too."""

    model: str | None = None
    input: PromptText | Annotated[list[InputItem], Field(min_length=1, max_length=4096),
                                  BeforeValidator(_typed_items)]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: integer(ge=1) | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_logprobs: integer(ge=0, le=20) | None = None
    include: Annotated[list[IncludeValue], Field(max_length=16)] | None = None  # logprobs served, the rest ignored
    tools: Annotated[list[ResponsesFunctionTool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesNamedTool | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    metadata: Annotated[dict[str, Annotated[str, Field(max_length=512)]], Field(max_length=16)] | None = None
    user: str | None = None
    store: bool = True
    stream: bool = False
    background: bool = False
    truncation: Literal["disabled", "auto"] = "disabled"
    # vLLM's extras
    top_k: integer(ge=-1) | None = None
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    seed: integer(ge=0, lt=2 ** 63) | None = None
    stop: Annotated[str, Field(max_length=MAX_STOP_LEN)] | Annotated[
        list[Annotated[str, Field(max_length=MAX_STOP_LEN)]], Field(max_length=MAX_STOP)] | None = None
    ignore_eos: bool = False
    cache_salt: str | None = Field(None, min_length=1)
    priority: integer(ge=-2 ** 63, lt=2 ** 63) = 0
    chat_template_kwargs: dict[str, Any] | None = None
    # chat's and completions' ways to constrain the output: refused by name, not dropped unseen
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    _no_chat_formats = field_validator(
        "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")(
        classmethod(lambda cls, value, info: _chat_format(value, info.field_name)))
