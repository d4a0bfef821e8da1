"""LoRA adapters as clients see them: names a request's `model` may give beside the served
model's, listed by /v1/models with the base model as their parent. Loaded at start-up
(--lora-modules) and, where the operator allows it (--allow-runtime-lora-updating, or vLLM's
VLLM_ALLOW_RUNTIME_LORA_UPDATING), at run time through /v1/load_lora_adapter and
/v1/unload_lora_adapter, as vLLM serves them."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
from dataclasses import dataclass

from pydantic import BaseModel, Field
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from pageserve.app.errors import APIError, bad_request
from pageserve.app.http import api_route, read_json
from pageserve.runtime.lora import LoRAError, LoRARequest

RUNTIME_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None


@dataclass(frozen=True, slots=True)
class LoRAModule:
    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_modules(values: list[str] | None) -> tuple[LoRAModule, ...]:
    """--lora-modules: each `name=path`, or a JSON object {"name", "path", "base_model_name"}."""
    modules = []
    for value in values or []:
        value = value.strip()
        if value.startswith("{"):
            try:
                obj = json.loads(value)
                modules.append(LoRAModule(str(obj["name"]), str(obj["path"]), obj.get("base_model_name")))
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"--lora-modules: {value!r} is not a JSON object with name and path") from None
        else:
            name, sep, path = value.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules: {value!r} is not name=path")
            modules.append(LoRAModule(name, path))
    return tuple(modules)


def runtime_updating_allowed(flag: bool) -> bool:
    return flag or os.environ.get(RUNTIME_UPDATING_ENV, "").strip().lower() in ("1", "true", "yes")


class Adapters:
    """The adapters served, by name; each gets the next integer id when it is loaded, so that
    an adapter loaded again under the same name never meets the old one's cached KV."""

    def __init__(self, engine, base_names: tuple[str, ...]):
        self.engine, self.base_names = engine, base_names
        self._by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def get(self, name: str | None) -> LoRARequest | None:
        return self._by_name.get(name) if name else None

    def __iter__(self):
        return iter(list(self._by_name.values()))

    def _new(self, name: str, path: str, base_model_name: str | None) -> LoRARequest:
        if not self.engine.lora_enabled:
            raise bad_request("LoRA adapters are off: the server was started without --enable-lora", "lora_name")
        if name in self.base_names or name in self._by_name:
            raise bad_request(f"The lora adapter '{name}' has already been loaded.", "lora_name")
        if base_model_name is not None and base_model_name not in self.base_names:
            raise bad_request(f"the base model {base_model_name!r} is not served here", "base_model_name")
        return LoRARequest(name, next(self._ids), path, base_model_name)

    def load_at_start(self, module: LoRAModule) -> None:
        """--lora-modules: read now; any error stops the start-up with its message."""
        try:
            lora = self._new(module.name, module.path, module.base_model_name)
        except APIError as e:
            raise ValueError(f"--lora-modules {module.name}: {e.message}") from None
        self.engine.add_lora(lora).result()
        self._by_name[lora.lora_name] = lora

    async def load(self, name: str, path: str) -> None:
        lora = self._new(name, path, None)
        try:
            await asyncio.wrap_future(self.engine.add_lora(lora))
        except LoRAError as e:
            raise bad_request(str(e), "lora_path") from None
        if name in self._by_name:  # loaded by another request meanwhile: this copy goes
            await asyncio.wrap_future(self.engine.remove_lora(lora.lora_int_id))
            raise bad_request(f"The lora adapter '{name}' has already been loaded.", "lora_name")
        self._by_name[name] = lora

    async def unload(self, name: str) -> None:
        lora = self._by_name.pop(name, None)
        if lora is None:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", "lora_name", "model_not_found")
        await asyncio.wrap_future(self.engine.remove_lora(lora.lora_int_id))


@api_route
async def load_lora_adapter(request: Request) -> Response:
    state = request.app.state.server
    body = await read_json(request, LoadLoRAAdapterRequest, state.settings.max_request_body_bytes)
    await state.adapters.load(body.lora_name, body.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@api_route
async def unload_lora_adapter(request: Request) -> Response:
    state = request.app.state.server
    body = await read_json(request, UnloadLoRAAdapterRequest, state.settings.max_request_body_bytes)
    await state.adapters.unload(body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
