"""DeepSeek-V2/V3 decoders (MLA attention, MoE MLPs) as Flax modules, behind the
target-family protocol (`jspec.models.family`).

Attention keeps only the latent in the cache (`jspec.cache.latent`). A prefill computes
keys and values from the latent as the model defines them; decoding and verification
attend in the absorbed form (`jspec.kernels.mla.attention`): the key up-projection W_UK
is folded into the query and the value up-projection W_UV applied after attention, so
the cache is read once for all heads.

MoE layers route each token to k of E experts (`jspec.kernels.moe.route`; V2: softmax
scores, `greedy` or `group_limited_greedy`; V3: sigmoid scores with
`e_score_correction_bias` used for the choice only, groups, `norm_topk_prob`,
`routed_scaling_factor`), and to the shared experts, stored as S experts of the same
width. When a forward has fewer (token, expert) pairs than experts (decoding,
verification), each pair reads its expert's weights straight from the stacked arrays
(`jspec.kernels.moe.experts`: a Pallas kernel on the GPU, a gather elsewhere), so only
chosen experts are read; otherwise (prefill) the pairs are sorted by expert and run as
grouped products (`jax.lax.ragged_dot`).

Every module takes a `tuning` (`jspec.tuning.Tuning`) beside its config: the kernels'
tiles and the switches (`mlp_norm_in_kernel`, `cache_write_in_kernel`) it passes down.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn

from jspec.cache.latent import LatentCache, LatentCacheKind, cached_mla_attention
from jspec.tuning import DEFAULT_TUNING, Tuning
from jspec.kernels.attention import gqa
from jspec.kernels.attention.decode import attention_reference
from jspec.kernels.mla import inputs as mla_inputs
from jspec.kernels.meta import AttnMeta
from jspec.kernels.mla.attention import mla_attention
from jspec.kernels.mla import prefill as mla_prefill
from jspec.kernels.moe import experts as moe_experts, grouped as moe_grouped
from jspec.kernels.moe.experts import normed, silu_mul
from jspec.kernels.moe.route import route
from jspec.cache.kv import write_kv
from jspec.kernels.dsa import index as dsa_index, topk as dsa_topk
from jspec.kernels.attention.decode import cache_mask
from jspec.kernels.dsa.index import index_scores_reference
from jspec import sharding
from jspec.models import deepseek_hf
from jspec.models.deepseek_hf import DeepseekConfig
from jspec.models.deepseek_split import layer_on_devices, split_deepseek
from jspec.models.family import row_invariant_measured_cheap
from jspec.kernels import dispatch
from jspec.kernels.row import matmul as row_matmul, mla as row_mla, norm as row_norm
from jspec.kernels.tiling import in_order_sum, is_pow2
from jspec.models.layers import (INIT, DecoderLM, FlaxFamily, Linear, RMSNorm, call_layer, loaded_param, product,
                                 project, rows_alone)
from jspec.quantization import FP8_DTYPES, GROUP, expert_scales, kernel_of

LATENT_NORM_EPS = 1e-6  # the q/kv latent norms use RMSNorm's default, not rms_norm_eps
# `Tuning.row_invariant=None` turns it on for programs of up to this many rows: measured
# about as fast at 1 and 4, 1.49x at 32 (`DeepseekFamily.row_invariant_by_default`); batches
# between are not measured.
ROW_INVARIANT_AUTO_MAX_BATCH = 4
# XLA options of the loop's programs on a GPU (`DeepseekFamily.gpu_xla_options`): CUDA-graph
# command buffers of single kernels too (a step runs about 300 short kernels). Not the
# while loop and its conditionals (`WHILE`, `CONDITIONAL`): with them a paged cache gave
# wrong tokens on an H100 (jax 0.11.2, 2026-11-26, benchmarks/bitwise.py command_buffers: rows
# stopped early or ended "cache_full"; dense caches unchanged), although V2-Lite's 27-layer
# batch-1 step had been 1.0-1.6% faster with them (benchmarks/deepseek.py ab, H200). A
# tuning's `xla_options` go over these; `family_xla_options` False leaves them out
# (`jspec.tuning.Tuning.compiler_options`). Split over several GPUs the collectives join
# the graphs: V2-Lite's first 6 layers over two H200s took 0.647 against 0.716 ms a step at
# batch 1 and 2.059 against 2.127 ms at batch 32 (benchmarks/tp.py, tuning
# graphs_collectives, same run, with WHILE and CONDITIONAL).
GPU_XLA_OPTIONS = {"xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN",
                   "xla_gpu_graph_min_graph_size": 1}


def rope_tables(positions, c: DeepseekConfig):
    """positions [B,T] -> (cos, sin) [B,T,Dr/2] float32, YaRN's scale included."""
    inv = c.rope.inv_freq(c.qk_rope_head_dim)
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv)[None, None, :]
    scale = c.rope.cos_sin_scale()
    return jnp.cos(freqs) * scale, jnp.sin(freqs) * scale


