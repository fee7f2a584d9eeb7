"""transformers' decode step on the Llama-3.1-8B shape (random bf16 weights, one GPU), as a
peer figure beside benchmarks/bench_8b.py: greedy `generate` from a 1k prompt with a static
cache, which makes transformers compile its decoding forward itself (`CompileConfig(
fullgraph=True, mode="reduce-overhead")`: torch.compile with CUDA graphs); ms per step = the
time difference of two lengths over their step difference (so the prefill cancels), batch
1 and 32. (Compiling `model.forward` by hand instead failed in transformers 5.17: CUDA-graph
outputs overwritten, then a segmentation fault.)

Run: PYTHONPATH=. python3 benchmarks/transformers_8b.py [batch ...]
"""
from __future__ import annotations

import sys
import time

from benchmarks.common import CTX, LONG, SHORT, env_info, prompts, save_json


def main(batches):
    import torch
    import transformers
    res = {"env": env_info(), "torch": torch.__version__, "transformers": transformers.__version__, "rows": {}}
    print(res, flush=True)
    cfg = transformers.LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, rms_norm_eps=1e-5, max_position_embeddings=131072, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192}, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    t0 = time.perf_counter()
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(cfg).eval()
    print(f"weights ready in {time.perf_counter() - t0:.1f}s", flush=True)
    model.generation_config.cache_implementation = "static"
    model.generation_config.compile_config = transformers.CompileConfig(fullgraph=True, mode="reduce-overhead")
    for batch in batches:
        ids = torch.tensor(prompts(batch), device="cuda")

        def run(n):
            torch.cuda.synchronize()
            t = time.perf_counter()
            with torch.no_grad():
                out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
            torch.cuda.synchronize()
            assert out.shape[1] == CTX + n, out.shape
            return time.perf_counter() - t

        t0 = time.perf_counter()
        run(SHORT), run(LONG)  # compiles
        compile_s = time.perf_counter() - t0
        per = min((run(LONG) - run(SHORT)) / (LONG - SHORT) for _ in range(3))
        row = {"batch": batch, "ms_per_step": per * 1e3, "tokens_per_s": batch / per, "warmup_s": compile_s,
               "compiled": hasattr(model, "_compiled_call")}
        res["rows"][f"b{batch}"] = row
        print("transformers decode", row, flush=True)
        save_json("transformers_8b.json", res)
    return res


if __name__ == "__main__":
    main([int(b) for b in sys.argv[1:]] or [1, 32])
