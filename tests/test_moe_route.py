"""The Pallas MoE routing kernel (interpret mode) against its reference."""
from __future__ import annotations

import numpy as np
import pytest
import jax.numpy as jnp

from jspec.kernels.moe.experts import ExpertTiles
from jspec.kernels.moe.route import RouteTiles
from jspec.kernels import dispatch
from jspec.kernels.moe import route as mr
from jspec.kernels.moe.experts import rms_norm

ROUTINGS = {  # V2-Lite, V2 (160 experts in 8 groups of 20), V3; small and real sizes
    "v2lite": mr.Routing(64, 6, num_extra=2),
    "v2": mr.Routing(160, 6, method="group_limited_greedy", n_group=8, topk_group=3, scaling=16.0, num_extra=2),
    "v3": mr.Routing(256, 8, scoring="sigmoid", method="noaux_tc", n_group=8, topk_group=4, norm_topk_prob=True,
                     scaling=2.5, num_extra=1),
    "tiny_v3": mr.Routing(8, 2, scoring="sigmoid", method="noaux_tc", n_group=4, topk_group=2, norm_topk_prob=True,
                          num_extra=1),
    "tiny_greedy_norm": mr.Routing(8, 3, norm_topk_prob=True, scaling=1.5),
}


def _case(r: mr.Routing, N: int, seed: int, ties: bool):
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((N, r.num_experts)).astype(np.float32)
    if ties:  # few distinct values: many exact ties, inside and across groups
        logits = np.round(logits * 2) / 2
    bias = None
    if r.scoring == "sigmoid":
        bias = rng.uniform(-0.1, 0.1, r.num_experts).astype(np.float32)
        if ties:
            bias = np.zeros_like(bias)
    return jnp.asarray(logits), None if bias is None else jnp.asarray(bias)


@pytest.mark.parametrize("name", list(ROUTINGS))
@pytest.mark.parametrize("ties", [False, True])
def test_kernel_matches_reference(name, ties):
    r = ROUTINGS[name]
    logits, bias = _case(r, 5, len(name) + ties, ties)
    w_ref, ids_ref = mr.route_reference(r, logits, bias)
    w, ids = mr.route_kernel(r, logits, bias, interpret=True)
    assert ids.shape == w.shape == (5, r.table_width) and ids.dtype == jnp.int32 and w.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(ids_ref))
    np.testing.assert_allclose(np.asarray(w), np.asarray(w_ref), rtol=2e-6, atol=1e-7)
    # the extra slots and the padding
    k, s = r.top_k, r.slots
    np.testing.assert_array_equal(np.asarray(ids[:, k:s]), np.broadcast_to(np.arange(r.num_experts, r.num_experts
                                                                                     + r.num_extra), (5, s - k)))
    assert np.all(np.asarray(w[:, k:s]) == 1.0) and np.all(np.asarray(w[:, s:]) == 0.0)
    # each token's k experts are distinct and the best first
    assert all(len(set(row)) == k for row in np.asarray(ids[:, :k]).tolist())


def test_reference_picks_what_the_rules_say():
    """The reference on a hand-made case: V3's rule keeps the 2 groups with the best
    top-2 sums (not the best maximum), then the 2 best experts in them; the weights are
    the sigmoid scores without the bias, normalised, scaled."""
    r = mr.Routing(8, 2, scoring="sigmoid", method="noaux_tc", n_group=4, topk_group=2, norm_topk_prob=True,
                   scaling=2.0)
    logits = jnp.asarray([[3.0, -5.0, 1.0, 1.0, 0.5, 0.4, -1.0, 2.5]], jnp.float32)
    # group sums of the two best sigmoids: g0 0.95+0.007, g1 0.73+0.73, g2 0.62+0.60, g3 0.92+0.27
    w, ids = mr.route_reference(r, logits, jnp.zeros((8,), jnp.float32))
    assert np.asarray(ids)[0, :2].tolist() == [2, 3]  # group 1 (best sum) and group 2 kept: not expert 0
    np.testing.assert_allclose(np.asarray(w)[0, :2], [1.0, 1.0], rtol=1e-6)  # two equal scores: 0.5 * 2 each
    w_k, ids_k = mr.route_kernel(r, logits, jnp.zeros((8,), jnp.float32), interpret=True)
    assert np.asarray(ids_k)[0, :2].tolist() == [2, 3]