class MLAttention(nn.Module):
    """Multi-head latent attention over the latent cache."""

    cfg: DeepseekConfig
    tuning: Tuning = DEFAULT_TUNING

    @nn.compact
    def __call__(self, x, norm, buf, meta: AttnMeta, row_invariant: bool = False):
        """x [B,T,D] with its input norm (weight, eps) not yet applied (`qkv_a_proj` applies
        it); buf: the layer's latent buffer or None ((latent, indexer keys) with sparse
        attention); row_invariant: each token computed alone (`computes_rows_alone`).
        -> (out [B,T,D], buffer(s))."""
        c, tuning = self.cfg, self.tuning
        ri = row_invariant
        ibuf = None
        if c.index_topk and buf is not None:
            buf, ibuf = buf
        B, T, _ = x.shape
        H, Dn, Dr, Dv, Dc = c.num_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
        # The products of the normed input, q_proj (or q_a_proj) and kv_a_proj_with_mqa, as
        # one matrix [D, Q + Dc + Dr] (`deepseek_hf`): one pass over x's weights.
        Q = c.q_lora_rank or H * (Dn + Dr)
        proj = Linear(Q + Dc + Dr, c.attention_bias, c.dtype, row_kernel=True, tuning=tuning, name="qkv_a_proj")
        # kv_b_proj as its two halves (`deepseek_hf`): W_UK [Dc,H,Dn] and W_UV [H,Dv,Dc], the
        # latter so that each head's rows are contiguous for `kernels.mla.output`
        dt = jnp.dtype(c.dtype)
        w_uk = self.param("w_uk", INIT, (Dc, H, Dn), dt)
        w_uv = self.param("w_uv", INIT, (H, Dv, Dc), dt)
        latent_norm, _ = RMSNorm(LATENT_NORM_EPS, c.dtype, name="kv_a_layernorm")(
            jax.ShapeDtypeStruct((Dc,), dt), unapplied=True)
        cos, sin = rope_tables(meta.positions, c)  # [B,T,Dr/2]
        # A prompt's blocks in the non-absorbed form (`kernels.mla.prefill`): through cuDNN
        # where it runs (`fused`), else a later block over the latent cache by the blocked
        # jnp form (`expanded`); sparse attention and row-invariant steps stay as they were.
        own_form = meta.causal_block and not c.index_topk and not ri
        own_q = jax.ShapeDtypeStruct((B, T, H, Dn + Dr), dt)  # the non-absorbed queries
        fused = (own_form and (meta.prefill or buf is not None)
                 and gqa.uses_fused(own_q, meta, tiles=tuning.attention))
        expanded = (own_form and not meta.prefill and buf is not None
                    and (fused or tuning.mla_decode.expanded_prompt_blocks))
        absorb = not (meta.prefill or expanded)
        flat = (cos.reshape(B * T, -1), sin.reshape(B * T, -1))
        q_latent = None  # the normed query latent (sparse attention's indexer reads it)
        parts = None  # the projections' K splits [S, B*T, H(Dn+Dr)+Dc+Dr] float32 for `mla_inputs`
        probe = jax.ShapeDtypeStruct((1, B * T, H * (Dn + Dr) + Dc + Dr), jnp.float32)
        if ri and not (c.q_lora_rank or c.attention_bias):
            # the input normed by the row norm kernel, then the row kernel's K splits, added
            # in split order by the inputs kernel
            xn = row_norm.rms_norm(x, *norm, tiles=tuning.row_norm)
            parts = proj(xn, splits=True, row_invariant=True)  # [S, B*T, Q+Dc+Dr]
        elif ri:  # q_b_proj between: both products by the row kernel; one "split"
            qkv = proj(x, norm=norm, row_invariant=True)
            q, ckv = qkv[..., :Q], qkv[..., Q:]
            if c.q_lora_rank:
                q_norm = RMSNorm(LATENT_NORM_EPS, c.dtype, name="q_a_layernorm")(q, unapplied=True)
                q = Linear(H * (Dn + Dr), False, c.dtype, tuning=tuning, name="q_b_proj")(
                    q, norm=q_norm, row_invariant=True)
            parts = jnp.concatenate([q, ckv], axis=-1).astype(jnp.float32).reshape(1, B * T, -1)
        elif (absorb and not c.q_lora_rank and proj.uses_splits(x)
              and mla_inputs.uses_kernel(probe, *flat, latent_norm, w_uk)):
            # one row: the projection's K splits go straight to the kernel that sums them
            parts = proj(x, norm=norm, splits=True)  # [S, B*T, Q+Dc+Dr]
        if parts is not None:
            # the kernel makes the absorbed query, the roped query part and the cache row,
            # which it writes into the cache itself
            written = buf is not None and tuning.cache_write_in_kernel and jnp.dtype(buf.dtype) not in FP8_DTYPES
            q_lat, q_pe, rows = mla_inputs.mla_inputs(parts, *flat, latent_norm, w_uk, interleaved=c.rope_interleave,
                                                      eps=LATENT_NORM_EPS, cache=buf if written else None,
                                                      write_index=meta.write_index if written else None,
                                                      block_c=tuning.mla_inputs.block_c,
                                                      num_warps=tuning.mla_inputs.num_warps)
            q_lat, q_pe = q_lat.reshape(B, T, H, Dc), q_pe.reshape(B, T, H, Dr)
            buf, rows = (rows, None) if written else (buf, rows.reshape(B, T, -1))
        else:
            qkv = proj(x, norm=norm)
            q, ckv = qkv[..., :Q], qkv[..., Q:]
            if c.q_lora_rank:  # the norm handed to the projection (FP8 rows bound in its pass)
                q_norm = RMSNorm(LATENT_NORM_EPS, c.dtype, name="q_a_layernorm")(q, unapplied=True)
                q_latent = normed(q, q_norm) if c.index_topk else None
                q = Linear(H * (Dn + Dr), False, c.dtype, tuning=tuning, name="q_b_proj")(q, norm=q_norm)
            # q_first: the absorbed query [B,T,H,Dc] (decoding) or q_nope [B,T,H,Dn] (prefill);
            # rows [B,T,Dc+Dr]: what the cache keeps (the normed latent, the roped key part)
            q_first, q_pe, rows = mla_inputs.mla_inputs_reference(q.reshape(B, T, H, Dn + Dr), ckv, cos, sin, latent_norm,
                                                       w_uk if absorb else None, interleaved=c.rope_interleave,
                                                       eps=LATENT_NORM_EPS)
            q_lat = q_nope = q_first
        latent_scale = None  # an FP8 cache's per-layer scale (the `kv_scale` param), as `cache.kv.cached_attention`
        if buf is not None and jnp.dtype(buf.dtype) in FP8_DTYPES and self.has_variable("params", "kv_scale"):
            # the cache holds rows / s; queries times s and the output times s (powers of
            # two: exact), so every path reads the cache as it is
            latent_scale = self.get_variable("params", "kv_scale")[0]
            q_pe, rows = q_pe * latent_scale.astype(q_pe.dtype), rows / latent_scale.astype(rows.dtype)
            q_lat = q_lat * latent_scale.astype(q_lat.dtype)
            if parts is None:
                q_nope = q_lat
        select = None  # sparse attention's selection (`Indexer`; None: every visible slot)
        if c.index_topk:
            select, ibuf = Indexer(c, tuning, name="indexer")(normed(x, norm), q_latent, cos, sin, ibuf, meta)
        if fused:
            if buf is not None:
                buf = write_kv(buf, rows, meta.write_index, meta.page_table is None)
            o = mla_prefill.fused_attention(q_nope, q_pe, rows, buf, meta, w_uk, w_uv, scale=c.softmax_scale)
        elif meta.prefill:  # keys and values from the latent, as the model computes them
            if select is not None:
                meta = meta.replace(local_mask=meta.local_mask & select)
            if buf is not None:
                buf = write_kv(buf, rows, meta.write_index, meta.page_table is None)
            k, v = mla_prefill.up_project(rows, w_uk, w_uv)
            o = attention_reference(jnp.concatenate([q_nope, q_pe], axis=-1), k, v, None, meta,
                                    scale=c.softmax_scale)  # [B,T,H,Dv]
        elif expanded:
            buf = write_kv(buf, rows, meta.write_index, meta.page_table is None)
            o = mla_prefill.expanded_attention(q_nope, q_pe, buf, meta, w_uk, w_uv, scale=c.softmax_scale)
        elif ri:
            if rows is not None:
                buf = write_kv(buf, rows, meta.write_index, meta.page_table is None)
            o = row_mla.row_mla_output(q_lat, q_pe, buf, meta, w_uv, scale=c.softmax_scale, tiles=tuning.row_mla,
                                       output_tiles=tuning.mla_output)
        elif rows is None:  # absorbed, the rows already in the cache
            o = mla_attention(q_lat, q_pe, buf, meta, w_uv, scale=c.softmax_scale, decode_tiles=tuning.mla_decode,
                              output_tiles=tuning.mla_output, index=select)
        else:  # absorbed: attend over the latent rows (sparse: the selected ones), then up-project the values
            o, buf = cached_mla_attention(q_lat, q_pe, rows, buf, meta, w_uv, scale=c.softmax_scale, tuning=tuning,
                                          index=select)
        if latent_scale is not None:
            o = o * latent_scale.astype(o.dtype)
        # one device's heads (`DeepseekConfig.block`): a float32 partial sum for `device_sum`
        out = Linear(c.hidden_size, c.attention_bias, c.dtype, float32_out=c.per_device, row_kernel=True,
                     tuning=tuning, name="o_proj")(o.reshape(B, T, H * Dv), row_invariant=ri)
        return out, buf if ibuf is None else (buf, ibuf)


