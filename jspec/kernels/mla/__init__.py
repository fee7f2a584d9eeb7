"""Multi-head latent attention (DeepSeek): attention.py (the dispatch) over decode.py (the
attention kernel), output.py (the merge and W_UV), inputs.py (query absorption, RoPE and the
cache row), prefill.py (a prompt block's attention in the non-absorbed form) and sparse.py
(DeepSeek-V3.2's sparse attention)."""
