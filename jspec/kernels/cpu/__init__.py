"""Native CPU kernels: matmul.py (few-row float32 products, matmul.cc through the JAX FFI)."""
