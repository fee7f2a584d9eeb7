"""The grouped expert kernel for MoE prefill (`jspec.kernels.moe.grouped`, interpret mode):
the padded layout, the tile products against their reference, the routed experts against
the `ragged_dot` formulation, the dispatch's threshold, and a DeepSeek prefill through
it against transformers."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jspec
from jspec.tuning import DEFAULT_TUNING
from jspec.kernels.moe.grouped import GroupedTiles
from jspec.kernels import dispatch
from jspec.kernels.moe import grouped as mg


@pytest.mark.parametrize("seed,P,E,bm", [(0, 10, 6, 16), (1, 40, 4, 16), (2, 300, 8, 32), (3, 5, 64, 16)])
def test_group_layout(seed, P, E, bm):
    """Every pair gets its own row inside a tile of its expert; tiles past the groups are -1;
    each expert's tiles are as few as its pairs need."""
    flat = np.random.RandomState(seed).randint(0, E, P)
    rows, tiles = (np.asarray(a) for a in mg.group_layout(jnp.asarray(flat), E, bm))
    R = mg.padded_rows(P, E, bm)
    assert tiles.shape == (R // bm,) and R % bm == 0
    assert len(set(rows.tolist())) == P and rows.min() >= 0 and rows.max() < R
    np.testing.assert_array_equal(tiles[rows // bm], flat)  # each pair's tile belongs to its expert
    sizes = np.bincount(flat, minlength=E)
    used = -(-sizes // bm)
    for e in range(E):
        assert (tiles == e).sum() == used[e]
    assert (tiles[used.sum():] == -1).all() and (tiles[:used.sum()] >= 0).all()


def test_pairs_of_no_expert_get_zeros():
    """Ids outside [0, E) (expert parallelism: another device's experts) take rows after
    the last group, in tiles the kernel skips, and give zeros; the other pairs equal the
    routing without them."""
    E, D, Fm, bm = 4, 32, 16, 16
    key = jax.random.key(3)
    xs = jax.random.normal(key, (6, D), jnp.float32)
    gate_up = jax.random.normal(jax.random.fold_in(key, 1), (E, D, 2 * Fm), jnp.float32) / 6
    down = jax.random.normal(jax.random.fold_in(key, 2), (E, Fm, D), jnp.float32) / 4
    ids = jnp.asarray([[0, -1], [3, 7], [4, 2], [1, 1], [-2, 0], [2, 3]], jnp.int32)
    rows, tiles = (np.asarray(a) for a in mg.group_layout(ids.reshape(-1), E, bm))
    named = (np.asarray(ids).reshape(-1) >= 0) & (np.asarray(ids).reshape(-1) < E)
    assert len(set(rows.tolist())) == ids.size and (tiles[rows[~named] // bm] == -1).all()
    np.testing.assert_array_equal(tiles[rows[named] // bm], np.asarray(ids).reshape(-1)[named])
    want = np.asarray(mg.grouped_experts_reference(xs, jnp.clip(ids, 0, E - 1), gate_up, down))
    for got in (mg.grouped_experts_reference(xs, ids, gate_up, down),
                mg.grouped_experts(xs, ids, gate_up, down, block_m=bm, interpret=True)):
        got = np.asarray(got)
        assert not got[~named].any()
        np.testing.assert_allclose(got[named], want[named], rtol=1e-5, atol=1e-5)


def _scatter_shapes(fn, *args) -> list:
    """The output shapes of every scatter in fn's jaxpr (nested jaxprs too)."""
    shapes = []

    def walk(jaxpr):
        for e in jaxpr.eqns:
            if e.primitive.name.startswith("scatter"):
                shapes.append(tuple(e.outvars[0].aval.shape))
            for v in e.params.values():
                for sub in v if isinstance(v, (list, tuple)) else (v,):
                    sub = getattr(sub, "jaxpr", sub)
                    if hasattr(sub, "eqns"):
                        walk(sub)
    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return shapes


def test_tokens_are_laid_out_and_put_back_by_gathers():
    """The padded layout's tokens and the pairs put back in order are gathers through [R]
    or [P] index maps, never scatters into zero-filled [R, D] or [P, D] buffers, which XLA
    fused over a program's layers into one kernel whose buffers were all live at once (a
    32 x 1,024-token prompt pass through 48 MoE layers needed 82 GB); the values are the
    scatter's."""
    E, D, Fm, bm, N, k = 4, 32, 16, 16, 9, 2
    key = jax.random.key(5)
    xs = jax.random.normal(key, (N, D), jnp.float32)
    gate_up = jax.random.normal(jax.random.fold_in(key, 1), (E, D, 2 * Fm), jnp.float32) / 6
    down = jax.random.normal(jax.random.fold_in(key, 2), (E, Fm, D), jnp.float32) / 4
    ids = jax.random.randint(jax.random.fold_in(key, 3), (N, k), -1, E)
    kernel = lambda *a: mg.grouped_experts(*a, block_m=bm, interpret=True)  # noqa: E731
    for fn in (kernel, mg.grouped_experts_reference):
        assert all(len(s) == 1 for s in _scatter_shapes(fn, xs, ids, gate_up, down)), fn
    rows, _ = mg.group_layout(ids.reshape(-1), E, bm)
    R = mg.padded_rows(N * k, E, bm)
    scattered = jnp.zeros((R, D), xs.dtype).at[rows].set(jnp.repeat(xs, k, axis=0))
    np.testing.assert_array_equal(np.asarray(mg.padded_tokens(xs, rows, k, R)), np.asarray(scattered))
    perm = jax.random.permutation(jax.random.fold_in(key, 4), 20)
    h = jax.random.normal(key, (20, 3))
    np.testing.assert_array_equal(np.asarray(h[mg.inverse(perm)]), np.asarray(jnp.zeros_like(h).at[perm].set(h)))


@pytest.mark.parametrize("dtype,Din,Dout,tiles", [
    (jnp.float32, 64, 48, dict(block_n=32, block_k=16)),  # Dout overlaps its last block
    (jnp.float32, 40, 64, dict(block_n=64, block_k=32)),  # Din overlaps its last chunk
    (jnp.bfloat16, 64, 64, dict(block_n=32, block_k=32)),
])
def test_grouped_matmul_matches_reference(dtype, Din, Dout, tiles):
    key = jax.random.key(0)
    E, bm = 3, 16
    x = jax.random.normal(key, (4 * bm, Din)).astype(dtype)
    w = jax.random.normal(jax.random.fold_in(key, 1), (E, Din, Dout)).astype(dtype)
    tile_expert = jnp.asarray([2, 0, 2, -1], jnp.int32)
    got = np.asarray(mg.grouped_matmul(x, tile_expert, w, block_m=bm, interpret=True, **tiles), np.float32)
    want = np.asarray(mg.grouped_matmul_reference(x, tile_expert, w, bm), np.float32)
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(got[:3 * bm], want[:3 * bm], rtol=tol, atol=tol)  # the -1 tile is unwritten
    wrong = np.asarray(mg.grouped_matmul_reference(x, jnp.asarray([0, 0, 2, -1]), w, bm), np.float32)
    assert not np.allclose(got[:bm], wrong[:bm], rtol=0.1, atol=0.1)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("N,bm,tiles", [(9, 16, None), (40, 32, GroupedTiles(block_n=32, block_k=16))])
def test_grouped_experts_match_ragged_dot(dtype, tol, N, bm, tiles):
    """The routed experts of N tokens x k experts through the kernel (default tiles, or a
    tuning's: overlapping last blocks) equal the ragged_dot formulation (pairs in
    token-major order), and not the experts of other ids."""
    E, D, Fm, k = 5, 48, 40, 3
    key = jax.random.key(N)
    gate_up = (jax.random.normal(key, (E, D, 2 * Fm)) / np.sqrt(D)).astype(dtype)
    down = (jax.random.normal(jax.random.fold_in(key, 1), (E, Fm, D)) / np.sqrt(Fm)).astype(dtype)
    xs = jax.random.normal(jax.random.fold_in(key, 2), (N, D)).astype(dtype)
    ids = jnp.asarray(np.stack([np.random.RandomState(N + n).permutation(E)[:k] for n in range(N)]), jnp.int32)
    got = np.asarray(mg.grouped_experts(xs, ids, gate_up, down, block_m=bm, tiles=tiles, interpret=True), np.float32)
    want = np.asarray(mg.grouped_experts_reference(xs, ids, gate_up, down), np.float32)
    assert got.shape == (N * k, D)
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= tol * scale
    other = np.asarray(mg.grouped_experts_reference(xs, (ids + 1) % E, gate_up, down), np.float32)
    assert np.abs(got - other).max() > 0.1 * scale


def test_validation():
    x = jnp.zeros((32, 16), jnp.float32)
    w = jnp.zeros((2, 16, 16), jnp.float32)
    tiles = jnp.zeros((2,), jnp.int32)
    with pytest.raises(ValueError, match="block_m"):
        mg.grouped_matmul(x, tiles, w, block_m=24, interpret=True)
    with pytest.raises(ValueError, match="block_m"):
        mg.grouped_matmul(x[:24], tiles, w, block_m=16, interpret=True)
    with pytest.raises(ValueError, match="tile_expert"):
        mg.grouped_matmul(x, tiles[:1], w, block_m=16, interpret=True)
    with pytest.raises(ValueError, match="tile_expert"):
        mg.grouped_matmul(x, tiles.astype(jnp.float32), w, block_m=16, interpret=True)
    with pytest.raises(ValueError, match="Din"):
        mg.grouped_matmul(x, tiles, w[:, :8], block_m=16, interpret=True)
    with pytest.raises(TypeError, match="differ"):
        mg.grouped_matmul(x, tiles, w.astype(jnp.bfloat16), block_m=16, interpret=True)
    with pytest.raises(ValueError, match="power of two"):
        mg.grouped_matmul(x, tiles, w, block_m=16, block_n=24, interpret=True)


def test_dispatch_threshold(monkeypatch):
    """On a GPU the kernel runs from `min_pairs_per_expert` pairs an expert on (1: from E
    pairs); on the CPU only when forced; `kernel` False keeps ragged_dot. Tiles of 16 rows,
    64 from 16 pairs an expert on."""
    E, D, Fm = 8, 32, 16
    gate_up, down = jnp.zeros((E, D, 2 * Fm), jnp.bfloat16), jnp.zeros((E, Fm, D), jnp.bfloat16)
    xs = jnp.zeros((64, D), jnp.bfloat16)
    assert DEFAULT_TUNING.grouped.min_pairs_per_expert == 1  # the kernel from E pairs on
    few, many = jnp.zeros((3, 2), jnp.int32), jnp.zeros((4, 2), jnp.int32)  # 6 and 8 pairs
    assert not mg.uses_kernel(xs, many, gate_up, down)  # the CPU
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert mg.uses_kernel(xs, many, gate_up, down) and not mg.uses_kernel(xs, few, gate_up, down)
    assert not mg.uses_kernel(xs.astype(jnp.float32), many, gate_up, down)  # mixed dtypes
    four = GroupedTiles(min_pairs_per_expert=4)
    assert not mg.uses_kernel(xs, many, gate_up, down, four) and mg.uses_kernel(
        xs, jnp.zeros((16, 2), jnp.int32), gate_up, down, four)
    assert not mg.uses_kernel(xs, many, gate_up, down, GroupedTiles(kernel=False))
    assert mg.block_rows(16 * E - 1, E) == 16 and mg.block_rows(16 * E, E) == 64
    tiles = GroupedTiles(small_block_m=32, large_block_m=128, large_from_pairs_per_expert=2)
    assert mg.block_rows(2 * E - 1, E, tiles) == 32 and mg.block_rows(2 * E, E, tiles) == 128


def test_prefill_through_the_kernel_equals_transformers(monkeypatch, fresh_compiles, tmp_path):
    """A DeepSeek-V3 prefill with the kernels forced (interpret mode): the MoE layers'
    routed experts go through `grouped_experts`; logits equal transformers' (float32)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                           num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1, n_routed_experts=4,
                           num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1, kv_lora_rank=16,
                           q_lora_rank=None, qk_rope_head_dim=8, v_head_dim=8, qk_nope_head_dim=8,
                           num_hidden_layers=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(cfg).eval()
    model.save_pretrained(str(tmp_path))
    toks = np.random.RandomState(2).randint(0, 96, (2, 9))
    with torch.no_grad():
        want = model(torch.tensor(toks)).logits.numpy()
    calls = []
    real = mg.grouped_experts
    monkeypatch.setattr(mg, "grouped_experts", lambda *a, **k: calls.append(a[1].shape) or real(*a, **k))
    monkeypatch.setenv("JSPEC_KERNELS", "pallas")
    got = np.asarray(jspec.logits(jspec.load(str(tmp_path), dtype="float32"), toks.tolist()))
    assert calls == [(18, 2)]  # one MoE layer: 2 x 9 tokens, 2 experts each
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


def test_fp8_stack_through_the_paired_view(monkeypatch):
    """An FP8 stack read as uint16 pairs of columns (`pair_view`, what a stack whose own
    offsets would wrap takes: DeepSeek-V3's 256 down experts on one device) gives the plain
    view's products, even columns from the low bytes, odd from the high, their scales with
    them; the uneven last column block overlaps as on the plain view."""
    from jspec.quantization import quantize_kernel

    E, Din, Dout, bm = 3, 256, 192, 16
    quantized = [quantize_kernel(jax.random.normal(k, (Din, Dout)) * 0.05) for k in jax.random.split(jax.random.key(0), E)]
    w, scale = jnp.stack([q for q, _ in quantized]), jnp.stack([s for _, s in quantized])
    x = jax.random.normal(jax.random.key(1), (4 * bm, Din)).astype(jnp.bfloat16)
    tile_expert = jnp.asarray([2, 0, 1, -1], jnp.int32)
    pair = mg.pair_view(w)
    assert pair.shape == (E, Din, Dout // 2) and pair.dtype == jnp.uint16
    low = jax.lax.bitcast_convert_type((pair & 0xFF).astype(jnp.uint8), jnp.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(low, np.float32), np.asarray(w[:, :, 0::2], np.float32))
    kw = dict(block_m=bm, w_scale=scale, interpret=True)
    plain = np.asarray(mg.grouped_matmul(x, tile_expert, w, paired=False, **kw), np.float32)
    paired = np.asarray(mg.grouped_matmul(x, tile_expert, w, paired=True, **kw), np.float32)
    np.testing.assert_array_equal(paired[:3 * bm], plain[:3 * bm])
    swapped = np.asarray(mg.grouped_matmul(x, tile_expert, w[:, :, ::-1], paired=True, **kw), np.float32)
    assert np.abs(swapped[:3 * bm] - plain[:3 * bm]).max() > 0.1 * np.abs(plain[:3 * bm]).max()  # columns matter
    narrow = np.asarray(mg.grouped_matmul(x, tile_expert, w, paired=True, block_n=16, **kw), np.float32)
    np.testing.assert_allclose(narrow[:3 * bm], plain[:3 * bm], rtol=1e-6, atol=1e-6)  # halves of 16 columns at least
    # the view is taken by itself where the stack's own offsets would wrap (faked for this small stack)
    monkeypatch.setattr(mg, "wraps_triton_offsets", lambda a: jnp.dtype(a.dtype) == jnp.dtype(jnp.float8_e4m3fn))
    chosen = jax.make_jaxpr(lambda v: mg.grouped_matmul(v, tile_expert, w, **kw))(x)
    assert "u16" in str(chosen)
    np.testing.assert_array_equal(np.asarray(mg.grouped_matmul(x, tile_expert, w, **kw), np.float32)[:3 * bm],
                                  plain[:3 * bm])
    e5m2 = w.astype(jnp.float32).astype(jnp.float8_e5m2)  # not pairable: refused where it would wrap
    monkeypatch.setattr(mg, "wraps_triton_offsets", lambda a: True)
    assert not mg.pairable(e5m2)
    rows, table = jax.ShapeDtypeStruct((64, Din), jnp.bfloat16), jax.ShapeDtypeStruct((64, 2), jnp.int32)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # the dispatch as on a GPU
    with dispatch.use_backend("auto"):
        assert not mg.uses_kernel(rows, table, e5m2, e5m2, scales=(scale, scale))
        assert mg.uses_kernel(rows, table, w, w, scales=(scale, scale))  # E4M3: through the view
    monkeypatch.undo()
    with pytest.raises(ValueError, match="paired view"):
        mg.grouped_matmul(x, tile_expert, w.astype(jnp.bfloat16), paired=True, block_m=bm, interpret=True)  # not FP8
