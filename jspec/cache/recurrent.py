"""The hybrid cache kind (Qwen3-Next, Qwen3.5): GQA keys and values for the full-attention
layers (`jspec.cache.kv`, dense or paged) beside, per request row and linear layer, the
Gated DeltaNet's two states:

- conv [B, C - 1, Ch]: the last C - 1 inputs of the causal convolution (model dtype);
- ssm [B, Hv, Dk, Dv]: the delta rule's matrix per value head (float32).

These are one row per request whatever the layout: a state does not grow with the sequence.
For prefix caching (`CacheLayout.snapshots` = S > 0) the cache also keeps S *snapshots* of
both states per linear layer ([S, ...]): the serving engine saves a row's states after a
prompt block that ends on a cached page boundary (`save_states`) and restores them into
the row of a request that begins with that prefix (`load_states`), which goes on from
there; the attention layers' keys and values of the prefix are in its pages.

A prefill (admission) writes the states after each admitted row's last prompt token; a
prompt passed in blocks writes them after each block, the next block (`AttnMeta.causal_block`)
starting from them. A one-token forward (plain decoding) writes the new states of its live rows. A verification
over N > 1 nodes writes no state: each layer leaves a *pending* record of the round, and the
commit (every round) turns it into the state after the last accepted node, for chains and
trees alike. Two records exist (`Tuning.recurrent_commit` picks which the layers leave):

- replay (the default): the nodes' convolution inputs and their k, v, decay and beta
  ([B, N, ...], a few KiB a node and layer); the commit replays the accepted path from the
  committed state (`gated_delta_step`: the state read and written once) and takes the
  conv window from the committed inputs and the path's;
- checkpoint: every node's conv and delta-rule state ([B, N, Hv, Dk, Dv] float32 a layer:
  N times the state), written by the verification; the commit copies the one it keeps.

docs/benchmarks.md compares the two (memory and time at batch 1 and 32). The replay runs
the step kernel with the tuning's tiles (`Tuning.gated_delta`). The pending
record lives only inside a round: the loop's state carries `pending=None`.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import PartitionSpec as P

from jspec.cache.kv import KVCache, KVCacheKind
from jspec.cache.layout import CacheLayout, PageState
from jspec.sharding import AXIS, constrain_heads, tp_size
from jspec.tuning import DEFAULT_TUNING
from jspec.kernels.gated_delta.kernels import gated_delta_step

COMMITS = ("replay", "checkpoint")
# Split over a mesh's devices (`models.qwen3_next_split`): a row's states by channel and by
# value head, and a round's record by the same: replay {x [B,N,Ch], k [B,N,Hk,Dk], v
# [B,N,Hv,Dv], g, beta [B,N,Hv]}, checkpoint {conv [B,N,C-1,Ch], ssm [B,N,Hv,Dk,Dv]}.
STATE_SPECS = {"conv": P(None, None, AXIS), "ssm": P(None, AXIS, None, None)}
RECORD_SPECS = {"x": P(None, None, AXIS), "k": P(None, None, AXIS, None), "v": P(None, None, AXIS, None),
                "g": P(None, None, AXIS), "beta": P(None, None, AXIS), "conv": P(None, None, None, AXIS),
                "ssm": P(None, None, AXIS, None, None)}


@struct.dataclass
class HybridCache:
    """kv: the full-attention layers' `KVCache`; conv, ssm: per linear layer (see the
    module docstring); pending: per linear layer the round's record (a dict) or None;
    snap_conv, snap_ssm: per linear layer the S snapshots ([S, ...]; () when S = 0)."""

    kv: KVCache
    conv: tuple
    ssm: tuple
    pending: tuple | None = None
    snap_conv: tuple = ()
    snap_ssm: tuple = ()


@dataclasses.dataclass(frozen=True)
class HybridCacheKind:
    """The cache a hybrid model needs: `kv` for its full-attention layers, and the conv
    and delta-rule states of `num_linear` linear layers."""

    # split over a mesh's devices (`init`): keys and values by KV head, the conv state by channel,
    # the delta rule's by value head (`models.qwen3_next_split`)
    split_by_head: ClassVar[bool] = True
    # A prompt's later blocks (`AttnMeta.causal_block`) continue the linear layers' states the
    # blocks before them left; any other forward over T > 1 tokens is a verification.
    prefill_in_chunks: ClassVar[bool] = True
    prefix_in_pages: ClassVar[bool] = False  # a prefix's recurrent state is in no page: prefix caching needs
    state_snapshots: ClassVar[bool] = True  # ... the snapshots of it (`save_states`, `load_states`)
    fp8_row_kernels: ClassVar[bool] = True  # its keys and values: `KVCacheKind`'s

    kv: KVCacheKind
    num_linear: int
    conv_kernel: int  # C
    conv_dim: int  # Ch
    num_value_heads: int  # Hv
    key_head_dim: int  # Dk
    value_head_dim: int  # Dv
    dtype: str

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per request and linear layer: the conv state's and the delta-rule state's shape."""
        return (self.conv_kernel - 1, self.conv_dim), (self.num_value_heads, self.key_head_dim, self.value_head_dim)

    def state_bytes(self) -> int:
        """Bytes of recurrent state a request holds (every linear layer)."""
        conv, ssm = self.state_shapes()
        return self.num_linear * (math.prod(conv) * np.dtype(self.dtype).itemsize + math.prod(ssm) * 4)

    def init(self, layout: CacheLayout, batch: int) -> HybridCache:
        conv, ssm = self.state_shapes()

        def states(n):
            return (tuple(constrain_heads(jnp.zeros((n,) + conv, self.dtype), 2) for _ in range(self.num_linear)),
                    tuple(constrain_heads(jnp.zeros((n,) + ssm, jnp.float32), 1) for _ in range(self.num_linear)))
        row_conv, row_ssm = states(batch)
        snap_conv, snap_ssm = states(layout.snapshots) if layout.snapshots else ((), ())
        return HybridCache(kv=self.kv.init(layout, batch), conv=row_conv, ssm=row_ssm, snap_conv=snap_conv,
                           snap_ssm=snap_ssm)

    def save_states(self, cache: HybridCache, rows, slots) -> HybridCache:
        """Snapshots slots[u] <- the states of request row rows[u] (U of them; a slot past
        the store: none)."""
        return cache.replace(snap_conv=tuple(s.at[slots].set(c[jnp.minimum(rows, c.shape[0] - 1)], mode="drop")
                                             for s, c in zip(cache.snap_conv, cache.conv)),
                             snap_ssm=tuple(s.at[slots].set(c[jnp.minimum(rows, c.shape[0] - 1)], mode="drop")
                                            for s, c in zip(cache.snap_ssm, cache.ssm)))

    def load_states(self, cache: HybridCache, rows, slots) -> HybridCache:
        """Request rows rows[u] <- the states of snapshot slots[u] (a row past the batch: none)."""
        return cache.replace(conv=tuple(c.at[rows].set(s[jnp.minimum(slots, s.shape[0] - 1)], mode="drop")
                                        for s, c in zip(cache.snap_conv, cache.conv)),
                             ssm=tuple(c.at[rows].set(s[jnp.minimum(slots, s.shape[0] - 1)], mode="drop")
                                       for s, c in zip(cache.snap_ssm, cache.ssm)))

    def extra_slots(self, T: int, paged: bool) -> int:
        return self.kv.extra_slots(T, paged)

    def commit(self, cache: HybridCache, layout: CacheLayout, pages: PageState | None, L, path, accept_len,
               active, in_place: bool = False, tuning=DEFAULT_TUNING) -> HybridCache:
        """The KV part as `KVCacheKind.commit`; each linear layer's states become those
        after node path[accept_len - 1] (active rows; a one-token forward wrote them)."""
        kv = self.kv.commit(cache.kv, layout, pages, L, path, accept_len, active, in_place, tuning)
        if cache.pending is None:
            return cache.replace(kv=kv)
        conv, ssm = [], []
        for c, s, rec in zip(cache.conv, cache.ssm, cache.pending):
            if "k" in rec:
                new_c, new_s = replay_on_devices(c, s, rec, path, accept_len, tuning.gated_delta)
            else:
                new_c, new_s = checkpoint_commit(c, s, rec, path, accept_len)
            conv.append(jnp.where(active[:, None, None], new_c, c))
            ssm.append(jnp.where(active[:, None, None, None], new_s, s))
        return cache.replace(kv=kv, conv=tuple(conv), ssm=tuple(ssm), pending=None)


