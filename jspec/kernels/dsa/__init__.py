"""DeepSeek sparse attention (V3.2): index.py (the indexer's scores), topk.py (the top-k selection)."""
