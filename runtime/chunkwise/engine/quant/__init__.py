"""Quantized linear weights: the checkpoint formats chunkwise loads (formats.py), the one form it holds them
in (weights.py), and the matmuls over them on CPU and GPU (compute.py)."""
