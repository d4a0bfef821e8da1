"""LoRA adapters served beside one base model (--enable-lora): PEFT's format read into our
fused projections (adapter.py), fixed device slots beside the base weights (slots.py), and the
manager that keeps adapters in host memory and in slots and maps each step's tokens to their
slot (manager.py), and the engine's record of the adapters its live requests need, held in
host memory until they end (pins.py). The kernels add each token's adapter delta after the base matmul
(Kernels.linear)."""

from pageserve.runtime.lora.adapter import LoRAAdapter, LoRAError, load_adapter
from pageserve.runtime.lora.request import LoRARequest

__all__ = ["LoRAAdapter", "LoRAError", "LoRARequest", "load_adapter"]