def conv_window(conv, inputs, count):
    """The conv state after `count` [B] more inputs: the last C - 1 of conv [B, C-1, Ch]
    followed by inputs [B, M, Ch] (count <= M) -> [B, C-1, Ch]."""
    Cm1 = conv.shape[1]
    seq = jnp.concatenate([conv, inputs.astype(conv.dtype)], axis=1)  # [B, C-1+M, Ch]
    idx = count[:, None] + jnp.arange(Cm1, dtype=jnp.int32)[None, :]  # [B, C-1]
    return jnp.take_along_axis(seq, idx[..., None], axis=1)


def replay_commit(conv, ssm, rec: dict, path, accept_len, tiles=None):
    """A replay record {x [B,N,Ch], k [B,N,Hk,Dk], v [B,N,Hv,Dv], g, beta [B,N,Hv]} -> the
    states after the accepted path (nodes path[:, :accept_len])."""
    along = {n: jnp.take_along_axis(a, path.reshape(path.shape + (1,) * (a.ndim - 2)), axis=1)
             for n, a in rec.items()}
    _, new_ssm = gated_delta_step(None, along["k"], along["v"], along["g"], along["beta"], ssm, accept_len,
                                  tiles=tiles)
    return conv_window(conv, along["x"], accept_len), new_ssm


