"""Gated DeltaNet (Qwen3-Next, Qwen3.5): reference.py (the pure-jnp references), kernels.py
(the Pallas kernels and their dispatch)."""
