"""FP8 weights: products with an FP8 weight kept in device memory, read as FP8: matmul.py
(Pallas Triton: any GPU, tensor-core and CUDA-core kernels) and mosaic.py (Pallas Mosaic GPU:
Hopper, up to 16 rows; `models.layers.Linear` prefers it where `mosaic.uses_kernel`)."""
