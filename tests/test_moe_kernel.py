"""The Pallas MoE expert kernel (interpret mode) against the gather reference."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.kernels.moe.experts import ExpertTiles
from jspec.kernels import dispatch
from jspec.kernels.moe import experts as me


def _case(seed, *, E, Din, Dout, P, dtype, ids=None):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((P, Din)), dtype)
    w = jnp.asarray(rng.standard_normal((E, Din, Dout)) / np.sqrt(Din), dtype)
    if ids is None:
        ids = rng.integers(0, E, P)
    return x, jnp.asarray(ids, jnp.int32), w


@pytest.mark.parametrize("E,Din,Dout,P,dtype,ids,tiles", [
    # repeated experts, Dout 96 = a 64-column tile and an overlapping last one
    (8, 64, 96, 7, jnp.float32, [3, 3, 0, 7, 3, 1, 7], {}),
    # one pair; Din 80 not a multiple of the 32-row chunk; two K splits
    (8, 80, 96, 1, jnp.float32, [5], dict(block_k=32, num_splits=2)),
    # bfloat16, 16-row chunks over four K splits (uneven), 32-column tiles
    (4, 112, 48, 7, jnp.bfloat16, [0, 1, 2, 3, 3, 2, 0], dict(block_k=16, block_n=32, num_splits=4)),
])
def test_expert_matmul_matches_reference(E, Din, Dout, P, dtype, ids, tiles):
    x, ids, w = _case(0, E=E, Din=Din, Dout=Dout, P=P, dtype=dtype, ids=ids)
    got = me.expert_matmul(x, ids, w, interpret=True, **tiles)
    assert got.shape == (P, Dout) and got.dtype == jnp.float32
    # float32 products of the same inputs either way: only the summation order differs
    np.testing.assert_allclose(np.asarray(got), np.asarray(me.expert_matmul_reference(x, ids, w)),
                               rtol=1e-5, atol=1e-5)


def test_ids_naming_no_expert_give_zeros():
    """An id outside [0, E + E2) (expert parallelism: another device's expert) gives a zero
    row in the kernel and the references; the other pairs are untouched."""
    x, _, w = _case(1, E=4, Din=32, Dout=32, P=4, dtype=jnp.float32)
    ids = jnp.asarray([-1, 2, 9, 0], jnp.int32)
    got = np.asarray(me.expert_matmul(x, ids, w, interpret=True))
    want = np.asarray(me.expert_matmul_reference(x, ids, w))
    assert not got[[0, 2]].any() and not want[[0, 2]].any()
    np.testing.assert_allclose(got[[1, 3]], np.asarray(me.expert_matmul_reference(x[np.array([1, 3])], ids[np.array([1, 3])], w)),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    gate_up, down = w, w[:, :16, :]
    extra = (gate_up[:1], down[:1])  # id 4 names the extra expert, 5 names none
    table = jnp.asarray([[4, -3], [5, 1]], jnp.int32)
    y = np.asarray(me.routed_experts(x[:2], table, gate_up, down, extra, interpret=True))
    ref = np.asarray(me.routed_experts_reference(x[:2], table, gate_up, down, extra))
    assert not y[[1, 2]].any() and y[[0, 3]].any()
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)


def test_extra_experts_follow_the_stacked_ones():
    """ids E.. name the experts of `extra` (DeepSeek's shared experts): the kernel equals the
    reference over the concatenated stack, product by product and for the routed chain;
    the reference's two-array gather equals its gather from one array."""
    E, E2, D, Fm = 4, 2, 64, 48
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((6, D)), jnp.float32)
    ids = jnp.asarray([5, 0, 4, 3, 5, 1], jnp.int32)
    gu = [jnp.asarray(rng.standard_normal((n, D, 2 * Fm)) / 8, jnp.float32) for n in (E, E2)]
    dn = [jnp.asarray(rng.standard_normal((n, Fm, D)) / 7, jnp.float32) for n in (E, E2)]
    got = me.expert_matmul(x, ids, gu[0], gu[1], interpret=True)
    want = me.expert_matmul_reference(x, ids, jnp.concatenate(gu))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    whole = np.asarray(me.routed_experts_reference(x, ids, jnp.concatenate(gu), jnp.concatenate(dn)))
    np.testing.assert_allclose(np.asarray(me.routed_experts_reference(x, ids, gu[0], dn[0], (gu[1], dn[1]))),
                               whole, rtol=1e-6, atol=1e-6)
    got = me.routed_experts(x, ids, gu[0], dn[0], (gu[1], dn[1]), interpret=True)
    np.testing.assert_allclose(np.asarray(got), whole, rtol=1e-5, atol=1e-5 * np.abs(whole).max())
    with pytest.raises(ValueError, match="extra experts"):
        me.expert_matmul(x, ids, gu[0], gu[1][:, :32], interpret=True)


@pytest.mark.parametrize("din_min,first_bn", [(64, 32), (128, None)])
def test_one_token_tiles(monkeypatch, din_min, first_bn):
    """One token: the second product takes `gated_block_n`-wide tiles, the first one too
    from `narrow_first_min_din` inputs on (D 64 here); both equal the reference (Fm 40: 80
    columns, an overlapping last tile of 32)."""
    tiles = ExpertTiles(gated_block_n=32, narrow_first_min_din=din_min)
    seen, matmul = [], me.expert_matmul
    monkeypatch.setattr(me, "expert_matmul", lambda *a, **kw: seen.append(kw.get("block_n")) or matmul(*a, **kw))
    E, D, Fm = 6, 64, 40
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((1, D)), jnp.float32)
    ids = jnp.asarray([[4, 1, 5]], jnp.int32)
    gate_up = jnp.asarray(rng.standard_normal((E, D, 2 * Fm)) / 8, jnp.float32)
    down = jnp.asarray(rng.standard_normal((E, Fm, D)) / 7, jnp.float32)
    got = me.routed_experts(x, ids, gate_up, down, interpret=True, tiles=tiles)
    assert seen == [first_bn, 32]
    want = np.asarray(me.routed_experts_reference(x, ids, gate_up, down))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_tiles_set_the_splits_and_the_row_products():
    """`ExpertTiles` sets the kernel's default K splits (enough programs for
    `target_programs`, each walking at least `min_split_chunks` chunks), `matvec`'s tiles,
    and which few-row products `uses_matvec` takes."""
    from test_kernels import pallas_grids
    x, ids, w = _case(0, E=4, Din=512, Dout=64, P=2, dtype=jnp.float32)

    def grid(**kw):
        return pallas_grids(lambda x, ids, w: me.expert_matmul(x, ids, w, interpret=True, **kw), x, ids, w)

    assert grid() == [(2, 1, 2)]  # 8 chunks of 64 rows, at least 4 a split: 2 splits
    assert grid(tiles=ExpertTiles(min_split_chunks=1)) == [(2, 1, 8)]
    assert grid(tiles=ExpertTiles(min_split_chunks=1, target_programs=4)) == [(2, 1, 2)]
    assert grid(tiles=ExpertTiles(block_n=32, block_k=128)) == [(2, 2, 1)]
    assert grid(tiles=ExpertTiles(block_n=32), block_n=16, num_splits=3) == [(2, 4, 3)]  # keywords win
    row, w2 = x[:1], w[0]
    with dispatch.use_backend("pallas"):
        assert pallas_grids(lambda x, w: me.matvec(x, w, interpret=True), row, w2) == [(1, 1, 8)]
        tiles = ExpertTiles(matvec_block_n=16, matvec_splits=2)
        assert pallas_grids(lambda x, w: me.matvec(x, w, interpret=True, tiles=tiles), row, w2) == [(1, 4, 2)]
        assert me.uses_matvec(row, w2) and not me.uses_matvec(x, w2)  # one row, by default
        assert me.uses_matvec(x, w2, ExpertTiles(matvec_max_rows=2))
        assert not me.uses_matvec(row, w2, ExpertTiles(matvec_max_rows=0))
        small = ExpertTiles(matvec_max_elements=w2.size)
        assert not me.uses_matvec(row, w2, small) and me.uses_matvec(row, w2, small, any_size=True)
    np.testing.assert_allclose(np.asarray(me.matvec(row, w2, interpret=True, tiles=tiles)), np.asarray(row @ w2),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)])
