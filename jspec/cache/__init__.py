"""KV caches as pytrees: dense (a region per request) and paged (a shared page pool)."""
from jspec.cache.kv import (AttnMeta, KVCache, PageState, alloc_pages, free_pages, init_kv_cache,
                            init_page_state, make_meta, move_slots, read_kv, write_kv)

__all__ = ["AttnMeta", "KVCache", "PageState", "alloc_pages", "free_pages", "init_kv_cache",
           "init_page_state", "make_meta", "move_slots", "read_kv", "write_kv"]