@pytest.mark.parametrize("name,N", [("v2lite", 1), ("v3", 3), ("v2lite", 20), ("tiny_v3", 2)])
def test_route_from_activations(name, N):
    """`route` from the activations and the router weight: with the kernels forced, the
    product as K splits of the expert kernel (few tokens) or XLA's (many; 8 experts, under
    the expert kernel's tiles), then the routing kernel; the table equals the reference's."""
    r = ROUTINGS[name]
    rng = np.random.default_rng(N)
    D = 128
    x = jnp.asarray(rng.standard_normal((N, D)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((D, r.num_experts)) / 8, jnp.float32)
    bias = jnp.asarray(rng.uniform(-0.1, 0.1, r.num_experts), jnp.float32) if r.scoring == "sigmoid" else None
    w_ref, ids_ref = mr.route_reference(r, mr.router_logits(x, w), bias)
    with dispatch.use_backend("reference"):
        np.testing.assert_array_equal(np.asarray(mr.route(r, x, w, bias)[1]), np.asarray(ids_ref))
    with dispatch.use_backend("pallas"):
        got_w, got_ids = mr.route(r, x, w, bias)
    np.testing.assert_array_equal(np.asarray(got_ids), np.asarray(ids_ref))
    np.testing.assert_allclose(np.asarray(got_w), np.asarray(w_ref), rtol=1e-5, atol=1e-6)
    # norm=(weight, eps): x RMS-normed first (in the expert kernel's prologue for few tokens)
    norm = (jnp.asarray(rng.uniform(0.5, 1.5, D), jnp.bfloat16), 1e-6)
    xn = jnp.asarray(rng.standard_normal((N, D)) * 5, jnp.bfloat16)
    w_ref, ids_ref = mr.route_reference(r, mr.router_logits(rms_norm(xn, *norm), w), bias)
    for mode in ("reference", "pallas"):
        with dispatch.use_backend(mode):
            got_w, got_ids = mr.route(r, xn, w, bias, norm=norm)
        np.testing.assert_array_equal(np.asarray(got_ids), np.asarray(ids_ref))
        np.testing.assert_allclose(np.asarray(got_w), np.asarray(w_ref), rtol=1e-5, atol=1e-6)
    unnormed = mr.route_reference(r, mr.router_logits(xn, w), bias)[0]
    assert not np.allclose(np.asarray(got_w), np.asarray(unnormed), rtol=1e-3)


def test_dispatch_and_validation():
    r = ROUTINGS["v2lite"]
    logits, _ = _case(r, 2, 0, False)
    w, ids = mr.route_kernel(r, jnp.stack([logits * 0.25, logits * 0.75]), interpret=True)  # K splits
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(mr.route_reference(r, logits)[1]))
    with pytest.raises(ValueError, match="logits must be"):
        mr.route_kernel(r, logits[:, :32], interpret=True)
    with pytest.raises(TypeError, match="float32"):
        mr.route_kernel(r, logits.astype(jnp.bfloat16), interpret=True)
    with pytest.raises(ValueError, match="bias"):
        mr.route_kernel(r, logits, jnp.zeros((3,), jnp.float32), interpret=True)
    odd = mr.Routing(12, 2, method="group_limited_greedy", n_group=3, topk_group=2)
    assert not mr.is_supported(odd, jnp.zeros((1, 12), jnp.float32))
    with pytest.raises(ValueError, match="power-of-two number of groups"):
        mr.route_kernel(odd, jnp.zeros((1, 12), jnp.float32), interpret=True)
    with pytest.raises(ValueError, match="scoring"):
        mr.Routing(8, 2, scoring="relu")
    with pytest.raises(ValueError, match="cannot give"):
        mr.Routing(8, 5, method="noaux_tc", n_group=4, topk_group=2)
    with pytest.raises(ValueError, match="top_k"):
        mr.Routing(8, 9)


def test_route_tiles():
    """`tiles` (`Tuning.route`): the router product's rows a program (K splits D / block_k)
    and up to how many tokens it runs in the expert kernel; `expert_tiles`
    (`Tuning.experts`) tiles that kernel."""
    from test_kernels import pallas_grids
    r = ROUTINGS["v2lite"]
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 128)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((128, r.num_experts)) / 8, jnp.float32)

    def grids(**tiles):
        with dispatch.use_backend("pallas"):
            return pallas_grids(lambda x, w: mr.route(r, x, w, **tiles), x, w)

    E = r.num_experts
    route_grid = (2,)  # the routing kernel: a program a token
    assert grids() == [(2, -(-E // 128), 2), route_grid]  # (pairs, column tiles, K splits)
    assert grids(tiles=RouteTiles(block_k=32)) == [(2, -(-E // 128), 4), route_grid]
    assert grids(expert_tiles=ExpertTiles(block_n=16)) == [(2, -(-E // 16), 2), route_grid]
    assert grids(tiles=RouteTiles(kernel_product_tokens=1)) == [route_grid]  # XLA's product
    ids = mr.route_reference(r, mr.router_logits(x, w))[1]
    for tiles in (RouteTiles(block_k=32), RouteTiles(kernel_product_tokens=1)):
        with dispatch.use_backend("pallas"):
            np.testing.assert_array_equal(np.asarray(mr.route(r, x, w, tiles=tiles)[1]), np.asarray(ids))
