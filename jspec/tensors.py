"""Checked access to Hugging Face tensors, and the conversions both directions share.

`Tensors` takes tensors by name with shape checks, then reports anything left over, so a
missing, extra or mis-shaped tensor fails naming it. Projections are Hugging Face [out, in]
on disk and [in, out] (`kernel`) in jspec.

What `Tensors` hands out is a `HostParam`: a description of a weight (which rows of which
memory-mapped tensors, transposed or not, in which dtype) that reads nothing until
`read(index)` asks for a block of it. `place` turns a tree of them into jax arrays, whole
on one device or block by block onto the devices of a sharding (`jspec.sharding`), so a
model split over several GPUs is never assembled in host memory or on one GPU.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jspec.quantization import GROUP, KV_SCALE_NAMES, SCALE_SUFFIX, dequantize_host, groups_of, kv_cache_scales

_NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


class HostParam:
    """A weight still on the host: rows `order` of the concatenation of `parts` along axis
    0 (numpy arrays, usually memory maps of safetensors files), transposed when
    `transposed` (2-D only), as `dtype`. `read` reads only the block it is asked for."""

    def __init__(self, parts, dtype, order=None, transposed: bool = False):
        self.parts = tuple(parts)
        self.dtype = np.dtype(dtype)
        rows = sum(p.shape[0] for p in self.parts)
        self.order = None if order is None else np.asarray(order, np.int64)
        n = rows if self.order is None else len(self.order)
        self.source_shape = (n,) + tuple(self.parts[0].shape[1:])
        self.transposed = transposed

    @property
    def shape(self) -> tuple[int, ...]:
        return self.source_shape[::-1] if self.transposed else self.source_shape

    @property
    def ndim(self) -> int:
        return len(self.source_shape)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * self.dtype.itemsize

    def _replace(self, **kw) -> "HostParam":
        args = dict(parts=self.parts, dtype=self.dtype, order=self.order, transposed=self.transposed)
        args.update(kw)
        return HostParam(**args)

    @property
    def T(self) -> "HostParam":
        if self.ndim != 2:
            raise ValueError(f"only 2-D weights transpose, this one has shape {self.shape}")
        return self._replace(transposed=not self.transposed)

    def astype(self, dtype) -> "HostParam":
        return self._replace(dtype=dtype)

    def take_rows(self, index) -> "HostParam":
        """The source rows `index` (axis 0 before any transpose: a kernel's columns)."""
        base = np.arange(self.source_shape[0]) if self.order is None else self.order
        return self._replace(order=base[np.asarray(index, np.int64)])

    def read(self, index: tuple = ()) -> np.ndarray:
        """The block `index` (a tuple of slices over `shape`, as `jax.make_array_from_callback`
        passes) as a contiguous numpy array."""
        index = tuple(index) + (slice(None),) * (self.ndim - len(index))
        src = index[::-1] if self.transposed else index
        rows = np.arange(self.source_shape[0])[src[0]]
        if self.order is not None:
            rows = self.order[rows]
        rest = tuple(len(range(*s.indices(n))) for s, n in zip(src[1:], self.source_shape[1:]))
        out = np.empty((len(rows),) + rest, self.parts[0].dtype)
        start = 0
        for part in self.parts:
            n = part.shape[0]
            hit = (rows >= start) & (rows < start + n)
            if hit.any():
                local = rows[hit] - start
                if hit.all() and np.array_equal(local, np.arange(local[0], local[0] + len(local))):
                    out = part[(slice(local[0], local[0] + len(local)),) + src[1:]]  # one contiguous read
                else:
                    out[hit] = part[(local,) + src[1:]]
            start += n
        if self.transposed:
            out = out.T
        return np.ascontiguousarray(out.astype(self.dtype, copy=False))

    def __array__(self, dtype=None, copy=None):
        a = self.read()
        return a if dtype is None else a.astype(dtype)


class StackedParam(HostParam):
    """HostParams of one shape stacked along a new axis 0 (a layer's experts, one tensor
    per expert and projection on disk): `read` reads only the members and the block its
    index names."""

    def __init__(self, members):
        self.members = tuple(members)
        if not self.members or len({(m.shape, m.dtype) for m in self.members}) != 1:
            raise ValueError("a StackedParam needs members of one shape and dtype")
        self.dtype = self.members[0].dtype
        self.parts, self.order, self.transposed = (), None, False
        self.source_shape = (len(self.members),) + tuple(self.members[0].shape)

    def map(self, fn) -> "StackedParam":
        """fn(member) for every member (a permutation of each member's columns, say)."""
        return StackedParam([fn(m) for m in self.members])

    def astype(self, dtype) -> "StackedParam":
        return self.map(lambda m: m.astype(dtype))

    def take_rows(self, index) -> "StackedParam":
        return StackedParam([self.members[i] for i in np.asarray(index, np.int64)])

    @property
    def T(self):
        raise ValueError("a stack of weights does not transpose")

    def read(self, index: tuple = ()) -> np.ndarray:
        index = tuple(index) + (slice(None),) * (self.ndim - len(index))
        members = np.arange(len(self.members))[index[0]]
        return np.stack([self.members[i].read(index[1:]) for i in members]).astype(self.dtype, copy=False)


def _whole(x: HostParam) -> jax.Array:
    """A whole weight on the default device; a transposed one is read in its source layout
    and transposed there (faster than numpy's strided copy)."""
    return jnp.asarray(x.T.read()).T if x.transposed else jnp.asarray(x.read())


def place(tree, shardings=None):
    """A tree whose leaves may be `HostParam`s -> the same tree of jax arrays: whole on the
    default device (shardings None), or each block read straight onto its device
    (`shardings`: a matching tree of `jax.sharding.Sharding`s)."""
    is_host = lambda x: isinstance(x, HostParam)
    if shardings is None:
        return jax.tree.map(lambda x: _whole(x) if is_host(x) else x, tree, is_leaf=is_host)

    def put(x, sharding):
        if is_host(x):
            return jax.make_array_from_callback(x.shape, sharding, x.read)
        return jax.device_put(x, sharding)
    return jax.tree.map(put, tree, shardings, is_leaf=is_host)


class Tensors:
    """Takes tensors by name with shape checks, then reports anything left over."""

    def __init__(self, tensors: dict[str, np.ndarray], where: str, dtype):
        self.tensors = dict(tensors)
        self.where = where
        self.dtype = jnp.dtype(dtype)

    def has(self, name):
        return name in self.tensors

    def kv_scales(self, prefix: str) -> HostParam | None:
        """An attention layer's FP8 KV-cache scales, `<prefix>k_scale` and `<prefix>v_scale`
        -> float32 [2] (`quantization.kv_cache_scales`: rounded up to powers of two); None
        where the checkpoint has neither. ValueError: one without the other."""
        names = tuple(prefix + n for n in KV_SCALE_NAMES)
        found = [n in self.tensors for n in names]
        if not any(found):
            return None
        if not all(found):
            missing = names[found.index(False)]
            raise ValueError(f"{self.where}: missing tensor {missing!r}: FP8 KV-cache scales come in pairs "
                             f"({' and '.join(KV_SCALE_NAMES)})")
        k, v = (self.tensors.pop(n) for n in names)
        return HostParam([kv_cache_scales(k, v, self.where, names)], np.float32)

    def latent_scale(self, prefix: str) -> HostParam | None:
        """An MLA layer's FP8 latent-cache scale: `<prefix>k_scale`, as vLLM applies it to
        the latent rows (a `<prefix>v_scale` beside it is checked, then dropped) -> float32
        [1], rounded up to a power of two; None where the checkpoint has no k_scale."""
        names = tuple(prefix + n for n in KV_SCALE_NAMES)
        if names[0] not in self.tensors:
            self.ignore(names[1])
            return None
        k = self.tensors.pop(names[0])
        v = self.tensors.pop(names[1], k)
        return HostParam([kv_cache_scales(k, v, self.where, names)[:1]], np.float32)

    def take(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """A tensor by name and shape; an FP8 weight kept beside its group scales
        (`jspec.quantization`) comes dequantized to float32 (only `linear` keeps it FP8)."""
        a = self._pop(name, shape)
        if name + SCALE_SUFFIX in self.tensors:
            scales = self._pop(name + SCALE_SUFFIX, tuple(shape[:-1]) + (groups_of(shape[-1]),))
            return np.swapaxes(dequantize_host(np.swapaxes(np.asarray(a), -1, -2),
                                               np.swapaxes(np.asarray(scales), -1, -2)), -1, -2)
        return a

    def kept_fp8(self, name: str, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray] | None:
        """A weight [out, in] (or a stack [E, out, in]) kept FP8 beside its group scales
        (`jspec.quantization`) -> (the FP8 weight, its scales [..., out, ceil(in / GROUP)]
        float32); None for another weight (left to be taken)."""
        if not self.has(name + SCALE_SUFFIX):
            return None
        return self._pop(name, shape), self._pop(name + SCALE_SUFFIX, tuple(shape[:-1]) + (groups_of(shape[-1]),))

    def _pop(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in self.tensors:
            raise ValueError(f"{self.where}: missing tensor {name!r}")
        a = self.tensors.pop(name)
        if tuple(a.shape) != tuple(shape):
            raise ValueError(f"{self.where}: tensor {name!r} has shape {tuple(a.shape)}, expected {tuple(shape)}")
        return a

    def param(self, *names_shapes, order=None, dtype=None) -> HostParam:
        """One or more tensors concatenated along axis 0 (rows `order` of that, if given),
        in the weights' dtype or `dtype`."""
        parts = [self.take(n, s) for n, s in names_shapes]
        return HostParam(parts, self.dtype if dtype is None else dtype, order)

    def as_param(self, a: np.ndarray, dtype=None) -> HostParam:
        """A host array built from taken tensors (the weights' dtype, or `dtype`)."""
        return HostParam([a], self.dtype if dtype is None else dtype)

    def experts(self, prefix: str, E: int, D: int, Fm: int, keep_fp8: bool = False) -> dict:
        """A layer's E routed experts, one tensor each (`prefix`{e}.{gate,up,down}_proj.weight:
        [Fm, D], [Fm, D], [D, Fm]) -> `stacked_experts`' stacks. With `keep_fp8`, FP8 weights
        kept beside their group scales (`jspec.quantization`) stay FP8 where D and Fm are
        whole groups of GROUP (the expert kernels read chunks of one group): {"gate_up",
        "down"} FP8 with {"gate_up_scale": [E, D / GROUP, 2Fm], "down_scale": [E, Fm / GROUP,
        D]} float32 (`quantization.expert_scales`); otherwise dequantized."""
        names = [(f"{prefix}{e}.{n}_proj.weight", (D, Fm) if n == "down" else (Fm, D))
                 for e in range(E) for n in ("gate", "up", "down")]
        if not (keep_fp8 and self._experts_stay_fp8(names, D, Fm)):
            return stacked_experts([self.take(n, s) for n, s in names], self.dtype)
        w, scales = zip(*(self.kept_fp8(n, s) for n, s in names))
        out = stacked_experts(w, w[0].dtype)
        return out | {k + "_scale": v for k, v in stacked_experts(scales, np.float32).items()}

    def _experts_stay_fp8(self, names_shapes, D: int, Fm: int) -> bool:
        """Whether experts' tensors stay FP8: D and Fm whole groups of GROUP (the expert
        kernels read chunks of one group) and every tensor kept FP8 beside its scales, all of
        one FP8 dtype."""
        names = [n for n, _ in names_shapes]
        return not (D % GROUP or Fm % GROUP) and all(self.has(n + SCALE_SUFFIX) for n in names) \
            and len({self.tensors[n].dtype for n in names}) == 1

    def fused_experts(self, prefix: str, E: int, D: int, Fm: int, keep_fp8: bool = False) -> dict:
        """A layer's E routed experts fused into one tensor each on disk (transformers'
        `prefix`gate_up_proj [E, 2Fm, D], gate then up, and `prefix`down_proj [E, D, Fm]) ->
        the stacks `experts` gives, FP8 with their scales where `experts` would keep them."""
        names = [(prefix + "gate_up_proj", (E, 2 * Fm, D)), (prefix + "down_proj", (E, D, Fm))]
        if keep_fp8 and self._experts_stay_fp8(names, D, Fm):
            (gate_up, gate_up_scale), (down, down_scale) = (self.kept_fp8(n, s) for n, s in names)
            swap = lambda a: np.ascontiguousarray(np.swapaxes(np.asarray(a), 1, 2))  # noqa: E731  [E, in, out]
            fp8, f32 = np.asarray(gate_up).dtype, np.float32
            return {"gate_up": self.as_param(swap(gate_up), fp8), "down": self.as_param(swap(down), fp8),
                    "gate_up_scale": self.as_param(swap(gate_up_scale), f32),
                    "down_scale": self.as_param(swap(down_scale), f32)}
        gate_up, down = (np.swapaxes(self.take(n, s), 1, 2) for n, s in names)
        return {"gate_up": self.as_param(np.ascontiguousarray(gate_up)), "down": self.as_param(np.ascontiguousarray(down))}

    def shared_experts(self, prefix: str, S: int, D: int, Fm: int, keep_fp8: bool = False) -> dict:
        """A shared MLP of width S*Fm (`prefix`{gate,up}_proj.weight [S*Fm, D],
        `prefix`down_proj.weight [D, S*Fm]) as S experts of width Fm: `stacked_experts`'
        stacks, FP8 with their scales as `experts` keeps them (D and Fm whole groups of
        GROUP: each expert's scales are whole groups of the MLP's), else dequantized."""
        names = [(f"{prefix}{n}_proj.weight", (D, S * Fm) if n == "down" else (S * Fm, D)) for n in ("gate", "up", "down")]
        kept = keep_fp8 and self._experts_stay_fp8(names, D, Fm)
        taken = [self.kept_fp8(n, s) if kept else (self.take(n, s), None) for n, s in names]

        def experts_of(gate, up, down):  # the MLP's tensors (or their scales) -> S experts' (gate, up, down)
            parts = zip(np.split(np.asarray(gate), S, axis=0), np.split(np.asarray(up), S, axis=0),
                        np.split(np.asarray(down), S, axis=1))
            return [w for ws in parts for w in ws]
        weights = experts_of(*(w for w, _ in taken))
        out = stacked_experts(weights, weights[0].dtype if kept else self.dtype)
        if kept:
            scales = stacked_experts(experts_of(*(sc for _, sc in taken)), np.float32)
            out |= {k + "_scale": v for k, v in scales.items()}
        return out

    def linear(self, *names_shapes, order=None):
        """A projection: Hugging Face [out, in] tensors, concatenated along `out` (rows
        `order` of that), as the [in, out] `kernel` that `jspec.models.layers.Linear` uses.
        FP8 tensors kept beside their group scales (`jspec.quantization.SCALE_SUFFIX`, all
        parts of one FP8 dtype) stay FP8, with the scales as `kernel_scale` [ceil(in /
        GROUP), out] float32 in the same column order."""
        scale_names = [n + SCALE_SUFFIX for n, _ in names_shapes]
        if all(map(self.has, scale_names)) and len({self.tensors[n].dtype for n, _ in names_shapes}) == 1:
            dtype = self.tensors[names_shapes[0][0]].dtype
            kernel = HostParam([self._pop(n, s) for n, s in names_shapes], dtype, order)
            scales = HostParam([self._pop(sn, (s[0], groups_of(s[1]))) for sn, (_, s) in zip(scale_names, names_shapes)],
                               np.float32, order)
            return {"kernel": kernel.T, "kernel_scale": scales.T}
        return {"kernel": self.param(*names_shapes, order=order).T}

    def ignore(self, *names):
        for n in names:
            self.tensors.pop(n, None)

    def finish(self):
        left = sorted(k for k in self.tensors if not k.endswith("rotary_emb.inv_freq"))
        if left:
            more = f" (and {len(left) - 5} more)" if len(left) > 5 else ""
            raise ValueError(f"{self.where}: unexpected tensors {left[:5]}{more}")


def kv_scale_tensors(attn: dict, prefix: str) -> dict:
    """An attention layer's FP8 KV-cache scales (its `kv_scale` param, if any) as the
    checkpoint tensors `Tensors.kv_scales` (GQA: [2]) or `Tensors.latent_scale` (MLA: [1])
    read: {<prefix>k_scale: [], <prefix>v_scale: []} or {<prefix>k_scale: []}."""
    if "kv_scale" not in attn:
        return {}
    scales = to_numpy(attn["kv_scale"], "float32")
    return {prefix + name: scales[i].reshape(()) for i, name in enumerate(KV_SCALE_NAMES[:scales.shape[0]])}


def stacked_experts(tensors, dtype) -> dict:
    """Experts' (gate [Fm, D], up [Fm, D], down [D, Fm]) tensors, in that order per expert ->
    {"gate_up": [n, D, 2Fm], "down": [n, Fm, D]} in `dtype`, read lazily (`StackedParam`: a
    device reads only its experts and its block of them)."""
    gate_up = [HostParam([g, u], dtype).T for g, u in zip(tensors[0::3], tensors[1::3])]
    return {"gate_up": StackedParam(gate_up), "down": StackedParam([HostParam([d], dtype).T for d in tensors[2::3]])}


def unstacked_experts(p: dict, dt: str) -> list:
    """`stacked_experts`' inverse: [(gate, up, down)] per expert, as on disk, in `dt` (FP8
    stacks dequantized with their scales)."""
    if "gate_up_scale" in p:
        gate_up, down = (dequantize_host(np.asarray(jax.device_get(p[n])), np.asarray(jax.device_get(p[n + "_scale"])))
                         .astype(_NP_DTYPES[dt]) for n in ("gate_up", "down"))
    else:
        gate_up, down = to_numpy(p["gate_up"], dt), to_numpy(p["down"], dt)
    Fm = down.shape[1]
    return [(np.ascontiguousarray(gate_up[e, :, :Fm].T), np.ascontiguousarray(gate_up[e, :, Fm:].T),
             np.ascontiguousarray(down[e].T)) for e in range(down.shape[0])]


def to_numpy(a, dtype: str) -> np.ndarray:
    """A (device) array as a host numpy array of `dtype` ('float32', 'bfloat16', 'float16')."""
    return np.asarray(jax.device_get(a)).astype(_NP_DTYPES[dtype])


def hf_linear(p: dict, dtype: str) -> np.ndarray:
    """A `Linear`'s [in, out] kernel as Hugging Face's [out, in] weight (an FP8 kernel
    dequantized with its `kernel_scale`)."""
    if "kernel_scale" in p:
        kernel = dequantize_host(np.asarray(jax.device_get(p["kernel"])), np.asarray(jax.device_get(p["kernel_scale"])))
        return np.ascontiguousarray(kernel.astype(_NP_DTYPES[dtype]).T)
    return np.ascontiguousarray(to_numpy(p["kernel"], dtype).T)
