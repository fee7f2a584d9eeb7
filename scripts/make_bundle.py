"""Reproduces the bundled models (jspec/bundle): a byte-level BPE tokenizer, a small
Llama-architecture target, its EAGLE-3 head, a DFlash block drafter and a tiny standalone
draft, all trained on the Python standard library's own source files (a fixed ~5% of files
held out).

    PYTHONPATH=. python3 scripts/make_bundle.py --out jspec/bundle          # the real recipe (GPU)
    PYTHONPATH=. python3 scripts/make_bundle.py --out /tmp/b --smoke        # minutes on a CPU

Steps: tokenizer (4096 tokens) -> target (20 layers, width 256, tied embeddings, ~16.1M
parameters, 800 steps: more memorises the ~3M-token corpus) -> EAGLE-3 head (features of
layers 2, 10, 17; draft vocabulary 2048, 5 training-time-test steps) ->
DFlash drafter (blocks of 16, 4 Qwen3 layers reading the outputs of target layers 1, 5, 9,
13, 17, the pad token as its mask; trained on the corpus and the target's own greedy
continuations of 4,096 windows of it) -> standalone draft (2 layers, width 128, distilled
from the target). Weights are saved in
bfloat16. Timings and losses go to <out>/recipe.json.

The target is deep and narrow so that the one-layer head costs little beside it: a draft
step reads about a tenth of the target's weights and runs a twentieth of its layers.

--keep reuses the parts already in <out> (target, eagle3, dflash, standalone) and trains only
the missing ones, so the recipe can run in pieces.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp

import jspec
from jspec.config import ModelConfig, RopeConfig
from jspec.export import save_target
from jspec.train import DFlashTrainConfig, Eagle3TrainConfig, train_dflash, train_eagle3, train_lm
from jspec.train import data as data_mod
from jspec.train.stdlib import split
from jspec.train.tokenizer import train_bpe

FULL = dict(vocab=4096, target_steps=800, target_batch=64, seq=512, head_steps=4000, head_batch=32,
            draft_steps=2000, draft_batch=64, dflash_steps=10000, dflash_batch=32, dflash_layers=4,
            dflash_target_text=4096)
SMOKE = dict(vocab=512, target_steps=60, target_batch=8, seq=128, head_steps=40, head_batch=4,
             draft_steps=40, draft_batch=8, dflash_steps=40, dflash_batch=4, dflash_layers=1,
             dflash_target_text=4)


def target_config(vocab: int, eos: int, smoke: bool) -> ModelConfig:
    if smoke:
        return ModelConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=2,
                           num_kv_heads=1, head_dim=32, tie_word_embeddings=True, eos_token_ids=(eos,),
                           max_position_embeddings=2048, rms_norm_eps=1e-5)
    return ModelConfig(vocab_size=vocab, hidden_size=256, intermediate_size=768, num_layers=20, num_heads=4,
                       num_kv_heads=1, head_dim=64, tie_word_embeddings=True, eos_token_ids=(eos,),
                       max_position_embeddings=2048, rms_norm_eps=1e-5, rope=RopeConfig(theta=10000.0))


def draft_config(t: ModelConfig, smoke: bool) -> ModelConfig:
    if smoke:
        return t.replace(num_layers=1, sliding_windows=(0,))
    return t.replace(hidden_size=128, intermediate_size=384, num_layers=2, num_heads=2, num_kv_heads=1,
                     head_dim=64, sliding_windows=(0, 0))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="jspec/bundle")
    ap.add_argument("--smoke", action="store_true", help="tiny settings for a CPU check")
    ap.add_argument("--stdlib", default=None, help="standard library directory (default: this Python's)")
    ap.add_argument("--keep", action="store_true", help="reuse the parts already in --out; train the rest")
    args = ap.parse_args()
    s = SMOKE if args.smoke else FULL
    recipe = os.path.join(args.out, "recipe.json")
    log = {}
    if args.keep and os.path.isfile(recipe):
        with open(recipe) as f:
            log = json.load(f)
    log.update({"jax": jax.__version__, "device": str(jax.devices()[0]), "settings": s,
                "date": time.strftime("%Y-%m-%d")})
    t_all = time.perf_counter()

    def save_log():
        os.makedirs(args.out, exist_ok=True)
        with open(recipe, "w") as f:
            json.dump(log, f, indent=1, default=str)

    train_files, held = split(args.stdlib)
    if args.smoke:
        train_files = train_files[:40]
    docs = data_mod.read_corpus(train_files)
    log["files"] = {"train": len(train_files), "held_out": len(held), "train_bytes": sum(len(d) for d in docs)}
    tdir, hdir, fdir, sdir = (os.path.join(args.out, part) for part in ("target", "eagle3", "dflash", "standalone"))
    kept = lambda d: args.keep and os.path.isfile(os.path.join(d, "config.json"))  # noqa: E731
    cdt = _dtype(args.smoke)
    if kept(tdir):
        print("kept", tdir, flush=True)
        target = jspec.load(tdir, dtype=cdt)
        stream = data_mod.tokenize(target.tokenizer, docs, target.tokenizer.eos_token_id)
    else:
        stream = make_target(tdir, docs, held, s, args.smoke, log)
        save_log()
        target = jspec.load(tdir, dtype=cdt)
    for d, make in ((hdir, make_head), (fdir, make_dflash), (sdir, make_standalone)):
        if kept(d):
            print("kept", d, flush=True)
        else:
            make(d, target, stream, s, args.smoke, log)
            save_log()
    log["last_run_s"] = time.perf_counter() - t_all
    log["total_s"] = sum(log[k]["s"] for k in ("tokenizer", "target", "eagle3", "dflash", "standalone") if k in log)
    save_log()
    print("done in", round(log["last_run_s"]), "s", flush=True)


def _dtype(smoke):
    """The training compute dtype: float32 for the CPU smoke run, bfloat16 for the recipe."""
    return "float32" if smoke else "bfloat16"


def _quiet(s):
    return dict(progress=False, print_every=max(s["target_steps"] // 10, 1))


def make_target(tdir, docs, held, s, smoke, log):
    """Trains the tokenizer and the target and saves both to tdir -> the token stream."""
    t = time.perf_counter()
    tok = train_bpe(docs, s["vocab"])
    stream = data_mod.tokenize(tok, docs, tok.eos_token_id)
    log["tokenizer"] = {"vocab": len(tok), "train_tokens": int(stream.size), "s": time.perf_counter() - t}
    print(log["tokenizer"], flush=True)
    tc = target_config(len(tok), tok.eos_token_id, smoke)
    log["target_params"] = tc.num_params()
    t = time.perf_counter()
    tw, hist = train_lm(tc, data_mod.batches(stream, s["target_batch"], s["seq"], seed=0), s["target_steps"],
                        lr=2e-3, warmup=100 if not smoke else 5, compute_dtype=_dtype(smoke),
                        desc="target", **_quiet(s))
    log["target"] = {"s": time.perf_counter() - t, "final": hist[-1],
                     "held_out_loss": held_out_loss(tw, tc, tok, held, s["seq"], smoke)}
    print("target", log["target"], flush=True)
    save_target(tdir, tc.replace(dtype="bfloat16"), jax.tree.map(lambda a: a.astype(jnp.bfloat16), tw), tok)
    return stream


def make_head(hdir, target, stream, s, smoke, log):
    """Trains the EAGLE-3 head for the target and exports it to hdir."""
    t = time.perf_counter()
    hcfg = Eagle3TrainConfig(steps=s["head_steps"], batch_size=s["head_batch"], seq_len=s["seq"], lr=6e-4,
                             warmup=100 if not smoke else 5, ttt_steps=5 if not smoke else 3,
                             draft_vocab_size=min(2048, target.config.vocab_size),
                             compute_dtype=_dtype(smoke), checkpoint_every=10 ** 9)
    # Low, middle and high features, each the input of a layer as SGLang captures them:
    # the default (2, n/2, n-3) for the 20-layer target, distinct layers for the smoke's 4.
    _, hist = train_eagle3(target, stream, hdir, hcfg, export_dtype="bfloat16", resume=False,
                           aux_layers=(1, 2, 3) if smoke else None, **_quiet(s))
    log["eagle3"] = {"s": time.perf_counter() - t, "final": hist[-1]}
    print("eagle3", log["eagle3"], flush=True)
    _rm_checkpoint(hdir)


def make_dflash(fdir, target, stream, s, smoke, log):
    """Trains the DFlash block drafter for the target and exports it to fdir."""
    t = time.perf_counter()
    cfg = DFlashTrainConfig(steps=s["dflash_steps"], batch_size=s["dflash_batch"], seq_len=s["seq"], lr=6e-4,
                            warmup=100 if not smoke else 5, block_size=16, num_layers=s["dflash_layers"],
                            loss_decay=7.0, compute_dtype=_dtype(smoke), checkpoint_every=10 ** 9,
                            target_text=s["dflash_target_text"])
    _, hist = train_dflash(target, stream, fdir, cfg, export_dtype="bfloat16", resume=False, **_quiet(s))
    log["dflash"] = {"s": time.perf_counter() - t, "final": hist[-1]}
    print("dflash", log["dflash"], flush=True)
    _rm_checkpoint(fdir)


def make_standalone(sdir, target, stream, s, smoke, log):
    """Distils the standalone draft from the target and saves it to sdir."""
    t = time.perf_counter()
    dc = draft_config(target.config, smoke)
    dw, hist = train_lm(dc, data_mod.batches(stream, s["draft_batch"], s["seq"], seed=1), s["draft_steps"],
                        lr=2e-3, warmup=100 if not smoke else 5, compute_dtype=_dtype(smoke),
                        teacher=target, desc="standalone", **_quiet(s))
    log["standalone"] = {"s": time.perf_counter() - t, "final": hist[-1], "params": dc.num_params()}
    print("standalone", log["standalone"], flush=True)
    save_target(sdir, dc.replace(dtype="bfloat16"), jax.tree.map(lambda a: a.astype(jnp.bfloat16), dw),
                target.tokenizer)


def held_out_loss(weights, cfg, tok, held, seq, smoke) -> float:
    """Mean next-token loss of the target on the held-out files (a fixed sample of windows)."""
    from jspec.train.lm import lm_loss
    stream = data_mod.tokenize(tok, data_mod.read_corpus(held[:8] if smoke else held), tok.eos_token_id)
    batch = next(data_mod.batches(stream, 8 if smoke else 64, seq, seed=123))
    loss, _ = jax.jit(lambda p, t: lm_loss(p, cfg, t))(weights["params"], jnp.asarray(batch))
    return float(loss)


def _rm_checkpoint(d):
    import shutil
    shutil.rmtree(os.path.join(d, "checkpoint"), ignore_errors=True)


if __name__ == "__main__":
    main()