def replay_on_devices(conv, ssm, rec: dict, path, accept_len, tiles=None):
    """`replay_commit`, per device on its own heads and channels under a mesh (the step
    kernel is a Pallas call, which XLA cannot split): conv [B,C-1,Ch] by channel, ssm and
    the record's k, v, g, beta by head, x by channel; path and accept_len replicated."""
    if not tp_size():
        return replay_commit(conv, ssm, rec, path, accept_len, tiles)
    states = (STATE_SPECS["conv"], STATE_SPECS["ssm"])
    return jax.shard_map(functools.partial(replay_commit, tiles=tiles),
                         in_specs=states + ({n: RECORD_SPECS[n] for n in rec}, P(), P()), out_specs=states,
                         check_vma=False)(conv, ssm, rec, path, accept_len)


def checkpoint_commit(conv, ssm, rec: dict, path, accept_len):
    """A checkpoint record {conv [B,N,C-1,Ch], ssm [B,N,Hv,Dk,Dv]} -> the states of node
    path[accept_len - 1]."""
    node = jnp.take_along_axis(path, (accept_len - 1)[:, None], axis=1)[:, 0]  # [B]

    def pick(a):
        return jnp.take_along_axis(a, node.reshape((-1,) + (1,) * (a.ndim - 1)), axis=1)[:, 0]
    return pick(rec["conv"]).astype(conv.dtype), pick(rec["ssm"])


def put_rows(old, new, rows, live):
    """old [B, ...] with request rows `rows` [A] (None: all, A = B; indices >= B: none)
    set to new [A, ...] where live [A]."""
    new = new.astype(old.dtype)
    if rows is None:
        return jnp.where(live.reshape((-1,) + (1,) * (old.ndim - 1)), new, old)
    rows = jnp.where(live, rows, old.shape[0])
    return old.at[rows].set(new, mode="drop")


def take_rows(a, rows):
    """a [B, ...] -> the rows `rows` [A] (None: all)."""
    return a if rows is None else a[jnp.minimum(rows, a.shape[0] - 1)]
