"""The engine's bottom layer: the types every layer above passes around (Request, SamplingParams, the
outputs, the config dataclasses and the structured-output spec). Free of torch, so the router and the
operator-side tools can import them."""
