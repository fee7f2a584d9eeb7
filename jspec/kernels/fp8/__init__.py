"""FP8 weights: matmul.py (products with an FP8 weight kept in device memory, read as FP8)."""