def test_routed_experts_matches_reference(dtype, tol):
    """k = 3 experts for each of 2 tokens (pair n*k + j: token n), an expert shared by
    both tokens; D 64, Fm 48 (gate_up 96 columns: an overlapping tile)."""
    E, D, Fm, k = 8, 64, 48, 3
    rng = np.random.default_rng(2)
    xs = jnp.asarray(rng.standard_normal((2, D)), dtype)
    pairs = jnp.repeat(xs, k, axis=0)
    ids = jnp.asarray([1, 6, 4, 6, 0, 2], jnp.int32)
    gate_up = jnp.asarray(rng.standard_normal((E, D, 2 * Fm)) / np.sqrt(D), dtype)
    down = jnp.asarray(rng.standard_normal((E, Fm, D)) / np.sqrt(Fm), dtype)
    want = np.asarray(me.routed_experts_reference(pairs, ids, gate_up, down))
    got = me.routed_experts(pairs, ids, gate_up, down, interpret=True)
    assert got.shape == (6, D) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=tol, atol=tol * np.abs(want).max())

    # the dispatch: the reference on CPU ("auto"), the kernel in interpret mode when forced
    assert not me.uses_kernel(pairs, ids, gate_up, down) or jax.default_backend() == "gpu"
    with dispatch.use_backend("reference"):
        np.testing.assert_array_equal(np.asarray(me.moe_experts(pairs, ids, gate_up, down)), want)
    with dispatch.use_backend("pallas"):
        assert me.uses_kernel(pairs, ids, gate_up, down)
        np.testing.assert_array_equal(np.asarray(me.moe_experts(pairs, ids, gate_up, down)), np.asarray(got))


