"""DeepSeek benchmarks with random bf16 weights (one GPU): MLA + MoE decoding, MTP rounds,
the V3 layer shape, and settings compared side by side.

Parts (arguments; default: decode mtp v3layer):
- decode: the DeepSeek-V2-Lite shape (27 layers, 15.7B parameters), context 1k, ms/token
  at each of --batches, and bandwidth utilisation = bytes a step must read / step time /
  copy bandwidth. Bytes: every weight but the embedding table and the routed experts,
  plus the routed experts the batch's tokens were sent to (their expected number of
  distinct experts under uniform routing, which random weights give:
  E * (1 - (1 - k/E)^B) per MoE layer), plus the latent cache.
- mtp: a random MTP layer of the same shape as the draft; the --rounds (S x K x N) at
  batch 1 as ratios to one AR step (measured first), with the routed experts a verify of
  N tokens reads (expected distinct experts per MoE layer for N tokens).
- v3layer: the DeepSeek-V3 layer shape (hidden 7168, 128 heads, q_lora 1536, 256 experts,
  top-8, expert width 2048) as models of --v3-layers MoE layers (default 1 and 3, or 1
  and 2 where the GPU holds less than 100 GB: a V3 MoE layer is 22.5 GB of experts); per
  layer: the two models' step difference over their layer difference, at --batch, and its
  bandwidth utilisation (the routed experts: their expected distinct number for the batch).
- ab: V2-Lite with --layers layers at --batch: ms a step from two run lengths'
  difference, a 16-token run's time (median of 5) and what of it is not its steps (inputs,
  prefill, outputs), and whether the tokens equal the first tuning's.

--tunings a,b,...: every part under each of these `common.TUNINGS` settings (`jspec.Tuning`
objects passed to `jspec.compile`), side by side on the same weights; repeat a name to
alternate. Rows of a tuning other than default are keyed `<row>_<tuning>`.

Run: PYTHONPATH=. python3 benchmarks/deepseek.py [decode] [mtp] [v3layer] [ab] [--batches 1,32]
     [--rounds 1x1x2,2x1x3,3x1x4,3x2x4] [--batch 1] [--layers 6] [--v3-layers 1,3] [--tunings default,...]
e.g. `deepseek.py ab --layers 27 --tunings graphs_off,default,graphs_off,default`;
     `deepseek.py v3layer --batch 32 --tunings default,few_pairs_ragged`.
Result: $OUT/deepseek.json (JSPEC_BENCH_TAG: deepseek_<tag>.json)
"""
from __future__ import annotations

import argparse
import os
import time

import jax

import jspec
from benchmarks.common import (CTX, V2_LITE, V3_LAYER, Runner, ceiling_of, copy_bandwidth, device_memory, env_info,
                               prompts, random_params, rounded, save_json, tagged, tunings)
from jspec.drafts import MtpDraft
from jspec.drafts.mtp import layer_config
from jspec.models.deepseek_hf import DeepseekConfig

SHORT, LONG = 16, 112
PARTS = ("decode", "mtp", "v3layer", "ab")


def expert_bytes(c: DeepseekConfig) -> int:
    return 3 * c.hidden_size * c.moe_intermediate_size * 2


def distinct_experts(c: DeepseekConfig, tokens: int) -> float:
    """Expected distinct experts of one MoE layer when `tokens` tokens each pick k of E uniformly."""
    E, k = c.n_routed_experts, c.num_experts_per_tok
    return E * (1 - (1 - k / E) ** tokens)


def fixed_bytes(params) -> int:
    """Weights every step reads: all but the embedding table and the routed experts."""
    w = params.weights["params"]
    total = sum(x.nbytes for x in jax.tree.leaves(w)) - w["embed_tokens"]["embedding"].nbytes
    return total - sum(x.nbytes for path, x in jax.tree_util.tree_leaves_with_path(w)
                       if any(getattr(p, "key", None) == "experts" for p in path))


def step_bytes(params, tokens: int, batch: int, ctx: float) -> float:
    c = params.config
    moe_layers = sum(c.is_moe(i) for i in range(c.num_layers))
    latent = batch * ctx * (c.kv_lora_rank + c.qk_rope_head_dim) * 2 * c.num_layers
    return fixed_bytes(params) + moe_layers * distinct_experts(c, tokens) * expert_bytes(c) + latent


