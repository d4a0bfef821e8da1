"""What a request names to run under an adapter, as vLLM's LoRARequest."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """An adapter: its name (what a client puts in `model`), an integer id unique among the
    adapters loaded at once (> 0), and its PEFT directory."""
    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self):
        if not self.lora_name:
            raise ValueError("a LoRA adapter needs a name")
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1, got {self.lora_int_id}")

    @property
    def cache_key(self) -> bytes:
        """What the prefix cache's block hashes chain from: no two adapters (and not the base
        model) share KV for the same tokens."""
        return f"{self.lora_int_id}\0{self.lora_name}\0{self.lora_path}".encode()