def test_routing_table_with_token_rows():
    """A routing table [N, KP] of which the first `slots` columns are used (the rest is
    padding, here out-of-range ids that must not be read) and x with a row per token: the
    kernel equals the reference over the pairs it spells out, product by product and for
    the routed chain (whose second product takes the first one's K splits, gated)."""
    E, D, Fm, N, slots = 8, 64, 48, 3, 3
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((N, D)), jnp.float32)
    table = jnp.asarray([[1, 6, 4, 99], [6, 0, 2, -5], [7, 7, 3, 99]], jnp.int32)
    pairs, pair_ids = me.pairs_of(x, table, slots)
    np.testing.assert_array_equal(np.asarray(pair_ids), [1, 6, 4, 6, 0, 2, 7, 7, 3])
    np.testing.assert_array_equal(np.asarray(pairs[4]), np.asarray(x[1]))
    gate_up = jnp.asarray(rng.standard_normal((E, D, 2 * Fm)) / np.sqrt(D), jnp.float32)
    down = jnp.asarray(rng.standard_normal((E, Fm, D)) / np.sqrt(Fm), jnp.float32)
    got = me.expert_matmul(x, table, gate_up, slots=slots, interpret=True)
    np.testing.assert_allclose(np.asarray(got), np.asarray(me.expert_matmul_reference(pairs, pair_ids, gate_up)),
                               rtol=1e-5, atol=1e-5)
    h = me.expert_matmul(x, table, gate_up, slots=slots, sum_splits=False, num_splits=2, block_k=16,
                         interpret=True)
    assert h.shape == (2, N * slots, 2 * Fm)
    gated = me.expert_matmul(h, table, down, slots=slots, gated=jnp.float32, interpret=True)
    a = me.silu_mul(h.sum(0)[:, :Fm], h.sum(0)[:, Fm:])
    np.testing.assert_allclose(np.asarray(gated), np.asarray(me.expert_matmul_reference(a, pair_ids, down)),
                               rtol=1e-5, atol=1e-5)
    want = np.asarray(me.routed_experts_reference(pairs, pair_ids, gate_up, down))
    np.testing.assert_allclose(np.asarray(me.routed_experts_reference(x, table, gate_up, down, slots=slots)),
                               want, rtol=1e-6, atol=1e-6)
    got = me.routed_experts(x, table, gate_up, down, slots=slots, interpret=True)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    # a wrong routing (the padding column used) gives something else
    wrong = me.routed_experts_reference(x, jnp.clip(table[:, 1:], 0, E - 1), gate_up, down, slots=slots)
    assert np.abs(np.asarray(wrong) - want).max() > 1e-2


