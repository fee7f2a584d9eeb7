"""`jspec.kernels.fp8.w8a8` (the Mosaic GPU FP8 x FP8 product of a prompt's rows) in jax's
Mosaic GPU interpreter on the CPU, and on a Hopper GPU where there is one: equals
`w8a8_reference` (the rows rounded to E4M3 per group of 128, each group's product scaled by
row and column scales, summed in group order) over several row and column blocks, the
padding of rows to whole blocks and both block widths; `quantize_rows` rounds each group
to E4M3 about its own maximum; `Linear` dispatches to it only when asked to. The grouped
form (`fp8_w8a8_grouped`: MoE experts grouped by expert) equals its reference, `grouped`
dispatches to it by its rule, and DeepSeek's and Qwen3.5-MoE's prompt passes route their
FP8 experts through it on a (faked) Hopper GPU."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.kernels.fp8 import mosaic, w8a8

K, N = 512, 256


def operands(seed: int, M: int, dtype=jnp.bfloat16, columns: int = N):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    w = jnp.clip(jax.random.normal(k1, (K, columns)) * 100.0, -448, 448).astype(jnp.float8_e4m3fn)
    scale = jax.random.uniform(k2, (K // 128, columns), jnp.float32, 0.5, 2.0) / 448.0
    x = (jax.random.normal(k3, (M, K)) * 3.0).astype(dtype)
    x = x * jnp.linspace(0.01, 100.0, K).astype(dtype)  # groups of very different ranges
    return x, w, scale


def rel_err(y, ref):
    y, ref = np.asarray(y, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(y - ref) / np.linalg.norm(ref))


def exact(x, w, scale):
    """The product over the unrounded rows, float64."""
    wf = np.asarray(w.astype(jnp.float32), np.float64) * np.repeat(np.asarray(scale, np.float64), 128, axis=0)
    return np.asarray(x.astype(jnp.float32), np.float64) @ wf


def test_quantize_rows():
    x, _, _ = operands(0, 5)
    x = x.at[2, 128:256].set(0.0)  # an all-zero group
    x8, xs = w8a8.quantize_rows(x)
    assert x8.dtype == jnp.float8_e4m3fn and xs.shape == (5, K // 128) and xs.dtype == jnp.float32
    back = np.asarray(x8.astype(jnp.float32)).reshape(5, -1, 128) * np.asarray(xs)[..., None]
    xf = np.asarray(x.astype(jnp.float32)).reshape(5, -1, 128)
    assert np.isfinite(back).all() and (back[2, 1] == 0).all()
    # each group's largest magnitude lands on 448; E4M3 keeps 3 mantissa bits
    biggest = np.abs(np.asarray(x8.astype(jnp.float32))).reshape(5, -1, 128).max(-1)
    assert np.array_equal(biggest[[0, 1, 3, 4]], np.full((4, K // 128), 448.0))
    assert (np.abs(back - xf) <= 2.0 ** -4 * np.abs(xf) + 2.0 ** -9 * np.asarray(xs)[..., None]).all()
    # per group, not per row: the groups' scales differ by the ranges built into the rows
    assert (np.asarray(xs)[:, -1] > 3 * np.asarray(xs)[:, 0]).all()


@pytest.mark.skipif(mosaic.interpret_params() is None, reason="no Mosaic GPU interpreter in this jax")
@pytest.mark.parametrize("M, tiles", [
    # 2 row blocks (the second padded) x 2 column blocks x 2 K splits (partial sums added after)
    (72, dict(block_n=128, block_m=64, stages=2, num_splits=2)),
    (16, dict(block_n=256, block_m=32, stages=3)),  # one 256-column block, 4 groups through 3 stages
])
def test_equals_reference(M, tiles):
    x, w, scale = operands(M, M)
    y = w8a8.fp8_w8a8_mosaic(x, w, scale, float32_out=True, interpret=True, **tiles)
    assert y.shape == (M, N) and y.dtype == jnp.float32
    ref = w8a8.w8a8_reference(x, w, scale, out_dtype=jnp.float32)
    assert rel_err(y, ref) < 1e-5
    per_column = np.abs(np.asarray(y) - np.asarray(ref)).max(axis=0) / np.abs(np.asarray(ref)).max(axis=0)
    assert per_column.max() < 1e-4
    # every scale counts: with the rows' or the weight's scales dropped the product is far off
    x8, xs = w8a8.quantize_rows(x)
    assert rel_err(y, exact(x8.astype(jnp.float32), w, scale)) > 0.1
    assert rel_err(y, w8a8.w8a8_reference(x, w, jnp.ones_like(scale), out_dtype=jnp.float32)) > 0.1
    # the rows really are rounded to E4M3: a few percent from the exact product, no more
    assert 1e-3 < rel_err(y, exact(x, w, scale)) < 0.05


@pytest.mark.skipif(mosaic.interpret_params() is None, reason="no Mosaic GPU interpreter in this jax")
def test_linear_dispatch(monkeypatch):
    """`Linear` runs the kernel for at least `W8a8Tiles.min_rows` rows on a Hopper GPU
    (faked: interpreted) with an E4M3 kernel, from 65 rows by default; not with min_rows 0, fewer rows,
    the row-invariant mode, E5M2 weights, no Hopper, or JSPEC_KERNELS=reference."""
    from jspec.kernels import dispatch
    from jspec.models.layers import Linear
    from jspec.tuning import Tuning

    x, w, scale = operands(3, 64)
    bias = jnp.linspace(-1.0, 1.0, N).astype(jnp.bfloat16)
    hopper = [True]
    monkeypatch.setattr(mosaic, "on_hopper", lambda: hopper[0])
    on = Tuning(fp8_w8a8=w8a8.W8a8Tiles(min_rows=64, stages=2))

    def path(rows, tuning=on, weight=w, mode="pallas", row_invariant=False):
        lin = Linear(N, use_bias=True, dtype="bfloat16", tuning=tuning)
        p = {"params": {"kernel": weight, "kernel_scale": scale, "bias": bias}}
        with dispatch.use_backend(mode):
            text = str(jax.make_jaxpr(lambda v: lin.apply(p, v, row_invariant=row_invariant))(
                jnp.zeros((rows, K), jnp.bfloat16)))
        return "w8a8" if "jspec_fp8_w8a8" in text else "other"

    assert [path(64), path(200), path(63)] == ["w8a8", "w8a8", "other"]
    assert [path(65, tuning=Tuning()), path(64, tuning=Tuning())] == ["w8a8", "other"]  # the default
    assert path(200, tuning=Tuning(fp8_w8a8=w8a8.W8a8Tiles(min_rows=0))) == "other"
    assert path(200, row_invariant=True) == "other"
    assert path(200, weight=w.astype(jnp.float8_e5m2)) == "other"
    assert path(200, mode="reference") == "other"
    hopper[0] = False
    assert path(200) == "other"
    hopper[0] = True
    lin = Linear(N, use_bias=True, dtype="bfloat16", tuning=on)
    with dispatch.use_backend("pallas"):
        y = jax.jit(lambda v: lin.apply({"params": {"kernel": w, "kernel_scale": scale, "bias": bias}}, v))(x)
    want = np.asarray(w8a8.w8a8_reference(x, w, scale, out_dtype=jnp.float32)) + np.asarray(bias, np.float32)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y, np.float32), want, rtol=1e-2, atol=1e-2 * np.abs(want).max())


def test_refuses_what_it_does_not_take():
    x, w, scale = operands(4, 8)
    assert w8a8.supported(x, w, scale)
    assert not w8a8.supported(x, w.astype(jnp.float8_e5m2), scale)
    assert not w8a8.supported(x[:, :448], w[:448], scale[:3])  # K not whole groups
    assert not w8a8.supported(x, w[:, :192], scale[:, :192])  # N not whole 128-column blocks
    with pytest.raises(ValueError):
        w8a8.fp8_w8a8_mosaic(x, w[:, :192], scale[:, :192], interpret=True)
    with pytest.raises(ValueError):
        w8a8.W8a8Tiles(block_n=64)
    with pytest.raises(ValueError):
        w8a8.W8a8Tiles(block_m=24)
    with pytest.raises(ValueError):  # 8 rows a warpgroup: a misaligned address on the H200
        w8a8.W8a8Tiles(block_m=16)
    with pytest.raises(ValueError):
        w8a8.W8a8Tiles(num_splits=0)
    with pytest.raises(ValueError):
        w8a8.W8a8Tiles(grouped_large_block_m=300)
    # grouped experts: 64-row blocks, 128 from 64 pairs an expert (64 experts: 4,096 pairs)
    assert [w8a8.grouped_block_rows(p, 64) for p in (4095, 4096)] == [64, 128]
    # K splits by default where few CTAs would leave SMs idle: the 8B down projection
    # (112 groups, 32 column blocks) at 128 rows takes 4, at 2,048 rows (16 row blocks) none
    t = w8a8.W8a8Tiles()
    assert [mosaic.splits_of(112, blocks, t) for blocks in (32, 16 * 32)] == [4, 1]


@pytest.mark.skipif(not mosaic.on_hopper(), reason="A from registers (`fp8_to_regs`) runs on a Hopper GPU only")
@pytest.mark.parametrize("tiles", [dict(), dict(block_n=256, block_m=64, stages=3), dict(block_m=64, stages=2),
                                   dict(block_m=32), dict(num_splits=2, stages=2)])
def test_on_hopper(tiles):
    """On the GPU (two compute warpgroups, each half the rows) the weight goes to wgmma from
    registers, its bytes transposed by prmt: the product equals the reference up to the
    tensor cores' summation, bfloat16 output too, 200 rows padded to whole blocks (and one
    tiling with K split in two)."""
    x, w, scale = operands(5, 200, columns=512)
    ref = w8a8.w8a8_reference(x, w, scale, out_dtype=jnp.float32)
    y = w8a8.fp8_w8a8_mosaic(x, w, scale, float32_out=True, **tiles)
    assert rel_err(y, ref) < 1e-3
    per_column = np.abs(np.asarray(y) - np.asarray(ref)).max(axis=0) / np.abs(np.asarray(ref)).max(axis=0)
    assert per_column.max() < 2e-3
    yb = w8a8.fp8_w8a8_mosaic(x, w, scale, **tiles)
    assert yb.dtype == jnp.bfloat16 and rel_err(yb, ref) < 1e-2


# ---- grouped by expert (MoE prompt passes): `fp8_w8a8_grouped` ------------------------------

E = 3


def grouped_operands(seed: int, P: int, block_m: int, dtype=jnp.bfloat16):
    """P pairs over E experts laid out in blocks of block_m rows (`grouped.group_layout`):
    (x [R, K], tile_expert, stacks w [E, K, N], scale [E, K / 128, N])."""
    from jspec.kernels.moe import grouped
    ids = jax.random.randint(jax.random.key(seed), (P,), 0, E - 1).at[0].set(E - 1)  # every expert, unevenly
    rows, tile_expert = grouped.group_layout(ids, E, block_m)
    R = grouped.padded_rows(P, E, block_m)
    stacks = [operands(seed + 10 * e, R, dtype) for e in range(E)]
    x = stacks[0][0]
    w, scale = jnp.stack([s[1] for s in stacks]), jnp.stack([s[2] for s in stacks])
    return x, tile_expert, w, scale


@pytest.mark.skipif(mosaic.interpret_params() is None, reason="no Mosaic GPU interpreter in this jax")
def test_grouped_equals_reference():
    """Each row block times its own expert's stack (a block of expert -1 runs nothing), as
    `w8a8_grouped_reference`, with the K split in two; one expert's stack for every block
    is far off."""
    bm = 32
    x, te, w, scale = grouped_operands(7, 40, bm)
    assert (np.asarray(te) == -1).any() and len(set(np.asarray(te)[np.asarray(te) >= 0])) == E
    y = w8a8.fp8_w8a8_grouped(x, te, w, scale, block_m=bm, out_dtype=jnp.float32, interpret=True, stages=2,
                              num_splits=2)
    assert y.shape == (x.shape[0], N) and y.dtype == jnp.float32
    ref = w8a8.w8a8_grouped_reference(x, te, w, scale, bm, out_dtype=jnp.float32)
    named = np.repeat(np.asarray(te) >= 0, bm)
    assert rel_err(np.asarray(y)[named], np.asarray(ref)[named]) < 1e-5
    one = w8a8.w8a8_grouped_reference(x, jnp.where(te >= 0, 0, -1), w, scale, bm, out_dtype=jnp.float32)
    assert rel_err(np.asarray(y)[named], np.asarray(one)[named]) > 0.1
    with pytest.raises(ValueError):  # rows not whole blocks
        w8a8.fp8_w8a8_grouped(x[:-1], te, w, scale, block_m=bm, interpret=True)
    with pytest.raises(ValueError):  # a tile_expert of the wrong length
        w8a8.fp8_w8a8_grouped(x, te[:-1], w, scale, block_m=bm, interpret=True)


@pytest.mark.skipif(mosaic.interpret_params() is None, reason="no Mosaic GPU interpreter in this jax")
def test_grouped_experts_dispatch(monkeypatch):
    """`grouped` runs FP8 stacks through `fp8_w8a8_grouped` on a Hopper GPU (faked:
    interpreted) from `W8a8Tiles.min_pairs_per_expert` pairs an expert, not with 0, fewer
    pairs, bf16 stacks, no Hopper or JSPEC_KERNELS=reference; the experts' output is each
    pair's two w8a8 products (`w8a8_reference`), silu(gate) * up between them."""
    from jspec.kernels import dispatch
    from jspec.kernels.moe import grouped
    from jspec.kernels.moe.experts import silu_mul

    D, Fm, k, T = 512, 256, 2, 24
    keys = jax.random.split(jax.random.key(11), 5)
    gate_up = jnp.clip(jax.random.normal(keys[0], (E, D, 2 * Fm)) * 100, -448, 448).astype(jnp.float8_e4m3fn)
    down = jnp.clip(jax.random.normal(keys[1], (E, Fm, D)) * 100, -448, 448).astype(jnp.float8_e4m3fn)
    scales = (jax.random.uniform(keys[2], (E, D // 128, 2 * Fm), jnp.float32, 0.5, 2) / 4480,
              jax.random.uniform(keys[3], (E, Fm // 128, D), jnp.float32, 0.5, 2) / 4480)
    xs = jax.random.normal(keys[4], (T, D), jnp.float32)
    ids = (jnp.arange(T * k, dtype=jnp.int32) % E).reshape(T, k).at[0, 0].set(-1)  # a pair of no expert
    hopper = [True]
    monkeypatch.setattr(mosaic, "on_hopper", lambda: hopper[0])
    on = w8a8.W8a8Tiles(min_pairs_per_expert=16, grouped_block_m=32, stages=2)

    def path(tiles=on, n=T, sc=scales, mode="pallas"):
        with dispatch.use_backend(mode):
            return grouped.uses_w8a8(xs[:n], ids[:n], gate_up, down, sc, tiles)

    assert path() and not path(n=23)  # 48 pairs over 3 experts: 16 an expert; 46 are fewer
    assert not path(tiles=w8a8.W8a8Tiles(min_pairs_per_expert=0, grouped_block_m=32))
    assert not path(sc=None) and not path(mode="reference")
    # DeepSeek-V3's stacks, whose down experts the Triton kernel would copy as uint16 pairs
    # every call: w8a8 from one pair an expert (shapes only: nothing is allocated)
    v3 = [jax.ShapeDtypeStruct(s, jnp.float8_e4m3fn) for s in ((256, 7168, 4096), (256, 2048, 7168))]
    v3_scales = [jax.ShapeDtypeStruct((256, K // 128, N), jnp.float32) for _, K, N in (w.shape for w in v3)]
    pairs = jax.ShapeDtypeStruct((32, 8), jnp.int32)
    with dispatch.use_backend("pallas"):
        assert grouped.uses_w8a8(jax.ShapeDtypeStruct((32, 7168), jnp.bfloat16), pairs, *v3, v3_scales)
        assert not grouped.uses_w8a8(xs[:4], ids[:4], gate_up, down, scales, on)  # 8 pairs, small stacks
    hopper[0] = False
    assert not path()
    hopper[0] = True
    with dispatch.use_backend("pallas"):
        y = jax.jit(lambda v: grouped.grouped(v, ids, gate_up, down, scales=scales, w8a8=on))(xs)
    assert y.shape == (T * k, D) and y.dtype == jnp.float32
    want = np.zeros((T * k, D), np.float32)
    for p, e in enumerate(np.asarray(ids).reshape(-1)):
        if e >= 0:
            h = w8a8.w8a8_reference(xs[p // k][None], gate_up[e], scales[0][e])
            want[p] = w8a8.w8a8_reference(silu_mul(h[:, :Fm], h[:, Fm:]), down[e], scales[1][e])[0]
    assert (np.asarray(y)[0] == 0).all()
    # the interpreter sums as the reference; on the GPU the tensor cores' order moves h a
    # little, and its rounding to E4M3 for down then flips a few values by a step (0.4%)
    assert rel_err(y, want) < (1e-5 if jax.default_backend() == "cpu" else 1e-2)
    # the Triton path's numerics (weights widened, rows unrounded) are a rounding away
    dequant = grouped.grouped(xs, ids, gate_up, down, scales=scales, w8a8=w8a8.W8a8Tiles(min_pairs_per_expert=0))
    assert 1e-3 < rel_err(y, dequant) < 0.05


@pytest.mark.skipif(not mosaic.on_hopper(), reason="A from registers (`fp8_to_regs`) runs on a Hopper GPU only")
@pytest.mark.parametrize("bm, tiles", [(128, dict()), (64, dict(stages=3)), (128, dict(num_splits=2))])
def test_grouped_on_hopper(bm, tiles):
    """On the GPU each row block takes its expert's views of the flat stacks: equal to the
    reference up to the tensor cores' summation, over blocks of every expert and of none."""
    x, te, w, scale = grouped_operands(9, 300, bm)
    y = w8a8.fp8_w8a8_grouped(x, te, w, scale, block_m=bm, out_dtype=jnp.float32, **tiles)
    ref = w8a8.w8a8_grouped_reference(x, te, w, scale, bm, out_dtype=jnp.float32)
    named = np.repeat(np.asarray(te) >= 0, bm)
    assert named.any() and not named.all()
    assert rel_err(np.asarray(y)[named], np.asarray(ref)[named]) < 1e-3


@pytest.mark.skipif(mosaic.interpret_params() is None, reason="no Mosaic GPU interpreter in this jax")
def test_models_route_their_fp8_experts_through_w8a8(monkeypatch, fresh_compiles):
    """DeepSeek's and Qwen3.5-MoE's prompt passes hand `Tuning.fp8_w8a8` to the grouped
    experts: with FP8 stacks on a Hopper GPU (faked: interpreted) their programs hold the
    w8a8 kernel, and DeepSeek's logits move from the widening path's by the rows' rounding
    only; on the CPU as it is, neither does."""
    import jspec
    from jspec.models import family_for
    from jspec.models.deepseek_hf import DeepseekConfig
    from jspec.models.qwen3_next_hf import HybridConfig
    from jspec.quantization import quantize_params

    deepseek = DeepseekConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=2,
                              kv_lora_rank=32, q_lora_rank=0, qk_nope_head_dim=16, qk_rope_head_dim=16,
                              v_head_dim=16, moe_intermediate_size=128, n_routed_experts=4, n_shared_experts=1,
                              num_experts_per_tok=2, first_k_dense_replace=1, dtype="float32")
    qwen = HybridConfig(vocab_size=256, hidden_size=128, num_layers=2,
                        layer_types=("linear_attention", "full_attention"), num_heads=2, num_kv_heads=1,
                        head_dim=32, rotary_dim=16, linear_num_key_heads=2, linear_num_value_heads=2,
                        linear_key_head_dim=32, linear_value_head_dim=32, intermediate_size=0, num_experts=4,
                        num_experts_per_tok=2, moe_intermediate_size=128, shared_expert_intermediate_size=128,
                        variant="qwen3_5_moe", dtype="float32")
    ids = [list(range(3, 43))]  # 40 tokens, 80 pairs over 4 experts: 20 an expert
    hopper = [False]
    monkeypatch.setattr(mosaic, "on_hopper", lambda: hopper[0])
    out = {}
    for name, cfg in (("deepseek", deepseek), ("qwen", qwen)):
        weights = jax.jit(lambda key, cfg=cfg: family_for(cfg).init_weights(cfg, key))(jax.random.key(0))
        params = quantize_params(jspec.Params(config=cfg, weights=weights, draft=None))
        for hopper[0] in (False, True):
            jspec.clear_caches()  # the programs are traced again with the faked GPU
            text = str(jax.make_jaxpr(lambda p=params: jspec.logits(p, ids))())
            assert ("jspec_fp8_w8a8" in text) == hopper[0], (name, hopper[0])
            if name == "deepseek":
                out[hopper[0]] = np.asarray(jspec.logits(params, ids))
    assert 1e-4 < rel_err(out[True], out[False]) < 0.05


@pytest.mark.skipif(mosaic.interpret_params() is None, reason="no Mosaic GPU interpreter in this jax")
def test_deepseek_dense_mlp_and_shared_experts_take_w8a8(monkeypatch):
    """DeepSeek's prompt passes run the dense MLP's FP8 projections and each FP8 shared
    expert through `layers.project`: on a Hopper GPU (faked: interpreted) from
    `W8a8Tiles.min_rows` rows the w8a8 kernel, equal to its reference products; elsewhere
    the weights dequantized, as before."""
    from jspec.kernels import dispatch
    from jspec.kernels.moe.experts import silu_mul
    from jspec.models.deepseek import MLP, shared_products
    from jspec.quantization import dequantize_kernel, quantize_kernel
    from jspec.tuning import Tuning

    M, D, F, S = 40, 256, 128, 2
    k1, k2, k3 = jax.random.split(jax.random.key(5), 3)
    gate_up = jax.lax.map(quantize_kernel, jax.random.normal(k1, (S, D, 2 * F)) * 0.05)
    down = jax.lax.map(quantize_kernel, jax.random.normal(k2, (S, F, D)) * 0.05)
    stack = {"gate_up": gate_up[0], "gate_up_scale": gate_up[1], "down": down[0], "down_scale": down[1]}
    xs = jax.random.normal(k3, (M, D), jnp.float32)
    hopper = [True]
    monkeypatch.setattr(mosaic, "on_hopper", lambda: hopper[0])
    tuning = Tuning(fp8_w8a8=w8a8.W8a8Tiles(min_rows=32, block_m=64, stages=2))

    def run(fn, *args):
        with dispatch.use_backend("pallas"):
            text = str(jax.make_jaxpr(fn)(*args))
            return "jspec_fp8_w8a8" in text, np.asarray(jax.jit(fn)(*args))

    def ref_mlp(x, gu, gu_scale, dn, dn_scale):
        h = w8a8.w8a8_reference(x, gu, gu_scale, out_dtype=jnp.float32)
        return np.asarray(w8a8.w8a8_reference(silu_mul(h[:, :F], h[:, F:]), dn, dn_scale, out_dtype=jnp.float32))

    took, y = run(lambda v: shared_products(v, stack, F, jnp.float32, tuning), xs)
    want = sum(ref_mlp(xs, stack["gate_up"][s], stack["gate_up_scale"][s], stack["down"][s], stack["down_scale"][s])
               for s in range(S))
    assert took and y.dtype == np.float32 and rel_err(y, want) < 1e-5
    hopper[0] = False  # the CPU: both stacks dequantized, the products over the whole stack
    took_cpu, y_cpu = run(lambda v: shared_products(v, stack, F, jnp.float32, tuning), xs)
    deq = [dequantize_kernel(stack[n], stack[n + "_scale"], jnp.float32) for n in ("gate_up", "down")]
    h = jnp.einsum("nd,sdf->nsf", xs, deq[0])
    plain = np.asarray(jnp.einsum("nsf,sfd->nd", silu_mul(h[..., :F], h[..., F:]), deq[1]))
    assert not took_cpu and rel_err(y_cpu, plain) < 1e-5
    assert 1e-3 < rel_err(y, plain) < 0.05  # the rows' rounding: w8a8 was not the dequantized path

    params = {"params": {"gate_up_proj": {"kernel": stack["gate_up"][0], "kernel_scale": stack["gate_up_scale"][0]},
                         "down_proj": {"kernel": stack["down"][0], "kernel_scale": stack["down_scale"][0]}}}
    mlp = MLP(F, "float32", tuning)
    hopper[0] = True
    took, y = run(lambda v: mlp.apply(params, v[None], None)[0], xs)
    assert took and rel_err(y, ref_mlp(xs, stack["gate_up"][0], stack["gate_up_scale"][0], stack["down"][0],
                                       stack["down_scale"][0])) < 1e-5
