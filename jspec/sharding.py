"""Several devices: a target and its draft split over a 1-D mesh of devices.

For the Llama family the split is Megatron's: attention heads and MLP columns are divided among the devices
(`qkv_proj` and `gate_up_proj` column-parallel, `o_proj` and `down_proj` row-parallel, so
each layer needs one all-reduce after attention and one after the MLP), the embedding and
the LM head are divided over the vocabulary, norms are replicated, and every KV cache is
divided by KV head. jspec adds no communication of its own: the weights and caches carry
`NamedSharding`s over the mesh axis `AXIS`, the loop is traced under `jax.set_mesh`, and
XLA's SPMD partitioner inserts the collectives. Two exceptions run per device under
`shard_map`: the Pallas attention kernel (`over_heads`), and the embedding lookup
(`lookup_rows`), for which the GPU partitioner gathers the whole vocabulary-split table
on every batch-1 step (1 GB for Llama-3.1-8B over 2 GPUs).

Which weight is split how is the family's (or draft kind's) business: `split` in its
protocol returns its config and weights for n devices and a PartitionSpec tree
(`weight_specs`); Llama-architecture modules share `jspec.models.llama.split_llama`.
DeepSeek targets and MTP layers (`jspec.models.deepseek_split.split_deepseek`) split attention
by heads and the routed experts by expert, and run each decoder layer per device under
`shard_map` with their own two all-reduces (docs/design.md, "Several GPUs"); Qwen3.5 and
Qwen3-Next targets and MTP layers (`jspec.models.qwen3_next_split`) too, their Gated DeltaNet
layers by key heads.
"""
from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jspec.tensors import HostParam, StackedParam

AXIS = "tp"


def make_mesh(devices: int | Sequence[Any] | Mesh) -> Mesh:
    """A 1-D mesh over `AXIS`: the first n devices (an int), these devices, or a mesh with
    that one axis."""
    if isinstance(devices, Mesh):
        if devices.axis_names != (AXIS,):
            raise ValueError(f"mesh must have the one axis {AXIS!r}, got {devices.axis_names}")
        return devices
    if isinstance(devices, (int, np.integer)) and not isinstance(devices, bool):
        have = jax.devices()
        if not 1 <= devices <= len(have):
            raise ValueError(f"devices={devices}: this process has {len(have)} {have[0].platform} device(s)")
        devices = have[:devices]
    devices = list(devices)
    if not devices or not all(isinstance(d, jax.Device) for d in devices):
        raise TypeError("devices must be a count, a list of jax devices, or a jax.sharding.Mesh")
    if len(set(devices)) != len(devices):
        raise ValueError(f"devices lists a device twice: {devices}")
    return Mesh(np.asarray(devices), (AXIS,))


def tp_size() -> int:
    """Devices along `AXIS` in the mesh the current function is traced under (0: none, or
    inside a `jax.shard_map` over it, where the code runs on one device's block)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or AXIS not in mesh.axis_names or AXIS in getattr(mesh, "manual_axes", ()):
        return 0
    return int(mesh.shape[AXIS])


def device_sum(y, c):
    """A layer part's output under a config c with `per_device` and `jnp_dtype`: on one
    device y itself; in a device's block (a family's `per_device` config, run under
    `jax.shard_map`) its float32 partial sum added up over the devices (one all-reduce), in
    the model's dtype."""
    if not c.per_device:
        return y
    return jax.lax.psum(y.astype(jnp.float32), AXIS).astype(c.jnp_dtype)


def constrain_heads(buf: jax.Array, head_axis: int) -> jax.Array:
    """A cache buffer laid out by head on `head_axis`, split over `AXIS` when traced under a
    mesh (unchanged otherwise)."""
    if not tp_size():
        return buf
    spec = [None] * buf.ndim
    spec[head_axis] = AXIS
    return jax.lax.with_sharding_constraint(buf, P(*spec))


def over_heads(fn, q, k, v, kv_buf, meta):
    """fn(q, k, v, kv_buf, meta) -> (out, kv_buf) run per device on its own heads:
    q [B,T,H,Dh], k/v [B,T,Hkv,Dh], out [B,T,H,Dh] split on axis 2, the cache buffer on its
    KV-head axis (-2), meta replicated."""
    heads = P(None, None, AXIS, None)
    cache = P(*([None] * (kv_buf.ndim - 2)), AXIS, None)
    return jax.shard_map(fn, in_specs=(heads, heads, heads, cache, P()), out_specs=(heads, cache),
                         check_vma=False)(q, k, v, kv_buf, meta)


