"""Hugging Face transformers' own continuous batching under the load test of
`python -m jspec bench serve` (jspec/serve/load.py), as a peer to jspec's serving engine.

Requests arrive at the Poisson times of `jspec.serve.load.poisson_arrivals(rate, N, seed)`
(the same arrivals as jspec's load test), prompts in turn from jspec's built-in code prompts
(or --prompts, tokenised as jspec does), each greedy with exactly --max-new-tokens new tokens
(EOS disabled), through one `model.init_continuous_batching(...)` manager holding at most
--max-batch requests in a batch (`ContinuousBatchingConfig.max_requests_per_batch`), its
paged KV cache sized for that many requests (as jspec's engine), CUDA graphs on (transformers
leaves them off with sdpa, about 5x slower on the bundled target). Per rate, as
`run_serve_bench`: tokens/s (generated tokens over the time from the start of the arrivals
to the last finish), time to first token and time per output token after the first (from
transformers' per-token timestamps of streamed requests), end-to-end latency; p50 / p99,
printed with `format_load_table`. The manager is warmed up first (CUDA graphs captured, then
--max-batch requests served), that time in the "compile s" column. Tested with transformers
5.17 and 5.24.

Run: PYTHONPATH=. python3 benchmarks/serve_transformers.py --target DIR [--rates 2 8 32]
(`--random-weights --prompt-tokens N`: a config's shape with random weights and random
prompts of N tokens, as jspec's 8B-shape benchmarks; a huge rate submits them at once)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import time

import numpy as np

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # jspec's imports bring JAX: keep it off the GPU
from jspec.bench import BUILTIN_PROMPTS, read_prompts
from jspec.serve.load import LoadRow, format_load_table, percentiles, poisson_arrivals


def load(args):
    """-> (model, its continuous batching manager, token id prompts)."""
    import torch
    import transformers
    try:
        from transformers import ContinuousBatchingConfig
        from transformers.generation import GenerationMixin
        assert hasattr(GenerationMixin, "init_continuous_batching")
    except (ImportError, AssertionError):
        raise SystemExit(f"transformers {transformers.__version__} lacks the continuous batching API used here "
                         "(ContinuousBatchingConfig, model.init_continuous_batching); use transformers 5.17 to 5.24")
    dtype = getattr(torch, args.dtype)
    if args.prompt_tokens:  # random ids, as jspec's benchmarks of random weights
        config = transformers.AutoConfig.from_pretrained(args.target)
        rng = np.random.default_rng(args.seed)
        prompts = [rng.integers(1, config.vocab_size, args.prompt_tokens).tolist() for _ in range(args.requests)]
    else:
        tok = transformers.AutoTokenizer.from_pretrained(args.target)
        texts = read_prompts(args.prompts) if args.prompts else list(BUILTIN_PROMPTS)
        prompts = [list(tok(p)["input_ids"]) for p in texts]  # as jspec tokenises a string prompt
    if args.random_weights:  # the config's shape, weights made on the device (nothing read)
        config = transformers.AutoConfig.from_pretrained(args.target, attn_implementation=args.attn)
        with torch.device(args.device):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            args.target, dtype=dtype, attn_implementation=args.attn).to(args.device).eval()
    if not hasattr(model, "init_continuous_batching"):
        raise SystemExit(f"{type(model).__name__} has no init_continuous_batching")
    # The KV cache sized for --max-batch requests (as jspec's engine), not from free memory (transformers'
    # default, which with sdpa makes its warm-up run out of GPU memory); the safety margin then unneeded
    cb = ContinuousBatchingConfig(max_requests_per_batch=args.max_batch, num_blocks=args.num_blocks,
                                  max_batch_tokens=args.max_batch_tokens, safety_margin=0.0,
                                  use_cuda_graph=None if args.device == "cpu" else  # cpu: always off
                                  {"auto": None, "on": True, "off": False}[args.cuda_graphs])
    page = getattr(cb, "page_size", None) or cb.block_size  # 5.17: block_size; 5.24: page_size
    longest = max(map(len, prompts))
    cb.num_blocks = cb.num_blocks or args.max_batch * (-(-(longest + args.max_new_tokens) // page) + 1)
    cb.max_batch_tokens = cb.max_batch_tokens or max(args.max_batch * longest, 256)
    # EOS -1: no stop token, every request runs to max_new_tokens (as jspec's stop_token_ids=[])
    gen = transformers.GenerationConfig(do_sample=False, max_new_tokens=args.max_new_tokens, eos_token_id=-1)
    return model, model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb), prompts


def serve(manager, prompts, arrivals, max_new_tokens, tag):
    """Submits prompts (in turn) at `arrivals` (seconds from now), streamed, and waits for
    all -> (start time, per request: submitted, first token and finish times, tokens)."""
    n, submitted, first_seen, done = len(arrivals), [], {}, {}
    t0 = time.perf_counter()
    while len(done) < n:
        while len(submitted) < n and time.perf_counter() >= t0 + arrivals[len(submitted)]:
            i = len(submitted)
            submitted.append(time.perf_counter())
            manager.add_request(prompts[i % len(prompts)], request_id=f"{tag}-{i}", max_new_tokens=max_new_tokens,
                                streaming=True, record_timestamps=True, eos_token_id=-1)
        wait = t0 + arrivals[len(submitted)] - time.perf_counter() if len(submitted) < n else 1.0
        res = manager.get_result(timeout=max(wait, 1e-4))
        now = time.perf_counter()
        if res is None:
            if not manager.is_running():
                raise RuntimeError("transformers' continuous batching thread stopped")
            continue
        if res.error is not None:
            raise RuntimeError(f"request {res.request_id} failed: {res.error}")
        if res.generated_tokens:
            first_seen.setdefault(res.request_id, now)
        if res.is_finished():
            # transformers' per-token timestamps (perf_counter when each token was made), else arrival here
            ts = res.timestamps or [first_seen.get(res.request_id, now), now]
            done[res.request_id] = {"first": ts[0], "finished": ts[-1], "tokens": len(res.generated_tokens)}
    return t0, [dict(done[f"{tag}-{i}"], submitted=submitted[i]) for i in range(n)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, help="a Hugging Face causal-LM directory (with its tokenizer)")
    ap.add_argument("--rates", type=float, nargs="+", default=[2.0, 8.0, 32.0],
                    help="arrival rates, requests a second (default: 2 8 32, as jspec bench serve)")
    ap.add_argument("--requests", type=int, default=32, help="requests a rate (default: 32)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--max-batch", type=int, default=8, help="requests in a batch at most (default: 8)")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--attn", default="sdpa", help="attn_implementation to load with (default: sdpa; "
                                                   "continuous batching may switch it to a paged or flash one)")
    ap.add_argument("--num-blocks", type=int, default=None, help="KV cache blocks (default: enough for "
                    "--max-batch requests)")
    ap.add_argument("--max-batch-tokens", type=int, default=None, help="tokens in a forward pass at most (default: "
                    "--max-batch whole prompts, at least 256)")
    ap.add_argument("--cuda-graphs", choices=["auto", "on", "off"], default="on", help="transformers' CUDA "
                    "graphs on cuda (default: on; auto: transformers' choice, off where attention needs a mask, "
                    "as sdpa does)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the arrival times")
    ap.add_argument("--prompts", default=None, metavar="FILE", help="one prompt per line (default: jspec's "
                                                                    "built-in code prompts)")
    ap.add_argument("--random-weights", action="store_true", help="the --target config's shape with random weights "
                                                                    "made on the device (the directory needs only "
                                                                    "config.json)")
    ap.add_argument("--prompt-tokens", type=int, default=0, metavar="N",
                    help="random token-id prompts of N tokens, one a request (default: text prompts)")
    ap.add_argument("--out", default=None, metavar="FILE.json")
    args = ap.parse_args()
    if min(args.rates) <= 0 or min(args.requests, args.max_new_tokens, args.max_batch) < 1:
        ap.error("rates must be > 0; --requests, --max-new-tokens and --max-batch at least 1")

    import torch
    import transformers
    torch.set_grad_enabled(False)
    model, manager, prompts = load(args)

    t = time.perf_counter()
    manager.warmup()  # builds the cache, captures CUDA graphs where used
    manager.start()
    try:
        serve(manager, prompts, [0.0] * args.max_batch, args.max_new_tokens, "warmup")
        warmup_s = time.perf_counter() - t
        rows, short = [], []
        for k, rate in enumerate(args.rates):
            t0, reqs = serve(manager, prompts, poisson_arrivals(rate, args.requests, args.seed),
                             args.max_new_tokens, f"rate{k}")
            short += [(rate, i, r["tokens"]) for i, r in enumerate(reqs) if r["tokens"] != args.max_new_tokens]
            rows.append(LoadRow(
                setting="transformers CB", rate=rate, requests=args.requests,
                tokens_per_s=sum(r["tokens"] for r in reqs) / (max(r["finished"] for r in reqs) - t0),
                ttft_ms=percentiles([r["first"] - r["submitted"] for r in reqs]),
                tpot_ms=percentiles([(r["finished"] - r["first"]) / max(r["tokens"] - 1, 1) for r in reqs]),
                e2e_ms=percentiles([r["finished"] - r["submitted"] for r in reqs]), tau=1.0, compile_s=warmup_s))
        attn = model.config._attn_implementation  # the one continuous batching ran with
    finally:
        manager.stop(block=True)

    dev = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu"
    print(f"target {args.target}, transformers {transformers.__version__} continuous batching ({attn}), "
          f"torch {torch.__version__}, {args.dtype}; {dev}; {args.requests} requests a rate, {args.max_new_tokens} "
          f"new tokens each, greedy; batch {args.max_batch}; warm-up {warmup_s:.1f} s")
    print(format_load_table(rows))
    for rate, i, n in short:
        print(f"WARNING: rate {rate:g} request {i} generated {n} tokens, not {args.max_new_tokens}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "transformers": transformers.__version__, "torch": torch.__version__,
                       "device": dev, "attn_implementation": attn, "warmup_s": warmup_s,
                       "short_requests": short, "rows": [dataclasses.asdict(r) for r in rows]}, f, indent=1)
    return 1 if short else 0


if __name__ == "__main__":
    raise SystemExit(main())
