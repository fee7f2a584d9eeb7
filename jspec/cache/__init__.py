"""Caches: slot layouts shared by every kind (`layout`), and the cache kinds (`kv`: GQA keys
and values; `latent`: the MLA latent). A cache kind allocates its buffers for a layout,
says what room a forward needs past its tokens, and commits a round's accepted path
(every round; nothing moves for a chain)."""
from jspec.cache.kv import KVCache, KVCacheKind
from jspec.cache.layout import CacheLayout, PageState
from jspec.kernels.meta import AttnMeta

__all__ = ["AttnMeta", "CacheLayout", "KVCache", "KVCacheKind", "PageState"]