def rotate_half_rope(x, cos, sin):
    """Non-interleaved RoPE (pairs (i, i + R/2)) of x [B,T,...,R], cos/sin [B,T,R/2]."""
    half = x.shape[-1] // 2
    extra = (None,) * (x.ndim - 3)
    cos, sin = cos[(slice(None), slice(None)) + extra], sin[(slice(None), slice(None)) + extra]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Indexer(nn.Module):
    """DeepSeek-V3.2's lightning indexer (DSA): which Ki = `index_topk` of the slots it
    sees each token attends to. Per token a query of Hi heads (wq_b of the normed query
    latent) and one key (wk of the normed input, a LayerNorm with bias), both roped on
    their first Dr dims, non-interleaved; per-head weights (weights_proj, float32) times
    Hi^-1/2. A slot's score for a token is sum_h w_h relu(q_h . k / sqrt(Di)), float32;
    the Ki best visible slots are selected (`kernels.dsa.topk`: in slot order, ties to the
    lower slot). The keys go into the layer's indexer buffer at
    the new tokens' slots (the latent's)."""

    cfg: DeepseekConfig
    tuning: Tuning = DEFAULT_TUNING

    @nn.compact
    def __call__(self, xn, q_latent, cos, sin, buf, meta: AttnMeta):
        """xn [B,T,D] the layer's normed input, q_latent [B,T,Rq], cos/sin [B,T,Dr/2]; buf:
        the indexer keys [rows, slots, Di] or None. -> (the selection, buffer): None when
        every visible slot is selected (Sk <= Ki); a prefill's mask [B,T,T] over its block;
        else the selected slots [B,T,Ki] int32 (-1: none, fewer visible than Ki)."""
        c = self.cfg
        B, T, _ = xn.shape
        Hi, Di, Dr, Ki = c.index_n_heads, c.index_head_dim, c.qk_rope_head_dim, c.index_topk
        q = Linear(Hi * Di, False, c.dtype, tuning=self.tuning, name="wq_b")(q_latent).reshape(B, T, Hi, Di)
        k = Linear(Di, False, c.dtype, tuning=self.tuning, name="wk")(xn)  # [B,T,Di]
        dt = jnp.dtype(c.dtype)
        gamma = self.param("k_norm", lambda key: {"weight": jnp.ones((Di,), dt), "bias": jnp.zeros((Di,), dt)})
        kf = k.astype(jnp.float32)
        mean = kf.mean(-1, keepdims=True)
        var = ((kf - mean) ** 2).mean(-1, keepdims=True)
        k = ((kf - mean) * jax.lax.rsqrt(var + 1e-6) * gamma["weight"].astype(jnp.float32)
             + gamma["bias"].astype(jnp.float32)).astype(dt)
        q = jnp.concatenate([rotate_half_rope(q[..., :Dr], cos, sin), q[..., Dr:]], axis=-1)
        k = jnp.concatenate([rotate_half_rope(k[..., :Dr], cos, sin), k[..., Dr:]], axis=-1)
        w = self.param("weights_proj", lambda key: {"kernel": INIT(key, (xn.shape[-1], Hi), jnp.float32)})["kernel"]
        weights = jnp.einsum("btd,dh->bth", xn.astype(jnp.float32), w) * Hi ** -0.5  # [B,T,Hi]
        if buf is not None:
            buf = write_kv(buf, k, meta.write_index, meta.page_table is None)
        Sk = T if meta.prefill else (buf.shape[1] if meta.page_table is None else
                                      meta.page_table.shape[1] * buf.shape[1])  # the slots a token may see
        if Sk <= Ki:
            return None, buf
        if meta.prefill:  # the block's own keys
            index = index_scores_reference(q, weights, k, None, scale=Di ** -0.5)
            visible = meta.local_mask  # [B,T,T]
        else:  # every slot of the row's indexer keys (a Pallas kernel on the GPU)
            index = dsa_index.scores(q, weights, buf, meta.page_table, scale=Di ** -0.5)
            visible = cache_mask(meta, Sk, T)
        index = jnp.where(visible, index, -jnp.inf)
        if not meta.prefill:  # [B,T,Ki] in slot order (a Pallas radix select on the GPU)
            return dsa_topk.select(index, Ki), buf
        best, top = jax.lax.top_k(index, Ki)  # [B,T,Ki], slot order breaks ties
        chosen = jnp.zeros((B, T, Sk), bool).at[jnp.arange(B)[:, None, None], jnp.arange(T)[None, :, None],
                                                 top].set(True)
        return chosen & visible, buf