def test_validation():
    x, ids, w = _case(3, E=4, Din=32, Dout=32, P=3, dtype=jnp.float32)
    with pytest.raises(ValueError, match="x has 3 rows for 2 tokens x 1 slots"):
        me.expert_matmul(x, ids[:2], w, interpret=True)
    table = jnp.zeros((3, 4), jnp.int32)
    with pytest.raises(ValueError, match="slots must be an int in \\[1, 4\\]"):
        me.expert_matmul(x, table, w, slots=5, interpret=True)
    with pytest.raises(ValueError, match="routing table"):
        me.expert_matmul(x, table[None], w, interpret=True)
    with pytest.raises(ValueError, match="gated x must be float32"):
        me.expert_matmul(x[None], ids, w, gated=jnp.float32, interpret=True)
    with pytest.raises(TypeError, match="gated must be"):
        me.expert_matmul(jnp.zeros((1, 3, 64)), ids, w, gated=jnp.int32, interpret=True)
    with pytest.raises(ValueError, match="weights take 32 inputs, x has 16"):
        me.expert_matmul(x[:, :16], ids, w, interpret=True)
    with pytest.raises(TypeError, match="ids must be integer"):
        me.expert_matmul(x, ids.astype(jnp.float32), w, interpret=True)
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        me.expert_matmul(x, ids, w, block_n=48, interpret=True)
    with pytest.raises(ValueError, match=">= 16"):
        me.expert_matmul(x[:, :8], ids, w[:, :8], interpret=True)
    gate_up, down = jnp.zeros((4, 32, 64)), jnp.zeros((4, 32, 16))
    with pytest.raises(ValueError, match="does not match gate_up"):
        me.routed_experts(x, ids, gate_up, down, interpret=True)
    assert not me.is_supported(x, ids, gate_up, down)
    assert me.is_supported(x, ids, gate_up, jnp.zeros((4, 32, 32)))
    with dispatch.use_backend("pallas"), pytest.raises(ValueError, match="does not match gate_up"):
        me.moe_experts(x, ids, gate_up, down)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_kernel_activation_rounds_as_the_reference(dtype):
    """The gated product's silu(gate) * up, computed in float32 with each operation
    rounded to the activations' dtype, is bit for bit jax's own on arrays of that dtype."""
    rng = np.random.default_rng(11)
    g = jnp.asarray(rng.standard_normal(1 << 14) * 3, dtype)
    u = jnp.asarray(rng.standard_normal(1 << 14), dtype)
    want = np.asarray(jax.jit(me.silu_mul)(g, u).astype(jnp.float32))
    got = np.asarray(jax.jit(lambda g, u: me.silu_mul_float32(g.astype(jnp.float32), u.astype(jnp.float32),
                                                               dtype))(g, u))
    np.testing.assert_array_equal(got, want)


def test_routed_experts_norm_prologue():
    """routed_experts(norm=...) norms the tokens in the first product's prologue: equal to
    the reference on RMS-normed rows (also through the dispatch `moe_experts`), unlike the
    unnormed rows'; a norm weight of another dtype is applied before the kernel."""
    rng = np.random.default_rng(3)
    E, D, Fm, N = 4, 64, 32, 2
    x = jnp.asarray(rng.standard_normal((N, D)) * 4, jnp.float32)
    gate_up = jnp.asarray(rng.standard_normal((E, D, 2 * Fm)) / 8, jnp.float32)
    down = jnp.asarray(rng.standard_normal((E, Fm, D)) / 6, jnp.float32)
    ids = jnp.asarray([[2, 0], [1, 3]], jnp.int32)
    norm = (jnp.asarray(rng.uniform(0.5, 1.5, D), jnp.float32), 1e-6)
    want = np.asarray(me.routed_experts_reference(me.rms_norm(x, *norm), ids, gate_up, down))
    got = np.asarray(me.routed_experts(x, ids, gate_up, down, norm=norm, interpret=True))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    for mode in ("reference", "pallas"):
        with dispatch.use_backend(mode):
            np.testing.assert_allclose(np.asarray(me.moe_experts(x, ids, gate_up, down, norm=norm)), want,
                                       rtol=1e-4, atol=1e-5)
    half = (norm[0].astype(jnp.bfloat16), norm[1])
    np.testing.assert_allclose(np.asarray(me.routed_experts(x, ids, gate_up, down, norm=half, interpret=True)),
                               np.asarray(me.routed_experts_reference(me.rms_norm(x, *half), ids, gate_up, down)),
                               rtol=1e-4, atol=1e-5)
    assert not np.allclose(got, np.asarray(me.routed_experts_reference(x, ids, gate_up, down)), rtol=1e-2)


