"""Request fields that constrain the output to a grammar -> StructuredOutputsParams.

OpenAI's `response_format` (json_object, json_schema), vLLM's `structured_outputs` object and
its older `guided_json` / `guided_regex` / `guided_choice`: at most one of them per request.
The engine's input processor converts the grammar once, as it takes the request: a schema we
cannot enforce is a 400 that names the feature and this field, before anything is queued."""

from __future__ import annotations

from pageserve.app.errors import bad_request
from pageserve.app.protocol import SamplingFields
from pageserve.sampling.params import StructuredOutputsParams


def structured_outputs(body: SamplingFields) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's grammar, and the field it came from (None, None without one)."""
    found: list[tuple[str, dict]] = []
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise bad_request("response_format of type json_schema needs json_schema.schema",
                              "response_format.json_schema")
        found.append(("response_format", {"json": fmt.json_schema.schema_}))
    if body.guided_json is not None:
        found.append(("guided_json", {"json": body.guided_json}))
    if body.guided_regex is not None:
        found.append(("guided_regex", {"regex": body.guided_regex}))
    if body.guided_choice is not None:
        found.append(("guided_choice", {"choice": body.guided_choice}))
    so = body.structured_outputs
    if so is not None:
        fields = {"json": so.json_, "regex": so.regex, "choice": so.choice, "json_object": so.json_object or None}
        found += [(f"structured_outputs.{k}", {k: v}) for k, v in fields.items() if v is not None]
    if not found:
        return None, None
    if len(found) > 1:
        raise bad_request(f"give one way of constraining the output, not several: "
                          f"{', '.join(name for name, _ in found)}", found[1][0])
    name, kwargs = found[0]
    try:
        return StructuredOutputsParams(**kwargs, source=name), name
    except ValueError as e:
        raise bad_request(str(e), name) from None
