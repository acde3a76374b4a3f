"""Turning logits into tokens: the batched per-row sampler (sampler.py) and structured outputs' matchers and
token masks (structured/)."""
