"""Anthropic's Messages API request bodies (POST /v1/messages and /v1/messages/count_tokens) as
pydantic models, with the same habits as app/protocol.py: strict types, unknown fields (such as
`cache_control`) ignored, null taken as unset."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Field, model_validator

from pageserve.app.protocol import MAX_STOP, MAX_STOP_LEN, TOOL_NAME, _Body, integer


class TextBlock(_Body):
    type: Literal["text"]
    text: str


class ImageSource(_Body):
    type: Literal["base64", "url"]
    media_type: str | None = None
    data: str | None = None
    url: str | None = None

    @model_validator(mode="after")
    def _fields(self):
        if self.type == "base64" and not (self.data and self.media_type):
            raise ValueError("a base64 image source needs 'media_type' and 'data'")
        if self.type == "url" and not self.url:
            raise ValueError("a url image source needs 'url'")
        return self

    def as_url(self) -> str:
        """A data: URL, or the image's URL (fetched under --allowed-media-domains)."""
        return f"data:{self.media_type};base64,{self.data}" if self.type == "base64" else self.url


class ImageBlock(_Body):
    type: Literal["image"]
    source: ImageSource


class ToolUseBlock(_Body):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Body):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[Union[TextBlock, ImageBlock], Field(discriminator="type")]] = ""
    is_error: bool = False

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(b.text for b in self.content if b.type == "text")

    def images(self) -> list[tuple[int, ImageBlock]]:
        """(index in the content, block) of each image."""
        if isinstance(self.content, str):
            return []
        return [(k, b) for k, b in enumerate(self.content) if b.type == "image"]


class ThinkingBlock(_Body):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Body):
    type: Literal["redacted_thinking"]
    data: str = ""


Block = Annotated[Union[TextBlock, ImageBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock,
                        RedactedThinkingBlock], Field(discriminator="type")]


class MessageParam(_Body):
    role: Literal["user", "assistant"]
    content: str | Annotated[list[Block], Field(max_length=4096)]


class AnthropicTool(_Body):
    type: str | None = None  # "custom" or none: a function the client runs (server tools are refused)
    name: str = Field(pattern=TOOL_NAME)  # as the chat tool it becomes
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _named(self):
        if self.type == "tool" and not self.name:
            raise ValueError("a tool_choice of type 'tool' needs the tool's 'name'")
        return self


class ThinkingConfig(_Body):
    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: integer(ge=0) | None = None


class Conversation(_Body):
    model: str | None = None
    messages: list[MessageParam] = Field(min_length=1, max_length=4096)
    system: str | list[TextBlock] | None = None
    tools: Annotated[list[AnthropicTool], Field(max_length=128)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None

    def system_text(self) -> str | None:
        if self.system is None or isinstance(self.system, str):
            return self.system or None
        return "\n\n".join(b.text for b in self.system) or None


class OutputFormat(_Body):
    type: Literal["json_schema"]
    schema_: dict = Field(alias="schema")


class OutputConfig(_Body):
    format: OutputFormat | None = None  # structured output: the answer's text follows the schema
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # the template's reasoning_effort


class MessagesRequest(Conversation):
    max_tokens: integer(ge=1)
    stop_sequences: Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_LEN)]],
                              Field(max_length=MAX_STOP)] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: integer(ge=1) | None = None
    metadata: dict[str, Any] | None = None
    priority: integer(ge=-2 ** 63, lt=2 ** 63) = 0  # --scheduling-policy priority, as on the other routes
    output_config: OutputConfig | None = None


class CountTokensRequest(Conversation):
    pass
