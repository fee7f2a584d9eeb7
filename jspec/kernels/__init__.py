"""Kernels, each beside its pure-jnp reference and its tile dataclass, grouped by operation:
attention/ (GQA), mla/, moe/, dsa/, gated_delta/, row/ (row-invariant) and cpu/; one
dispatch point per operation. Shared: dispatch.py (kernel or reference), tiling.py and
meta.py (what a kernel reads of a cache). Kernels import no cache, model or loop.
"""
