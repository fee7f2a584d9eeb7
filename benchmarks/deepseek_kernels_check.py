"""The DeepSeek decode kernels on the GPU against their references, at real shapes (bf16):
- mla_output (merge of the MLA splits + W_UV): V2-Lite (H 16) and V3 (H 128) heads,
  Dc 512, Dv 128, batch 1 and 32, 1 and 4 tokens; relative error against a float32
  reference on the same inputs, and the bf16 reference's own error beside it;
- moe_route: V2-Lite's and V3's routing of 1, 4 and 64 tokens: ids equal to the
  reference's, weights' largest difference;
- routed_experts with the routing table (token rows, the gated second product): V2-Lite
  and V3 expert shapes, 1 and 4 tokens, against a float32 chain;
- mla_inputs (the projection's K splits -> absorbed query, roped query part, cache row)
  at V2-Lite's shape (16 heads, Dn 128, Dr 64, Dc 512, 16 splits), both RoPE layouts,
  against the reference on the splits' rounded sum, and the row written into a cache;
- matvec (the few-row products through the expert kernel, the input norm in its
  prologue) against a float32 product, and the dense MLP as one expert;
- a 4-layer V2-Lite model, batch 1: 48 greedy tokens with the kernels and with the
  references (JSPEC_KERNELS=reference), and where they first differ (bf16: near-ties may
  flip).
Result: $OUT/deepseek_kernels_check.json.

Run: PYTHONPATH=. python3 benchmarks/deepseek_kernels_check.py
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jspec
from benchmarks.common import env_info, random_params, save_json
from benchmarks.deepseek_h200 import V2_LITE, prompts
from jspec.kernels import dispatch
from jspec.kernels import mla_inputs as mi
from jspec.kernels import mla_output as mo
from jspec.kernels import moe_experts as me
from jspec.kernels import moe_route as mr

RES: dict = {"env": env_info()}


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def log(key, row):
    RES[key] = row
    print(key, row, flush=True)
    save_json("deepseek_kernels_check.json", RES)


def check_mla_output():
    for H, B, T, NS in ((16, 1, 1, 16), (16, 32, 1, 8), (16, 1, 4, 16), (128, 1, 1, 2), (128, 32, 4, 1)):
        rng = np.random.default_rng(H + B + T)
        R = -(-(T * H) // 64) * 64
        o = jnp.asarray(rng.standard_normal((B, NS, R, 512)), jnp.float32)
        lse = jnp.asarray(rng.uniform(-2, 2, (B, NS, R)), jnp.float32)
        w = jnp.asarray(rng.standard_normal((H, 128, 512)) / 22, jnp.bfloat16)
        got = jax.jit(lambda o, l, w: mo.mla_output(o, l, w, num_tokens=T))(o, lse, w)
        ref16 = mo.mla_output_reference(o, lse, w, num_tokens=T, dtype=jnp.bfloat16)
        ref32 = mo.mla_output_reference(o, lse, w.astype(jnp.float32), num_tokens=T, dtype=jnp.float32)
        log(f"mla_output_H{H}_B{B}_T{T}_NS{NS}", {"kernel_vs_f32": rel(got, ref32), "bf16_reference_vs_f32":
                                                  rel(ref16, ref32), "ok": rel(got, ref32) < 1e-2})


def check_route():
    for name, r in (("v2lite", mr.Routing(64, 6, num_extra=2)),
                    ("v3", mr.Routing(256, 8, scoring="sigmoid", method="noaux_tc", n_group=8, topk_group=4,
                                      norm_topk_prob=True, scaling=2.5, num_extra=1))):
        for N in (1, 4, 64):
            rng = np.random.default_rng(N)
            logits = jnp.asarray(rng.standard_normal((N, r.num_experts)), jnp.float32)
            bias = jnp.asarray(rng.uniform(-0.1, 0.1, r.num_experts), jnp.float32) if r.scoring == "sigmoid" else None
            w, ids = jax.jit(lambda l, b: mr.route_kernel(r, l, b))(logits, bias)
            w_ref, ids_ref = mr.route_reference(r, logits, bias)
            same = bool((np.asarray(ids) == np.asarray(ids_ref)).all())
            log(f"route_{name}_N{N}", {"ids_equal": same, "weights_max_diff": float(jnp.abs(w - w_ref).max()),
                                       "ok": same})


def check_experts():
    for name, (E, k, D, Fm, S) in (("v2lite", (64, 6, 2048, 1408, 2)), ("v3", (256, 8, 7168, 2048, 1))):
        key = jax.random.key(3)
        gu = jax.random.normal(key, (E, D, 2 * Fm), jnp.bfloat16) / float(np.sqrt(D))
        dn = jax.random.normal(jax.random.fold_in(key, 1), (E, Fm, D), jnp.bfloat16) / float(np.sqrt(Fm))
        sgu = jax.random.normal(jax.random.fold_in(key, 2), (S, D, 2 * Fm), jnp.bfloat16) / float(np.sqrt(D))
        sdn = jax.random.normal(jax.random.fold_in(key, 3), (S, Fm, D), jnp.bfloat16) / float(np.sqrt(Fm))
        for N in (1, 4):
            rng = np.random.default_rng(N)
            x = jnp.asarray(rng.standard_normal((N, D)), jnp.bfloat16)
            routed = np.stack([rng.choice(E, k, replace=False) for _ in range(N)])
            KP = 1 << (k + S - 1).bit_length()
            table = np.zeros((N, KP), np.int32)
            table[:, :k], table[:, k:k + S] = routed, np.arange(E, E + S)
            table = jnp.asarray(table)
            got = jax.jit(lambda x, t, gu, dn, sgu, sdn: me.routed_experts(x, t, gu, dn, (sgu, sdn), k + S))(
                x, table, gu, dn, sgu, sdn)
            ref = me.routed_experts_reference(x, table, gu, dn, (sgu, sdn), k + S)
            f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
            chain = me.routed_experts_reference(f32(x), table, f32(gu), f32(dn), (f32(sgu), f32(sdn)), k + S)
            log(f"experts_{name}_N{N}", {"kernel_vs_f32": rel(got, chain), "bf16_reference_vs_f32": rel(ref, chain),
                                         "ok": rel(got, chain) < 2e-2})


def check_matvec():
    """`matvec` with the input norm in its prologue: V2-Lite's fused query/latent
    projection and output projection, the dense layer's MLP as one expert."""
    key = jax.random.key(5)
    for name, (K, N, norm) in (("qkv_a", (2048, 3648, True)), ("o_proj", (2048, 2048, False)),
                               ("v3_qkv_a", (7168, 2112, True))):
        x = (jax.random.normal(key, (1, K)) * 3).astype(jnp.bfloat16)
        w = jax.random.normal(jax.random.fold_in(key, 1), (K, N), jnp.bfloat16) / float(np.sqrt(K))
        nw = (1 + 0.1 * jax.random.normal(jax.random.fold_in(key, 2), (K,))).astype(jnp.bfloat16)
        nm = (nw, 1e-6) if norm else None
        got = jax.jit(lambda x, w, nw: me.matvec(x, w, (nw, 1e-6) if norm else None, float32_out=True))(x, w, nw)
        xin = me.rms_norm(x, *nm) if norm else x
        ref = jnp.dot(xin.astype(jnp.float32), w.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
        log(f"matvec_{name}", {"kernel_vs_f32": rel(got, ref), "ok": rel(got, ref) < 1e-5})
    D, F = 2048, 10944
    x = jax.random.normal(key, (1, D), jnp.bfloat16)
    gu = jax.random.normal(jax.random.fold_in(key, 3), (1, D, 2 * F), jnp.bfloat16) / float(np.sqrt(D))
    dn = jax.random.normal(jax.random.fold_in(key, 4), (1, F, D), jnp.bfloat16) / float(np.sqrt(F))
    one = jnp.zeros((1,), jnp.int32)
    got = jax.jit(me.routed_experts)(x, one, gu, dn)
    ref = me.routed_experts_reference(x, one, gu, dn)
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
    chain = me.routed_experts_reference(f32(x), one, f32(gu), f32(dn))
    log("dense_mlp_one_expert", {"kernel_vs_f32": rel(got, chain), "bf16_reference_vs_f32": rel(ref, chain),
                                 "ok": rel(got, chain) < 2e-2})


def check_mla_inputs():
    H, Dn, Dr, Dc, S = 16, 128, 64, 512, 16
    rng = np.random.default_rng(11)
    parts = jnp.asarray(rng.standard_normal((S, 1, H * (Dn + Dr) + Dc + Dr)) / 4, jnp.float32)
    angle = rng.uniform(0, 6, (1, Dr // 2))
    cos, sin = (jnp.asarray(f(angle), jnp.float32) for f in (np.cos, np.sin))
    norm = jnp.asarray(1 + 0.1 * rng.standard_normal(Dc), jnp.bfloat16)
    w_uk = jnp.asarray(rng.standard_normal((Dc, H, Dn)) / 11, jnp.bfloat16)
    qkv = jnp.sum(parts, axis=0).astype(jnp.bfloat16)
    Q = H * (Dn + Dr)
    for inter in (True, False):
        got = jax.jit(lambda *a: mi.mla_inputs(*a, interleaved=inter, eps=1e-6))(parts, cos, sin, norm, w_uk)
        ref = mi.mla_inputs_reference(qkv[:, :Q].reshape(1, H, -1), qkv[:, Q:], cos, sin, norm, w_uk,
                                      interleaved=inter, eps=1e-6)
        errs = [rel(g.astype(jnp.float32), r.astype(jnp.float32)) for g, r in zip(got, ref)]
        log(f"mla_inputs_interleaved_{inter}", {"q_lat": errs[0], "q_pe": errs[1], "rows": errs[2],
                                                "ok": max(errs) < 1e-2})
    # the row written into a latent cache [1, 1217, 576] at slot 1040 (the buffer donated,
    # so updated in place) equals the rows output; every other slot unchanged
    cache = jnp.asarray(rng.standard_normal((1, 1217, Dc + Dr)), jnp.bfloat16)
    before = np.asarray(cache, np.float32)
    slot = jnp.asarray([[1040]], jnp.int32)
    rows = np.asarray(jax.jit(lambda *a: mi.mla_inputs(*a, interleaved=True, eps=1e-6))(parts, cos, sin, norm,
                                                                                        w_uk)[2], np.float32)
    write = jax.jit(lambda c, *a: mi.mla_inputs(*a, interleaved=True, eps=1e-6, cache=c, write_index=slot)[2],
                    donate_argnums=0)
    got = np.asarray(write(cache, parts, cos, sin, norm, w_uk), np.float32)
    before[0, 1040] = rows[0]
    log("mla_inputs_cache_write", {"ok": bool((got == before).all())})


def check_model():
    cfg = V2_LITE.replace(num_layers=4)
    target = random_params(cfg)
    outs = {}
    for mode in ("reference", "auto"):
        with dispatch.use_backend(mode):
            jspec.clear_caches()
            outs[mode] = jspec.generate(target, prompts(1, cfg.vocab_size), max_new_tokens=48,
                                        stop_token_ids=[]).tokens[0]
    a, b = outs["auto"], outs["reference"]
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    log("model_4l_greedy", {"identical": a == b, "first_difference": first, "tokens": len(a)})


if __name__ == "__main__":
    check_mla_output()
    check_mla_inputs()
    check_route()
    check_experts()
    check_matvec()
    check_model()
    print("all ok:", all(v.get("ok", True) for v in RES.values() if isinstance(v, dict)))