class Bench:
    def __init__(self, args, name: str):
        self.args, self.name = args, name
        self.tunings = tunings(args.tunings)
        self.seen: dict = {}
        self.res = {"env": env_info(), "kernels": os.environ.get("JSPEC_KERNELS", "auto"), "tunings": args.tunings}
        print(self.res["env"], flush=True)
        bw = copy_bandwidth()
        self.res["copy_bandwidth"] = bw
        self.ceiling = ceiling_of(bw)
        print("copy bandwidth TB/s", {k: round(v / 1e12, 3) for k, v in bw.items() if isinstance(v, float)},
              flush=True)

    def log(self, key: str, tname: str, row: dict, what: str):
        self.res[tagged(key, tname, self.seen)] = row
        print(what, tname, rounded(row), flush=True)
        save_json(self.name, self.res)

    def decode_and_mtp(self, parts):
        t0 = time.perf_counter()
        target = random_params(V2_LITE)
        n = sum(x.size for x in jax.tree.leaves(target.weights))
        print(f"V2-Lite shape ready in {time.perf_counter() - t0:.1f}s: {n / 1e9:.2f}B parameters", flush=True)
        self.res["v2lite_parameters"] = n
        batches = [int(b) for b in self.args.batches.split(",")] if "decode" in parts else [1]
        spec_params = None
        if "mtp" in parts:
            draft = MtpDraft(layer_config(V2_LITE))
            dw = jax.jit(lambda k: draft.init(k, V2_LITE.vocab_size))(jax.random.key(1))
            spec_params = target.with_draft(jspec.DraftParams(draft, dw))
        first: dict = {}
        for tname, tuning in self.tunings:
            ar = {}
            for batch in batches:
                r = Runner(target, prompts(batch, V2_LITE.vocab_size), LONG, tuning=tuning)
                per, _, _ = r.per_round(SHORT, LONG, reps=2)
                tokens = r.run(SHORT)[1].tokens
                first.setdefault(("decode", batch), tokens)
                ctx = CTX + (SHORT + LONG) / 2
                nbytes = step_bytes(target, batch, batch, ctx)
                ar[batch] = per
                self.log(f"v2lite_decode_b{batch}", tname, {
                    "batch": batch, "ms_per_step": per * 1e3, "ms_per_token": per * 1e3 / batch,
                    "tokens_per_s": batch / per, "GB_read_per_step": nbytes / 1e9,
                    "bandwidth_util": nbytes / per / self.ceiling, "compile_s": r.compile_s,
                    "same_tokens_as_first_tuning": tokens == first["decode", batch]}, "decode")
                del r
            if spec_params is None:
                continue
            moe_layers = V2_LITE.num_layers - V2_LITE.first_k_dense_replace
            for S, K, N in (tuple(int(v) for v in s.split("x")) for s in self.args.rounds.split(",")):
                r = Runner(spec_params, prompts(1, V2_LITE.vocab_size), LONG,
                           spec=jspec.SpecConfig(num_steps=S, topk=K, num_draft_tokens=N), tuning=tuning)
                per, _, _ = r.per_round(SHORT, LONG, reps=2)
                tokens = r.run(LONG)[1].tokens
                first.setdefault(("mtp", S, K, N), tokens)
                self.log(f"v2lite_mtp_S{S}_K{K}_N{N}", tname, {
                    "S": S, "K": K, "N": N, "ms_per_round": per * 1e3, "ratio_to_ar_step": per / ar[1],
                    "verify_experts_per_layer": distinct_experts(V2_LITE, N),
                    "verify_expert_GB": moe_layers * distinct_experts(V2_LITE, N) * expert_bytes(V2_LITE) / 1e9,
                    "draft_expert_GB_per_step": distinct_experts(V2_LITE, K) * expert_bytes(V2_LITE) / 1e9,
                    "compile_s": r.compile_s, "same_tokens_as_first_tuning": tokens == first["mtp", S, K, N]},
                    "mtp round")
                del r
        del target, spec_params

    def v3_layers(self):
        """Per-layer decode time of the V3 layer shape under each tuning, same weights."""
        batch = self.args.batch
        lo, hi = self.args.v3_layers or ((1, 3) if device_memory() >= 100e9 else (1, 2))
        self.res["v3_layers"] = [lo, hi]
        tag = "" if batch == 1 else f"_b{batch}"
        times = {}
        for layers in (lo, hi):
            cfg = V3_LAYER.replace(num_layers=layers)
            target = random_params(cfg)
            for i, (tname, tuning) in enumerate(self.tunings):
                r = Runner(target, prompts(batch, cfg.vocab_size), LONG, tuning=tuning)
                per, _, _ = r.per_round(SHORT, LONG, reps=2)
                times[i, layers] = per
                print(f"V3 shape, {layers} layers, batch {batch}, {tname}: {per * 1e3:.3f} ms/step", flush=True)
                del r
            w = target.weights["params"]["layers_0"]
            attn = sum(x.nbytes for x in jax.tree.leaves(w["self_attn"]))
            shared = sum(x.nbytes for x in jax.tree.leaves(w["mlp"]["shared_experts"]))
            router = sum(x.nbytes for x in jax.tree.leaves(w["mlp"]["router"]))
            latent = batch * (CTX + (SHORT + LONG) / 2) * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 2
            nbytes = attn + shared + router + distinct_experts(cfg, batch) * expert_bytes(cfg) + latent
            del target, w
        for i, (tname, _) in enumerate(self.tunings):
            per_layer = (times[i, hi] - times[i, lo]) / (hi - lo)
            self.log(f"v3_layer_decode{tag}", tname, {
                "batch": batch, "layers": [lo, hi], "ms_per_step": [times[i, lo] * 1e3, times[i, hi] * 1e3],
                "ms_per_layer": per_layer * 1e3, "GB_per_layer": nbytes / 1e9,
                "bandwidth_util": nbytes / per_layer / self.ceiling}, "v3 layer")

    def ab(self):
        """V2-Lite with --layers layers under each tuning on the same weights."""
        layers, batch = self.args.layers, self.args.batch
        cfg = V2_LITE.replace(num_layers=layers)
        target = random_params(cfg)
        tokens = None
        for tname, tuning in self.tunings:
            r = Runner(target, prompts(batch, cfg.vocab_size), LONG, tuning=tuning)
            per = r.per_round(SHORT, LONG, reps=3)[0]
            runs = sorted(r.run(SHORT)[0] for _ in range(5))
            out = r.run(SHORT)[1].tokens
            tokens = tokens or out
            fixed = runs[2] - SHORT * per  # a run's time beside its steps (inputs, prefill, outputs)
            self.log(f"ab_{layers}l_b{batch}", tname, {
                "layers": layers, "batch": batch, "ms_per_step": per * 1e3, "same_tokens": out == tokens,
                "ms_16_token_runs": [round(t * 1e3, 2) for t in runs], "ms_fixed_per_run": fixed * 1e3}, "ab")
            del r
        del target


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("parts", nargs="*", help=f"of {', '.join(PARTS)} (default: decode mtp v3layer)")
    ap.add_argument("--tunings", default="default", help="comma-separated common.TUNINGS names")
    ap.add_argument("--batches", default="1,32", help="decode's batches")
    ap.add_argument("--rounds", default="1x1x2,2x1x3,3x1x4,3x2x4", help="mtp's rounds, SxKxN")
    ap.add_argument("--batch", type=int, default=1, help="v3layer's and ab's batch")
    ap.add_argument("--layers", type=int, default=6, help="ab's V2-Lite layers")
    ap.add_argument("--v3-layers", type=lambda v: tuple(int(x) for x in v.split(",")), default=None,
                    help="v3layer's two layer counts, lo,hi")
    args = ap.parse_args()
    parts = set(args.parts) or {"decode", "mtp", "v3layer"}
    if parts - set(PARTS):
        ap.error(f"unknown parts {sorted(parts - set(PARTS))}; parts: {', '.join(PARTS)}")
    tag = os.environ.get("JSPEC_BENCH_TAG", "")
    b = Bench(args, f"deepseek{'_' + tag if tag else ''}.json")
    if parts & {"decode", "mtp"}:
        b.decode_and_mtp(parts)
    if "v3layer" in parts:
        b.v3_layers()
    if "ab" in parts:
        b.ab()
    print("saved", save_json(b.name, b.res))


if __name__ == "__main__":
    main()