def lookup_rows(table: jax.Array, ids: jax.Array) -> jax.Array:
    """table[ids]: rows of an embedding table [V, D] for ids [...] -> [..., D]. Under a mesh
    whose size divides V (the table is then split over the vocabulary, `weight_specs`), each
    device looks up the ids among its own rows, zeroes the rest, and one all-reduce of the
    [..., D] result sums the single nonzero contribution, so the values are the table's
    own (Megatron's vocabulary-parallel embedding)."""
    n = tp_size()
    if not n or table.shape[0] % n:
        return jnp.take(table, ids, axis=0)

    def local(rows, ids):
        first = jax.lax.axis_index(AXIS) * rows.shape[0]
        mine = (ids >= first) & (ids < first + rows.shape[0])
        out = jnp.take(rows, jnp.where(mine, ids - first, 0), axis=0)
        return jax.lax.psum(jnp.where(mine[..., None], out, jnp.zeros((), out.dtype)), AXIS)

    return jax.shard_map(local, in_specs=(P(AXIS, None), P()), out_specs=P(), check_vma=False)(table, ids)


# --------------------------------------------------------------------------- weights

def _keys(path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def weight_specs(weights, n: int, splits: dict, vocab_splits: tuple = ()):
    """The PartitionSpec tree of a weight tree over n devices: a weight whose path ends
    with a key pair (or equals a key tuple) of `splits` gets that split, the rest are
    replicated. A split that does not divide is an error, except for paths in
    `vocab_splits` (embeddings and heads), which are then replicated."""
    def spec(keys, w):
        key = keys[-2:] if keys[-2:] in splits else keys
        s = splits.get(key)
        if s is None:
            return P()
        axis = list(s).index(AXIS)
        if w.shape[axis] % n:
            if key in vocab_splits:
                return P()
            raise ValueError(f"weight {'/'.join(keys)} of shape {tuple(w.shape)} cannot be split over {n} devices")
        return s
    return map_weights(spec, weights)


def check_divides(fits, n: int, family: str, attention_bias: bool, devices: int) -> None:
    """A family's split checks (`split` of the DeepSeek and Qwen3.5 families): each (size,
    what) of `fits` divides by n; no attention bias (o_proj's bias would be added on every
    device); not split already."""
    for size, what in fits:
        if size % n:
            raise ValueError(f"{size} {what} cannot be split over {n} devices")
    if attention_bias:
        raise ValueError(f"a {family} model with attention biases cannot be split over devices yet (o_proj's bias "
                         "would be added on every device)")
    if devices != 1:
        raise ValueError(f"this model is split over {devices} devices already")


def kv_heads_over(num_kv_heads: int, n: int) -> int:
    """KV heads of a model split over n devices: Hkv, or n when the devices outnumber the KV
    heads (each KV head is then repeated n / Hkv times, as SGLang and vLLM do)."""
    if num_kv_heads % n == 0:
        return num_kv_heads
    if n % num_kv_heads:
        raise ValueError(f"{num_kv_heads} KV heads cannot be split over {n} devices, nor repeated ({n} is not a "
                         f"multiple of {num_kv_heads})")
    return n


def take_columns(w, cols: np.ndarray):
    """w's last-axis entries `cols` (a kernel's columns, a bias' or a vector's entries, each
    stacked expert's columns), lazily for host weights."""
    if isinstance(w, StackedParam):
        return w.map(lambda m: m.take_rows(cols))
    if isinstance(w, HostParam) and (w.transposed or w.ndim == 1):
        return w.take_rows(cols)  # a kernel's columns are its source rows
    return jnp.take(w, jnp.asarray(cols), axis=w.ndim - 1)


def take_rows(w, rows: np.ndarray):
    """w's first-axis entries `rows` (a conv weight's channels, a vector's entries), lazily
    for host weights stored untransposed."""
    if isinstance(w, HostParam):
        if w.transposed:
            raise ValueError(f"take_rows: a transposed host weight {w.shape} (its rows are its source's columns)")
        return w.take_rows(rows)
    return jnp.take(w, jnp.asarray(rows), axis=0)


def blocks_by_device(sizes, n: int) -> np.ndarray:
    """Entries of an axis made of parts of the given sizes ([gate | up], [q | k | v], ...)
    reordered so that device d's contiguous block is [its 1/n of the first part | its 1/n of
    the second | ...]."""
    starts = np.cumsum([0] + list(sizes[:-1]))
    return np.concatenate([np.r_[tuple(slice(s + d * (w // n), s + (d + 1) * (w // n)) for s, w in zip(starts, sizes))]
                           for d in range(n)])


def halves_by_device(width: int, n: int) -> np.ndarray:
    """Columns of a [gate | up] pair of width 2 * width reordered so that device d's
    contiguous block is [its gate columns | its up columns]."""
    return blocks_by_device((width, width), n)


def map_weights(fn, weights):
    """fn(path keys, weight) over a weight tree whose leaves may be `HostParam`s."""
    return jax.tree_util.tree_map_with_path(lambda path, w: fn(_keys(path), w), weights,
                                            is_leaf=lambda x: isinstance(x, HostParam))


def shardings(mesh: Mesh, specs):
    """A PartitionSpec tree -> NamedShardings over `mesh`."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def replicated(mesh: Mesh | None, tree):
    """Host arrays (loop inputs) on every device of `mesh` (on the default device if None)."""
    if mesh is None:
        return jax.device_put(tree)
    return jax.device_put(tree, NamedSharding(mesh, P()))
