"""LoRA adapters below the model: a PEFT adapter read and checked against its base model (adapter.py), the
adapters an engine knows and keeps in host memory (store.py), the device's slots that every target projection
reads (slots.py), and the update a projection adds for each row's adapter (rows.py). docs/engine.md, "LoRA
adapters", says how a step runs them."""
