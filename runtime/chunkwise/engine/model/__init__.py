"""Llama-family models: the architecture (llama.py), built-in presets and the checkpoint loader."""

from __future__ import annotations

from chunkwise.engine.model.llama import LlamaForCausalLM
from chunkwise.engine.model.loader import LoadedModel, load_model, model_config_from_hf
from chunkwise.engine.model.presets import PRESETS

__all__ = ["PRESETS", "LlamaForCausalLM", "LoadedModel", "load_model", "model_config_from_hf"]
