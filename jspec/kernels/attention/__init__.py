"""GQA attention over the KV cache: decode.py (the flash-decoding kernel and the reference),
gqa.py (the dispatch between them and the row-invariant kernel)."""