def one_expert(p: dict, dtype):
    """A projection's params as one expert of the expert kernel -> (stack [1, K, N], its
    scales [1, K / GROUP, N] or None): an FP8 kernel as it is where its rows are whole
    groups (the kernel reads it so: half the bytes), else its kernel in `dtype` (an FP8
    one dequantized in the graph) unscaled."""
    if "kernel_scale" in p and p["kernel"].shape[0] % GROUP == 0:
        return p["kernel"][None], p["kernel_scale"][None]
    return kernel_of(p, dtype)[None], None


class MLP(nn.Module):
    """A dense SwiGLU MLP (the first `first_k_dense_replace` layers). A few rows run as
    one expert of the expert kernel (`moe_experts.routed_experts`: the activation is
    applied while the second product loads its input), else two XLA products."""

    width: int
    dtype: str
    tuning: Tuning = DEFAULT_TUNING
    partial: bool = False  # one device's columns (`DeepseekConfig.block`): a float32 partial sum

    @nn.compact
    def __call__(self, x, norm, row_invariant: bool = False):
        """x [B,T,D] with its norm (weight, eps; None: x is normed) not yet applied (the
        kernel's prologue applies it) -> [B,T,D] (float32 when `partial`). row_invariant:
        both products by the row kernel (`computes_rows_alone`)."""
        D, F, dt = x.shape[-1], self.width, jnp.dtype(self.dtype)
        tiles = self.tuning.experts
        gu_params, down_params = (loaded_param(self, name, lambda key, s=shape: {"kernel": INIT(key, s, dt)})
                                  for name, shape in (("gate_up_proj", (D, 2 * F)), ("down_proj", (F, D))))
        if not row_invariant and moe_experts.uses_matvec(x, jax.ShapeDtypeStruct((D, 2 * F), dt), tiles, any_size=True):
            rows = x.reshape(-1, D)
            one = jnp.zeros((rows.shape[0],), jnp.int32)  # every row to expert 0
            (gate_up, gu_scale), (down, down_scale) = one_expert(gu_params, dt), one_expert(down_params, dt)
            scales = None if gu_scale is None and down_scale is None else (gu_scale, down_scale)
            if moe_experts.uses_kernel(rows, one, gate_up, down, scales=scales):
                # the one wide expert's second product: `ExpertTiles.dense_down_block_n`
                y = moe_experts.routed_experts(rows, one, gate_up, down, norm=norm, tiles=tiles, scales=scales,
                                               down_tiles={"block_n": tiles.dense_down_block_n})
                return y.astype(jnp.float32 if self.partial else x.dtype).reshape(x.shape)
        if row_invariant:
            gate_up, down = kernel_of(gu_params, dt), kernel_of(down_params, dt)  # FP8 ones dequantized in the graph
            gu = product(x, gate_up, tuning=self.tuning, row_invariant=True, norm=norm)
            return product(silu_mul(gu[..., :F], gu[..., F:]), down, float32_out=self.partial, tuning=self.tuning,
                           row_invariant=True)
        gu = project(x, gu_params, dt, self.tuning, norm=norm)  # FP8 ones through the FP8 kernels where they apply
        return project(silu_mul(gu[..., :F], gu[..., F:]), down_params, dt, self.tuning, float32_out=self.partial)


