"""`jspec.kernels.fp8.mosaic` (the Mosaic GPU product of a few rows with an FP8 weight) in
jax's Mosaic GPU interpreter on the CPU: equals `matmul.matmul_reference` (with the rows
in float16 as the kernel multiplies them) over several column blocks, K splits and
pipeline stages; the scales and every column block count; arguments it does not take are
refused. Skipped on a jax without the interpreter (a private module)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.kernels.fp8 import mosaic
from jspec.kernels.fp8.matmul import Fp8Tiles, matmul_reference

pytestmark = pytest.mark.skipif(mosaic.interpret_params() is None, reason="no Mosaic GPU interpreter in this jax")

K, N = 512, 256


def operands(seed: int, M: int, dtype=jnp.bfloat16):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    w = jnp.clip(jax.random.normal(k1, (K, N)) * 100.0, -448, 448).astype(jnp.float8_e4m3fn)
    scale = jax.random.uniform(k2, (K // 128, N), jnp.float32, 0.5, 2.0) / 448.0
    x = (jax.random.normal(k3, (M, K)) * 3.0).astype(dtype)
    return x, w, scale


def reference(x, w, scale):
    # vector_rows=0: the rows as the tensor-core kernels take them (`half_rows`), as this one does
    return np.asarray(matmul_reference(x, w, scale, out_dtype=jnp.float32, tiles=Fp8Tiles(vector_rows=0)))


def rel_err(y, ref):
    return float(np.linalg.norm(np.asarray(y, np.float32) - ref) / np.linalg.norm(ref))


@pytest.mark.parametrize("M, tiles", [
    (1, dict(block_n=128, stages=2, num_splits=2)),  # 2 column blocks x 2 splits of 2 groups
    (3, dict(block_n=64, stages=3, num_splits=1)),  # 4 column blocks, 4 groups through 3 stages
    (16, dict(block_n=128, stages=2, num_splits=4)),  # the most rows: wgmma N = 16
])
def test_equals_reference(M, tiles):
    x, w, scale = operands(M, M)
    y = mosaic.fp8_matmul_mosaic(x, w, scale, float32_out=True, interpret=True, **tiles)
    assert y.shape == (M, N) and y.dtype == jnp.float32
    ref = reference(x, w, scale)
    assert np.isfinite(np.asarray(y)).all()
    assert rel_err(y, ref) < 1e-5
    # every column block and group counts: the scales (a wrong or dropped scale is far off)
    assert rel_err(y, reference(x, w, jnp.ones_like(scale))) > 0.1
    per_column = np.abs(np.asarray(y) - ref).max(axis=0) / (np.abs(ref).max(axis=0) + 1e-30)
    assert per_column.max() < 1e-4


@pytest.mark.parametrize("dtype, splits", [(jnp.float16, 2), (jnp.bfloat16, 1)])
def test_leading_dims_dtypes_and_out_dtype(dtype, splits):
    # one split: the kernel writes the product in the output dtype itself (fuse_out)
    x, w, scale = operands(5, 6, dtype)
    x = x.reshape(2, 3, K)
    y = mosaic.fp8_matmul_mosaic(x, w, scale, interpret=True, block_n=128, stages=2, num_splits=splits)
    assert y.shape == (2, 3, N) and y.dtype == dtype
    ref = reference(x.reshape(6, K), w, scale).reshape(2, 3, N)
    expect = np.asarray(jnp.asarray(ref).astype(dtype), np.float32)
    np.testing.assert_allclose(np.asarray(y, np.float32), expect, rtol=1e-2, atol=1e-3 * np.abs(ref).max())


def test_refuses_what_it_does_not_take():
    x, w, scale = operands(0, 1)
    assert mosaic.supported(x, w, scale)
    assert not mosaic.supported(x.astype(jnp.float32), w, scale)  # float32 rows: not f16-exact
    assert not mosaic.supported(jnp.zeros((17, K), jnp.bfloat16), w, scale)  # more than MAX_ROWS rows
    assert not mosaic.supported(x, w.astype(jnp.bfloat16), scale)
    assert not mosaic.supported(x[:, :448], w[:448], scale[:3])  # K not whole groups
    assert not mosaic.supported(x, w[:, :96], scale[:, :96])  # N not a multiple of 64
    with pytest.raises(ValueError):
        mosaic.fp8_matmul_mosaic(x.astype(jnp.float32), w, scale, interpret=True)


@pytest.mark.parametrize("splits", [1, 2])
def test_rows_past_float16_range(splits):
    # rows over 2^15 are divided by a power of two for float16 and their sums multiplied back
    x, w, scale = operands(9, 2)
    x = (x.astype(jnp.float32) * 2.0 ** 18).astype(jnp.bfloat16)
    y = mosaic.fp8_matmul_mosaic(x, w, scale, float32_out=True, interpret=True, block_n=128, stages=2,
                                 num_splits=splits)
    assert rel_err(y, reference(x, w, scale)) < 1e-5


def test_e5m2_weights():
    x, w, scale = operands(11, 2)
    w = w.astype(jnp.float32).astype(jnp.float8_e5m2)
    y = mosaic.fp8_matmul_mosaic(x, w, scale, float32_out=True, interpret=True, block_n=128, stages=2,
                                 num_splits=2)
    assert rel_err(y, reference(x, w, scale)) < 1e-5


def test_linear_dispatch(monkeypatch):
    """`Linear` with an FP8 kernel runs this kernel for at most `Fp8Tiles.mosaic_rows`
    bfloat16 rows on a Hopper GPU (faked here: the kernel runs interpreted), its norm
    prologue, norm factor and bias applied as on the other paths; the Triton kernel for more
    rows, mosaic_rows=0, float32 rows, N not a multiple of 64 or no Hopper; the weight
    dequantized under JSPEC_KERNELS=reference."""
    from jspec.kernels import dispatch
    from jspec.kernels.moe.experts import rms_norm
    from jspec.models.layers import Linear
    from jspec.tuning import Tuning

    x, w, scale = operands(21, 3)
    bias = jnp.linspace(-1.0, 1.0, N).astype(jnp.bfloat16)
    params = {"params": {"kernel": w, "kernel_scale": scale, "bias": bias}}
    norm = (jnp.linspace(0.5, 1.5, K).astype(jnp.bfloat16), 1e-6)
    factor = jnp.full((3, 1), 0.5, jnp.float32)
    hopper = [True]
    monkeypatch.setattr(mosaic, "on_hopper", lambda: hopper[0])

    def path(rows, dtype="bfloat16", tuning=Tuning(), columns=N, mode="pallas"):
        lin = Linear(columns, use_bias=True, dtype=dtype, tuning=tuning)
        p = {"params": {"kernel": w[:, :columns], "kernel_scale": scale[:, :columns], "bias": bias[:columns]}}
        with dispatch.use_backend(mode):
            text = str(jax.make_jaxpr(lambda v: lin.apply(p, v))(jnp.zeros((rows, K), dtype)))
        return "mosaic" if "jspec_fp8_mosaic" in text else "triton" if "jspec_fp8_mat" in text else "dequantized"

    assert [path(m) for m in (1, 16, 17)] == ["mosaic", "mosaic", "triton"]
    assert path(4, tuning=Tuning(fp8=Fp8Tiles(mosaic_rows=0))) == "triton"
    assert path(4, tuning=Tuning(fp8=Fp8Tiles(mosaic_rows=2))) == "triton"
    assert path(2, tuning=Tuning(fp8=Fp8Tiles(max_rows=1))) == "dequantized"
    assert path(2, dtype="float32") == "triton"
    assert path(2, columns=N - 16) == "triton"
    assert path(2, mode="reference") == "dequantized"
    hopper[0] = False
    assert path(2) == "triton"
    hopper[0] = True
    lin = Linear(N, use_bias=True, dtype="bfloat16")
    with dispatch.use_backend("pallas"):
        y = jax.jit(lambda v: lin.apply(params, v, factor, norm=norm))(x)
    want = reference(rms_norm(x, *norm).astype(jnp.bfloat16), w, scale) * 0.5 + np.asarray(bias, np.float32)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y, np.float32), want, rtol=2e-2, atol=2e-2 * np.abs(want).max())


def test_half_factor_from_exponent_bits():
    """`tiling.half_factor` (the float16 rows of the FP8 kernels and of attention over an FP8
    cache): the smallest power of two that brings a row's largest magnitude under 2^15,
    at least 1, exact next to powers of two (where log2 may misround) and far past float16."""
    import math

    from jspec.kernels.tiling import half_factor

    tops = [0.0, 1e-30, 1.0, 2.0 ** 15 * (1 - 2.0 ** -24), 2.0 ** 15, 2.0 ** 15 * (1 + 2.0 ** -23),
            2.0 ** 16 * (1 - 2.0 ** -24), 2.0 ** 16, 2.0 ** 16 * (1 + 2.0 ** -23), 65504.0, 3e5, 1e30, 3e38]
    want = [2.0 ** max(math.frexp(t)[1] - 1 - 14, 0) if t else 1.0 for t in tops]
    got = np.asarray(half_factor(top=jnp.asarray(tops, jnp.float32)[:, None]))[:, 0]
    np.testing.assert_array_equal(got, np.asarray(want, np.float32))
    assert got[3] == 1 and got[4] == got[6] == 2 and got[7] == 4  # 2^15 and 2^16 take 2 and 4
    assert (np.asarray(tops, np.float32) / got < 2.0 ** 15).all()
    # from the rows, signed, over several tiles (the attention path's queries)
    rows = jnp.asarray([[1.0, -70000.0], [2.0 ** 15, 3.0]], jnp.float32)
    np.testing.assert_array_equal(np.asarray(half_factor(rows[:, :1], rows[:, 1:]))[:, 0], [4.0, 2.0])


@pytest.mark.parametrize("top", [2.0 ** 15 - 128, 2.0 ** 15, 2.0 ** 16 - 256, 2.0 ** 16, 1e30])
def test_rows_next_to_powers_of_two(top):
    # a row whose largest magnitude is just under / at a power of two (bfloat16: 8 bits), or
    # far past float16, with small values (their float16 bits depend on the factor)
    x, w, scale = operands(17, 3)
    x = x.astype(jnp.float32) * jnp.asarray([[1.0], [1e-3], [top / 16.0]])
    x = x.at[2, 7].set(top).at[1, 5].set(-top).astype(jnp.bfloat16)
    y = mosaic.fp8_matmul_mosaic(x, w, scale, float32_out=True, interpret=True, block_n=128, stages=2, num_splits=2)
    ref = reference(x, w, scale)
    assert np.isfinite(np.asarray(y)).all() and np.isfinite(ref).all()
    y, ref = np.asarray(y, np.float64), ref.astype(np.float64)  # float32 norms overflow at 1e30
    assert float(np.linalg.norm(y - ref) / np.linalg.norm(ref)) < 1e-5
    exact = np.asarray(x, np.float32).astype(np.float64) @ (np.asarray(w, np.float32).reshape(K // 128, 128, N)
                                                             * np.asarray(scale)[:, None]).reshape(K, N)
    assert float(np.linalg.norm(y - exact) / np.linalg.norm(exact)) < 1e-3


# ---- one expert a pair (`fp8_pairs_mosaic`, `experts.mosaic_experts`) ----------------------

def expert_stack(seed: int, n: int, k: int = K, cols: int = N):
    k1, k2 = jax.random.split(jax.random.key(seed))
    w = jnp.clip(jax.random.normal(k1, (n, k, cols)) * 100.0, -448, 448).astype(jnp.float8_e4m3fn)
    scale = jax.random.uniform(k2, (n, k // 128, cols), jnp.float32, 0.5, 2.0) / 448.0
    return w, scale


def pairs_exact(x, ids, stacks):
    """Each pair's product in float64 from the exact weights (FP8 value x its group's scale)
    of the concatenated stacks [(w, scale), ...]; a zero row for an id naming no expert."""
    w = np.concatenate([np.asarray(s[0], np.float32) for s in stacks])
    sc = np.concatenate([np.asarray(s[1]) for s in stacks])
    E, Kw, Nw = w.shape
    wf = (w.reshape(E, Kw // 128, 128, Nw) * sc[:, :, None]).reshape(E, Kw, Nw).astype(np.float64)
    xf = np.asarray(x, np.float32).astype(np.float64)
    return np.stack([xf[p] @ wf[e] if 0 <= e < E else np.zeros(Nw) for p, e in enumerate(np.asarray(ids))])


@pytest.mark.parametrize("tiles", [dict(num_splits=1), dict(num_splits=2, block_n=64)])
def test_pairs_equal_exact_products(tiles):
    """Row p = x[p] @ (its expert's FP8 weight x scales), experts from the stack or the extra
    stack (ids E..), a zero row for ids naming no expert (-1, past the extra stack), one split
    (the kernel writes the rows) or two (float32 partial sums); rows past float16's range
    (pairs 1 and 4) times their own factors."""
    w, scale = expert_stack(1, 3)
    extra = expert_stack(2, 1)
    x = (jax.random.normal(jax.random.key(3), (6, K)) * 3.0).astype(jnp.bfloat16)
    x = (x.astype(jnp.float32) * jnp.asarray([1.0, 2.0 ** 18, 1.0, 1.0, 2.0 ** 16, 1.0])[:, None]).astype(jnp.bfloat16)
    ids = jnp.asarray([2, 0, 3, -1, 2, 4], jnp.int32)
    y = mosaic.fp8_pairs_mosaic(x, ids, w, scale, *extra, float32_out=True, interpret=True, stages=2, **tiles)
    want = pairs_exact(x, ids, [(w, scale), extra])
    assert y.shape == (6, N) and y.dtype == jnp.float32
    y = np.asarray(y, np.float64)
    assert (y[[3, 5]] == 0).all()
    for p in (0, 1, 2, 4):
        assert np.linalg.norm(y[p] - want[p]) / np.linalg.norm(want[p]) < 1e-6, p
    # every pair reads its own expert: ids shifted by one are far off
    assert np.linalg.norm(y - pairs_exact(x, (ids + 1) % 4, [(w, scale), extra])) / np.linalg.norm(want) > 0.5
    assert not mosaic.pairs_supported(x, ids, w, scale, extra[0], None)  # extra without its scales
    assert not mosaic.pairs_supported(x, ids[:5], w, scale)  # a row per pair
    assert not mosaic.pairs_supported(x, ids, w[:, :, :96], scale[:, :, :96])  # N not a multiple of 64


def test_moe_experts_dispatch_to_pairs(monkeypatch):
    """`experts.moe_experts` on FP8 stacks runs `mosaic_experts` on a Hopper GPU (faked: the
    kernel interpreted) for at most `ExpertTiles.mosaic_pairs` pairs, not in the row-invariant
    mode (as_tokens) and not for bfloat16 stacks; its output is the expert MLP's (x @ gate_up
    rounded to bfloat16, silu(gate) * up in bfloat16, @ down) from the exact FP8 weights."""
    from jspec.kernels import dispatch
    from jspec.kernels.moe import experts as ex

    D, Fm = K, 128
    gate_up, gu_scale = expert_stack(4, 3, D, 2 * Fm)
    down, down_scale = expert_stack(5, 3, Fm, D)
    sgu, sgu_scale = expert_stack(6, 1, D, 2 * Fm)
    sdown, sdown_scale = expert_stack(7, 1, Fm, D)
    x = (jax.random.normal(jax.random.key(8), (2, D)) * 0.02).astype(jnp.bfloat16)
    ids = jnp.asarray([[2, 0, 3], [1, -1, 3]], jnp.int32)
    args = (x, ids, gate_up, down, (sgu, sdown), 3)
    kw = dict(scales=(gu_scale, down_scale), extra_scales=(sgu_scale, sdown_scale))
    monkeypatch.setattr(mosaic, "on_hopper", lambda: True)

    def path(*a, **k):
        with dispatch.use_backend("pallas"):
            text = str(jax.make_jaxpr(lambda: ex.moe_experts(*a, **k))())
        return "mosaic" if "jspec_fp8_pairs_mosaic" in text else "other"

    assert path(*args, **kw) == "mosaic"
    assert path(*args, **kw, tiles=ex.ExpertTiles(mosaic_pairs=5)) == "other"  # 6 pairs
    assert path(*args, **kw, as_tokens=1) == "other"
    from jspec.quantization import dequantize_kernel
    down_bf16 = jax.vmap(lambda w, s: dequantize_kernel(w, s, jnp.bfloat16))(down, down_scale)
    assert path(x, ids, gate_up, down_bf16, None, 3, scales=(gu_scale, None)) == "other"  # down not FP8
    assert path(x, ids, gate_up, down, None, 3, scales=kw["scales"]) == "mosaic"  # no extra experts
    # a norm of x's dtype (applied first), a row per pair, fewer slots than the table's columns
    assert path(*args, **kw, norm=(jnp.ones((D,), jnp.bfloat16), 1e-6)) == "mosaic"
    assert path(*args, **kw, norm=(jnp.ones((D,), jnp.float32), 1e-6)) == "other"  # float32 rows after it
    assert path(jnp.repeat(x, 3, axis=0), *args[1:], **kw) == "mosaic"
    assert path(x, ids, gate_up, down, None, 2, scales=kw["scales"]) == "mosaic"
    # shapes `routed_experts` refuses are refused here too
    assert not ex.uses_mosaic(x, ids, gate_up, down[:2], None, 3, (gu_scale, down_scale[:2]))  # 3 and 2 experts
    assert not ex.uses_mosaic(x, ids, gate_up, down, (sgu, jnp.concatenate([sdown, sdown])), 3, kw["scales"],
                              (sgu_scale, jnp.concatenate([sdown_scale, sdown_scale])))  # extra: 1 and 2 experts
    assert ex.uses_mosaic(x, ids, gate_up, down, (sgu, sdown), 3, kw["scales"], kw["extra_scales"])
    monkeypatch.setattr(mosaic, "on_hopper", lambda: False)
    assert path(*args, **kw) == "other"
    monkeypatch.setattr(mosaic, "on_hopper", lambda: True)

    with dispatch.use_backend("pallas"):
        y = np.asarray(ex.moe_experts(*args, **kw), np.float64)  # [6, D]
    flat = ids.reshape(-1)
    xs = jnp.repeat(x, 3, axis=0)
    h = jnp.asarray(pairs_exact(xs, flat, [(gate_up, gu_scale), (sgu, sgu_scale)]), jnp.float32).astype(jnp.bfloat16)
    a = ex.silu_mul(h[:, :Fm], h[:, Fm:])
    want = pairs_exact(a, flat, [(down, down_scale), (sdown, sdown_scale)])
    assert (y[4] == 0).all()
    assert np.linalg.norm(y - want) / np.linalg.norm(want) < 1e-2
    assert np.abs(y - want).max() < 2e-2 * np.abs(want).max()
    with dispatch.use_backend("pallas"):  # the first two slots of each token's row
        y2 = np.asarray(ex.moe_experts(x, ids, gate_up, down, (sgu, sdown), 2, **kw), np.float64)
    np.testing.assert_array_equal(y2, y.reshape(2, 3, D)[:, :2].reshape(4, D))


@pytest.mark.skipif(not mosaic.on_hopper(), reason="A from registers and its stores run on a Hopper GPU only")
@pytest.mark.parametrize("tiles", [dict(), dict(num_splits=2), dict(block_n=256), dict(num_splits=4, block_n=64)])
def test_pairs_on_hopper(tiles):
    """On the GPU the pair kernel takes A from registers (`_widen_to_regs`) and writes its
    rows itself (one split) or float32 partial sums (more): each view equals float64
    products of the exact weights (the CPU's interpreter runs only the shared-memory path)."""
    w, scale = expert_stack(31, 5)
    extra = expert_stack(32, 1)
    x = (jax.random.normal(jax.random.key(33), (7, K)) * 3.0).astype(jnp.bfloat16)
    x = x.at[1].multiply(2.0 ** 18).at[6].multiply(2.0 ** 16)  # rows with factors of their own
    ids = jnp.asarray([4, 0, 5, -1, 2, 6, 4], jnp.int32)
    y = np.asarray(mosaic.fp8_pairs_mosaic(x, ids, w, scale, *extra, float32_out=True, **tiles), np.float64)
    want = pairs_exact(x, ids, [(w, scale), extra])
    assert (y[[3, 5]] == 0).all()
    for p in (0, 1, 2, 4, 6):
        assert np.linalg.norm(y[p] - want[p]) / np.linalg.norm(want[p]) < 1e-6, p


def test_rows_bound_from_the_norm():
    """`experts.normed_with_top`: the bound it computes in the norm's pass is at least each
    normed row's largest magnitude and at most 2% over it, rows past float16's range
    included; the kernels take their float16 factors from it (`top=`): the same products as
    from the rows' own maxima, and a bound too small overflows float16 (so it is used)."""
    from jspec.kernels.moe.experts import normed, normed_with_top
    x, w, scale = operands(41, 4)
    x = (x.astype(jnp.float32) * jnp.asarray([1.0, 2.0 ** 20, 1e-3, 1.0])[:, None]).astype(jnp.bfloat16)
    weight = jnp.linspace(-3.0, 2.0 ** 15, K).astype(jnp.bfloat16)  # normed rows reach past float16 (65504)
    norm = (weight, 1e-6)
    xn, top = normed_with_top(x, norm)
    np.testing.assert_array_equal(np.asarray(xn, np.float32), np.asarray(normed(x, norm), np.float32))
    biggest = np.abs(np.asarray(xn, np.float32)).max(axis=1, keepdims=True)
    assert biggest.max() > 65504
    assert (np.asarray(top) >= biggest).all() and (np.asarray(top) <= biggest * 1.02).all()
    y = mosaic.fp8_matmul_mosaic(xn, w, scale, float32_out=True, interpret=True, block_n=128, stages=2,
                                 num_splits=2, top=top)
    assert rel_err(y, reference(xn, w, scale)) < 1e-5
    low = mosaic.fp8_matmul_mosaic(xn, w, scale, float32_out=True, interpret=True, block_n=128, stages=2,
                                   num_splits=2, top=top / 2.0 ** 8)
    assert not np.isfinite(np.asarray(low)).all()
    ws, ss = expert_stack(42, 2)
    ids = jnp.asarray([1, 0, 1, 0], jnp.int32)
    got = np.asarray(mosaic.fp8_pairs_mosaic(xn, ids, ws, ss, float32_out=True, interpret=True, stages=2, top=top),
                     np.float64)
    want = pairs_exact(xn, ids, [(ws, ss)])
    for p in range(4):
        assert np.linalg.norm(got[p] - want[p]) / np.linalg.norm(want[p]) < 1e-6, p