@pytest.mark.parametrize("dtype,Din,tiles", [
    (jnp.float32, 80, dict(block_k=32, num_splits=2)),  # a last chunk overlapping its neighbour
    (jnp.bfloat16, 128, dict(block_k=32, num_splits=3)),
])
def test_expert_matmul_norm_prologue(dtype, Din, tiles):
    """norm=(weight, eps): the kernel RMS-norms each row first, as `rms_norm` (the models'
    RMSNorm) does, rounding included; without the norm the result differs."""
    rng = np.random.default_rng(9)
    x = jnp.asarray(rng.standard_normal((3, Din)) * 3, dtype)
    w = jnp.asarray(rng.standard_normal((2, Din, 48)) / np.sqrt(Din), dtype)
    weight = jnp.asarray(rng.uniform(0.5, 1.5, Din), dtype)
    ids = jnp.asarray([1, 0, 1], jnp.int32)
    got = np.asarray(me.expert_matmul(x, ids, w, norm=(weight, 1e-6), interpret=True, **tiles))
    want = np.asarray(me.expert_matmul_reference(me.rms_norm(x, weight, 1e-6), ids, w))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(me.expert_matmul_reference(x, ids, w, norm=(weight, 1e-6))), want,
                               rtol=1e-6, atol=1e-6)
    assert not np.allclose(got, np.asarray(me.expert_matmul_reference(x, ids, w)), rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match="norm weight"):
        me.expert_matmul(x, ids, w, norm=(weight[:-1], 1e-6), interpret=True)
    with pytest.raises(ValueError, match="eps"):
        me.expert_matmul(x, ids, w, norm=(weight, -1.0), interpret=True)


def test_fp8_stacks_past_int32_offsets_refused(monkeypatch):
    """Pallas' Triton lowering indexes arrays of at most 2^32 bytes with signed 32-bit
    offsets, so an FP8 stack of 2^31 to 2^32 elements (DeepSeek-V3's 256 down experts) would
    be read at wrapped offsets: the Triton expert and attention kernels refuse such arrays
    (their dispatch takes the reference, or on Hopper the Mosaic pair kernel); the grouped
    kernel reads FP8 ones as uint16 pairs (`grouped.pair_view`) and refuses them otherwise."""
    from types import SimpleNamespace

    from jspec.kernels.attention import decode
    from jspec.kernels.moe import grouped
    from jspec.kernels.tiling import wraps_triton_offsets

    S = jax.ShapeDtypeStruct
    f8 = jnp.float8_e4m3fn
    down = S((256, 2048, 7168), f8)  # 3.76e9 elements, 3.76 GB
    assert wraps_triton_offsets(down)
    assert not wraps_triton_offsets(S((256, 7168, 4096), f8))  # past 2^32 bytes: 64-bit offsets
    assert not wraps_triton_offsets(S((256, 2048, 7168), jnp.bfloat16))  # 7.5 GB: 64-bit
    assert not wraps_triton_offsets(S((146, 2048, 7168), f8))  # under 2^31 elements
    assert wraps_triton_offsets(S((512, 4096, 2048), f8))  # exactly 2^32 bytes: still 32-bit
    gate_up = S((256, 7168, 4096), f8)
    scales = (S((256, 56, 4096), jnp.float32), S((256, 16, 7168), jnp.float32))
    x, ids = S((1, 7168), jnp.bfloat16), S((1, 9), jnp.int32)
    assert not me.is_supported(x, ids, gate_up, down, scales=scales)
    fewer = (S((64, 7168, 4096), f8), S((64, 2048, 7168), f8))  # 1.9e9 and 0.9e9 elements
    fewer_scales = (S((64, 56, 4096), jnp.float32), S((64, 16, 7168), jnp.float32))
    assert me.is_supported(x, ids, *fewer, scales=fewer_scales)
    rows, table = S((4096, 7168), jnp.bfloat16), S((4096, 8), jnp.int32)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # the dispatch as on a GPU
    with dispatch.use_backend("auto"):  # the grouped kernel reads such FP8 stacks through `pair_view`
        assert grouped.uses_kernel(rows, table, gate_up, down, scales=scales)
        assert grouped.uses_kernel(rows, table, *fewer, scales=fewer_scales)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="32-bit offsets"):
        grouped.grouped_matmul(S((4096, 2048), jnp.bfloat16), S((256,), jnp.int32), down, block_m=16,
                               w_scale=scales[1], paired=False)
    with pytest.raises(ValueError, match="32-bit offsets"):  # an FP8 pool of 2^32 bytes
        decode.check_attention_args(S((1, 1, 8, 128), jnp.bfloat16), S((2 ** 20, 16, 2, 1, 128), f8),
                                    SimpleNamespace(prefill=False), 0)