def shared_products(xs, stack: dict, width: int, dtype, tuning: Tuning) -> jax.Array:
    """xs [N, D] (normed) through each of a stack's S shared experts {gate_up [S, D, 2 width],
    down [S, width, D][, scales]} as dense products over the tokens -> [N, D] float32, their
    sum: an FP8 expert's products through `project` (the FP8 kernels where they apply, as
    the projections'), others as two products over the whole stack."""
    scales = expert_scales(stack)
    if scales is None:
        h = jnp.einsum("nd,sdf->nsf", xs, stack["gate_up"])  # [N,S,2F]
        return jnp.einsum("nsf,sfd->nd", silu_mul(h[..., :width], h[..., width:]), stack["down"],
                          preferred_element_type=jnp.float32)
    out = jnp.zeros((xs.shape[0], stack["down"].shape[-1]), jnp.float32)
    for s in range(stack["gate_up"].shape[0]):
        gu = project(xs, {"kernel": stack["gate_up"][s], "kernel_scale": scales[0][s]}, dtype, tuning)  # [N,2F]
        out = out + project(silu_mul(gu[..., :width], gu[..., width:]),
                            {"kernel": stack["down"][s], "kernel_scale": scales[1][s]}, dtype, tuning, float32_out=True)
    return out


class MoE(nn.Module):
    """Routed experts plus shared experts. The S shared experts (one MLP of width S*Fm in
    the checkpoint) are stored as S experts of width Fm (`deepseek_hf`). The router's
    logits give each token a row of the routing table (`kernels.moe.route`: its k experts
    and weights, then the shared experts E.. E+S-1 with weight 1). Decoding and
    verification run every (token, slot) pair of the table through the expert kernel
    (`kernels.moe.experts`), shared experts included (SGLang's shared-experts fusion: two
    products a layer fewer; a shared expert's later reads for other tokens come from L2);
    a prefill groups the routed pairs by expert and computes the shared experts as dense
    products over the tokens (`shared_products`)."""

    cfg: DeepseekConfig
    tuning: Tuning = DEFAULT_TUNING

    @nn.compact
    def __call__(self, x, norm, row_invariant: bool = False):
        """x [B,T,D] with its norm (weight, eps; None: x is normed) not yet applied (the
        router's and the expert kernel's prologues apply it when they run) -> [B,T,D].
        row_invariant (`computes_rows_alone`): every token through the expert kernel with
        one token's tiles, the router's product by the expert kernel, the pairs' outputs
        added in slot order."""
        c = self.cfg
        B, T, D = x.shape
        E, S, Fm, k = c.n_routed_experts, c.n_shared_experts, c.moe_intermediate_size, c.num_experts_per_tok
        dt = jnp.dtype(c.dtype)

        def stacked(n, width):
            return lambda key: {"gate_up": INIT(key, (n, D, 2 * width), dt),
                                "down": INIT(jax.random.fold_in(key, 1), (n, width, D), dt)}

        router = self.param("router", lambda key: {"kernel": INIT(key, (D, E), jnp.float32)}
                            | ({"bias": jnp.zeros((E,), jnp.float32)} if c.scoring == "sigmoid" else {}))
        n = c.devices if c.per_device else 1  # a device's block: E/n experts, Fm/n shared columns
        experts = loaded_param(self, "experts", stacked(E // n, Fm))  # FP8: with their scales (`expert_scales`)
        shared = loaded_param(self, "shared_experts", stacked(S, Fm // n)) if S else None  # FP8: with scales
        xs = x.reshape(B * T, D)
        r = c.routing
        tuning = self.tuning
        weights, ids = route(r, xs, router["kernel"], router.get("bias"), norm=norm, tiles=tuning.route,
                             expert_tiles=tuning.experts, rows_alone=row_invariant)  # [N, KP] each
        if c.per_device:  # this device's E/n experts (`DeepseekConfig.block`); other experts' pairs: id -1
            El = E // n
            local = ids[:, :k] - jax.lax.axis_index(sharding.AXIS) * El
            routed = jnp.where((local >= 0) & (local < El), local, -1)  # [N, k]
            out = self.routed(xs, routed, weights[:, :k], experts, norm, B * T * k < E)
            if S:  # the shared experts' Fm/n columns on this device, each as an expert of that width
                table = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B * T, S))
                out = out + self.routed(xs, table, weights[:, k:k + S], shared, norm, B * T * k < E)
            return out.reshape(B, T, D)  # float32: a partial sum over the devices
        if B * T * k < E or row_invariant:  # decode and verification: read the chosen and the shared experts only
            extra = (shared["gate_up"], shared["down"]) if S else None
            y = moe_experts.moe_experts(xs, ids, experts["gate_up"], experts["down"], extra, r.slots,
                                        norm=norm, tiles=tuning.experts, as_tokens=1 if row_invariant else None,
                                        scales=expert_scales(experts),
                                        extra_scales=expert_scales(shared) if S else None,
                                        mosaic_tiles=tuning.fp8_mosaic)  # [N*(k+S), D]
            y = y.reshape(B * T, r.slots, D)
            if row_invariant:  # slot order, elementwise
                out = in_order_sum(jnp.moveaxis(y * weights[:, :r.slots, None], 1, 0))
            else:
                out = jnp.einsum("nsd,ns->nd", y, weights[:, :r.slots])
        else:  # prefill (and large batches): (token, expert) pairs grouped by expert
            xs = normed(xs, norm)
            y = moe_grouped.grouped(xs, ids[:, :k], experts["gate_up"], experts["down"], tiles=tuning.grouped,
                                    scales=expert_scales(experts), w8a8=tuning.fp8_w8a8).reshape(B * T, k, D)
            out = jnp.einsum("nkd,nk->nd", y.astype(jnp.float32), weights[:, :k])
            if S:  # each shared expert as dense products over the tokens
                out = out + shared_products(xs, shared, Fm, dt, tuning)
        return out.astype(x.dtype).reshape(B, T, D)

    def routed(self, xs, table, weights, stack, norm, few: bool):
        """One device's share of expert pairs: xs [N, D], table [N, j] (ids into `stack`'s
        experts; -1: none here), weights [N, j] float32 -> [N, D] float32, the pairs through
        the expert kernel when `few` (decode, verification), else grouped by expert."""
        N, j = table.shape
        if few:
            y = moe_experts.moe_experts(xs, table, stack["gate_up"], stack["down"], None, j, norm=norm,
                                        tiles=self.tuning.experts, scales=expert_scales(stack),
                                        mosaic_tiles=self.tuning.fp8_mosaic)  # [N*j, D]
        else:
            y = moe_grouped.grouped(normed(xs, norm), table, stack["gate_up"], stack["down"],
                                    tiles=self.tuning.grouped, scales=expert_scales(stack),
                                    w8a8=self.tuning.fp8_w8a8).astype(jnp.float32)
        return jnp.einsum("njd,nj->nd", y.reshape(N, j, -1), weights)


class DecoderLayer(nn.Module):
    cfg: DeepseekConfig
    layer: int
    tuning: Tuning = DEFAULT_TUNING

    @nn.compact
    def __call__(self, x, buf, meta):
        c, tuning = self.cfg, self.tuning
        ri = computes_rows_alone(tuning, meta)
        norm = RMSNorm(c.rms_norm_eps, c.dtype, name="input_layernorm")(x, unapplied=True)
        h, buf = MLAttention(c, tuning, name="self_attn")(x, norm, buf, meta, row_invariant=ri)
        x = x + sharding.device_sum(h, c)
        norm = RMSNorm(c.rms_norm_eps, c.dtype, name="post_attention_layernorm")(x, unapplied=True)
        mlp = (MoE(c, tuning, name="mlp") if c.is_moe(self.layer)
               else MLP(c.intermediate_size, c.dtype, tuning, partial=c.per_device, name="mlp"))
        if ri or tuning.mlp_norm_in_kernel:
            return x + sharding.device_sum(mlp(x, norm, row_invariant=ri), c), buf
        return x + sharding.device_sum(mlp(normed(x, norm), None), c), buf


def computes_rows_alone(tuning: Tuning, meta: AttnMeta) -> bool:
    """Whether a DeepSeek pass runs its row-invariant paths: `layers.rows_alone` where the
    kernels run (elsewhere the reference paths are row-invariant already)."""
    return rows_alone(tuning, meta) and dispatch.want_pallas(True)


class DeepseekModel(DecoderLM):
    """Token ids -> final-norm hidden states; `logits` applies the LM head."""

    cfg: DeepseekConfig
    tuning: Tuning = DEFAULT_TUNING

    def setup(self):
        c = self.cfg
        self.setup_ends(RMSNorm(c.rms_norm_eps, c.dtype))
        self.layers = [DecoderLayer(c, i, self.tuning, name=f"layers_{i}") for i in range(c.num_layers)]

    def __call__(self, tokens, cache: LatentCache | None, meta: AttnMeta, capture: tuple[int, ...] = ()):
        x = self.embed(tokens)
        aux, bufs = {}, []
        c = self.cfg
        for i, layer in enumerate(self.layers):
            if i in capture:
                aux[i] = x
            buf = None if cache is None else cache.layer(i)
            if c.devices > 1:
                x, buf = layer_on_devices(c, DecoderLayer(c.block(), i, self.tuning, parent=None),
                                          layer.variables["params"], x, buf, meta)
            else:
                x, buf = call_layer(layer, x, buf, meta, same={"layer": c.first_of_kind(i)})
            bufs.append(buf)
        if self.cfg.num_layers in capture:
            aux[self.cfg.num_layers] = x
        return self.norm(x, row_invariant=rows_alone(self.tuning, meta)), aux, \
            None if cache is None else LatentCache.of_layers(bufs)


class MtpLayer(nn.Module):
    """A DeepSeek-V3 multi-token-prediction (NextN) layer, the MTP draft's whole model.

    (embeds [B,T,D] of tokens t+1, feats [B,T,D]: the hidden state that predicted t+1) ->
    hidden [B,T,D]: eh_proj([enorm(embeds); hnorm(feats)]) through one decoder block, then
    shared_head.norm. The target's final-norm hidden state is the first feature; each later
    draft step reads this layer's own output (as SGLang's and transformers' MTP do)."""

    cfg: DeepseekConfig  # the layer's config: num_layers 1, MoE when the model has experts
    tuning: Tuning = DEFAULT_TUNING

    @nn.compact
    def __call__(self, embeds, feats, cache: LatentCache | None, meta: AttnMeta):
        c = self.cfg
        h = jnp.concatenate([RMSNorm(c.rms_norm_eps, c.dtype, name="enorm")(embeds),
                             RMSNorm(c.rms_norm_eps, c.dtype, name="hnorm")(feats)], axis=-1)
        x = Linear(c.hidden_size, False, c.dtype, row_kernel=True, tuning=self.tuning, name="eh_proj")(h)
        buf = None if cache is None else cache.layer(0)
        if c.devices > 1:
            x, buf = layer_on_devices(c, DecoderLayer(c.block(), 0, self.tuning, parent=None),
                                      self.variables["params"]["block"], x, buf, meta)
        else:
            x, buf = DecoderLayer(c, 0, self.tuning, name="block")(x, buf, meta)
        out = RMSNorm(c.rms_norm_eps, c.dtype, name="shared_head_norm")(x)
        return out, None if cache is None else LatentCache.of_layers([buf])


class DeepseekFamily(FlaxFamily):
    """The target-family protocol for DeepSeek-V2/V3 (MLA + MoE) decoders."""

    fp8_weights = True  # FP8 projections stay FP8 (`Linear`, the dense MLPs'); kv_b_proj is dequantized
    fp8_experts = True  # ... and the routed and shared experts' stacks whose inputs are whole groups

    config_type = DeepseekConfig
    model = DeepseekModel
    architectures = deepseek_hf.TARGET_ARCHITECTURES

    def config_from_hf(self, cfg_json: dict, dtype: str | None) -> DeepseekConfig:
        return deepseek_hf.config_from_hf(cfg_json, dtype)

    def weights_from_hf(self, tensors: dict, cfg: DeepseekConfig, where: str):
        return deepseek_hf.target_weights_from_tensors(tensors, cfg, where)

    def weights_to_hf(self, cfg: DeepseekConfig, weights) -> tuple[dict, dict]:
        return deepseek_hf.hf_config(cfg), deepseek_hf.target_tensors(cfg, weights)

    def gpu_xla_options(self, cfg: DeepseekConfig) -> dict:
        if cfg.devices > 1:  # the layers' all-reduces inside the graphs too (`GPU_XLA_OPTIONS`)
            kinds = GPU_XLA_OPTIONS["xla_gpu_enable_command_buffer"] + ",COLLECTIVES"
            return GPU_XLA_OPTIONS | {"xla_gpu_enable_command_buffer": kinds}
        return dict(GPU_XLA_OPTIONS)

    def cache_kind(self, cfg: DeepseekConfig) -> LatentCacheKind:
        return LatentCacheKind(cfg.num_layers, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.dtype,
                               index_dim=cfg.index_head_dim if cfg.index_topk else 0)

    def split(self, cfg: DeepseekConfig, weights, n: int):
        return split_deepseek(cfg, weights, n)

    def row_invariant_by_default(self, cfg: DeepseekConfig, batch: int, device) -> bool:
        """On for batches up to `ROW_INVARIANT_AUTO_MAX_BATCH` where
        `row_invariant_measured_cheap` (not measured on an H200). On an H100 the
        DeepSeek-V2-Lite shape's batch-1 step cost 1.3-4.1% more with it over six calls
        (2.5% on average), an MTP round of 4 tokens 4.3-6.2% less and of 3 tokens 1.0%
        more, a batch-4 step 5.7-7.5% less; a batch-32 step cost 1.49x (the expert kernel
        reads each (token, expert) pair's expert where the default groups a large batch's
        pairs by expert). docs/benchmarks.md."""
        return batch <= ROW_INVARIANT_AUTO_MAX_BATCH and row_invariant_measured_cheap(device)

    def row_invariant_problem(self, cfg: DeepseekConfig, tuning) -> str | None:
        """Sparse attention (V3.2: its indexer's norm, products and top-k are not built
        row-invariant), a split model, a product the row kernel does not take
        (`row_matmul.shape_problem`), or MLA dims its kernels do not take."""
        if cfg.index_topk:
            return "DeepSeek-V3.2's sparse attention (the indexer) has no row-invariant path yet"
        if cfg.devices > 1:
            return "it runs on one device: its kernels cannot be split over devices"
        H, Dn, Dr, Dv, Dc, D = (cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                                cfg.kv_lora_rank, cfg.hidden_size)
        Q = cfg.q_lora_rank or H * (Dn + Dr)
        shapes = {"qkv_a_proj": (D, Q + Dc + Dr), "o_proj": (H * Dv, D), "the LM head": (D, cfg.vocab_size)}
        if cfg.q_lora_rank:
            shapes["q_b_proj"] = (cfg.q_lora_rank, H * (Dn + Dr))
        if cfg.first_k_dense_replace or not cfg.n_routed_experts:
            shapes |= {"gate_up_proj": (D, 2 * cfg.intermediate_size), "down_proj": (cfg.intermediate_size, D)}
        for name, (k, n) in shapes.items():
            if why := row_matmul.shape_problem(k, n, tuning.row_matmul):
                return f"{why}; {name} is [{k}, {n}]"
        if not all(row_norm.chunk_of(d) for d in (D, cfg.q_lora_rank or D)):
            return f"the row norm takes widths that are multiples of 16 (hidden {D}, q_lora_rank {cfg.q_lora_rank})"
        if not all(is_pow2(d) and d >= 16 for d in (Dn, Dc, Dr)) or Dv < 16:
            return (f"the MLA kernels take Dn, Dc and Dr powers of two >= 16 and Dv >= 16, not "
                    f"{Dn}, {Dc}, {Dr}, {Dv}")
        if min(D, cfg.n_routed_experts or D, cfg.moe_intermediate_size or D) < 16:
            return "the expert kernel takes hidden sizes, expert counts and widths of at least 16"
        return None


DEEPSEEK = DeepseekFamily()
