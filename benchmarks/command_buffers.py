"""Do XLA's CUDA-graph command buffers change what the loop computes? Tiny random Llama and
DeepSeek targets (float32), dense and paged (16) caches, four unequal prompts, 24 greedy
tokens through `Compiled.run` and through an `Engine`, with no XLA options, with the
family's own (`TargetFamily.gpu_xla_options`) and with command buffers over the while
loop and its conditionals (`WHILE`, `CONDITIONAL`); prints whether each equals the run
without options, and the token counts and finish reasons.

    PYTHONPATH=. python3 benchmarks/command_buffers.py
"""
from __future__ import annotations

import numpy as np

import jspec
from benchmarks import common
from benchmarks.dsa import TINY as DEEPSEEK_TINY
from benchmarks.serve_engine import TINY as LLAMA_TINY

LOOP_GRAPHS = (("xla_gpu_enable_command_buffer", "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"),)
SETTINGS = {"none": jspec.Tuning(family_xla_options=False), "family": jspec.Tuning(),
            "loop_graphs": jspec.Tuning(family_xla_options=False, xla_options=LOOP_GRAPHS)}


def outputs(params, prompts, cache, tuning, new: int = 24) -> dict:
    run = jspec.compile(params, prompts, max_new_tokens=new, stop_token_ids=[], cache=cache, tuning=tuning).run()
    engine = jspec.Engine(params, max_batch=len(prompts), max_prompt_len=64, max_new_tokens=new, cache=cache,
                          tuning=tuning)
    hs = [engine.submit(p, max_new_tokens=new, stop_token_ids=[]) for p in prompts]
    while engine.step():
        pass
    return {"run": [list(map(int, t)) for t in run.tokens], "engine": [list(h.result().tokens) for h in hs],
            "engine_reasons": [h.result().finish_reason for h in hs]}


def main():
    prompts = [[int(t) for t in np.random.default_rng(i).integers(1, 200, 16 + 5 * i)] for i in range(4)]
    for name, cfg in (("llama", LLAMA_TINY), ("deepseek", DEEPSEEK_TINY.replace(num_layers=2, index_topk=0))):
        params = common.random_params(cfg)
        for cache in (jspec.CacheConfig("dense"), jspec.CacheConfig("paged", page_size=16)):
            outs = {label: outputs(params, prompts, cache, tuning) for label, tuning in SETTINGS.items()}
            ref = outs["none"]
            for label, o in outs.items():
                print(f"{name} {cache.kind} {label}: run equal {o['run'] == ref['run']}, engine equal "
                      f"{o['engine'] == ref['run']}, run lengths {[len(t) for t in o['run']]}, engine reasons "
                      f"{o['engine_reasons']}", flush=True)


if __name__ == "__main__":
    main()
