"""A request's LoRA adapter, by vLLM's name and fields, so that code written against vLLM's offline API and
its servers' clients runs unchanged."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """One fine-tune of the base model: a PEFT adapter directory (adapter_config.json and
    adapter_model.safetensors). `lora_name` identifies it everywhere (the API's model name, the prefix cache's
    key, the metrics' label); `lora_int_id` is vLLM's positive integer id, kept for its callers."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("LoRARequest.lora_name is empty")
        if self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id must be a positive integer, got {self.lora_int_id}")
        if not self.lora_path:
            raise ValueError("LoRARequest.lora_path is empty")
