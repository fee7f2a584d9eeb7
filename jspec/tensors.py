"""Checked access to Hugging Face tensors, and the conversions both directions share.

`Tensors` takes tensors by name with shape checks, then reports anything left over, so a
missing, extra or mis-shaped tensor fails naming it. Projections are Hugging Face [out, in]
on disk and [in, out] (`kernel`) in jspec.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

_NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


class Tensors:
    """Takes tensors by name with shape checks, then reports anything left over."""

    def __init__(self, tensors: dict[str, np.ndarray], where: str, dtype):
        self.tensors = dict(tensors)
        self.where = where
        self.dtype = jnp.dtype(dtype)

    def has(self, name):
        return name in self.tensors

    def take(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        if name not in self.tensors:
            raise ValueError(f"{self.where}: missing tensor {name!r}")
        a = self.tensors.pop(name)
        if tuple(a.shape) != tuple(shape):
            raise ValueError(f"{self.where}: tensor {name!r} has shape {tuple(a.shape)}, expected {tuple(shape)}")
        return a

    def param(self, *names_shapes, axis=0, dtype=None):
        """Takes one or more tensors, concatenates them along `axis`, converts to jax (in
        the weights' dtype, or `dtype`)."""
        parts = [self.take(n, s) for n, s in names_shapes]
        a = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=axis)
        return self.as_param(a, dtype)

    def as_param(self, a: np.ndarray, dtype=None):
        """A host array built from taken tensors, as a jax array (the weights' dtype, or `dtype`)."""
        return jnp.asarray(a, dtype=self.dtype if dtype is None else dtype)

    def linear(self, *names_shapes):
        """A projection: Hugging Face [out, in] tensors, concatenated along `out`, as the
        [in, out] `kernel` that `jspec.models.llama.Linear` uses (transposed on device)."""
        return {"kernel": self.param(*names_shapes).T}

    def ignore(self, *names):
        for n in names:
            self.tensors.pop(n, None)

    def finish(self):
        left = sorted(k for k in self.tensors if not k.endswith("rotary_emb.inv_freq"))
        if left:
            more = f" (and {len(left) - 5} more)" if len(left) > 5 else ""
            raise ValueError(f"{self.where}: unexpected tensors {left[:5]}{more}")


def to_numpy(a, dtype: str) -> np.ndarray:
    """A (device) array as a host numpy array of `dtype` ('float32', 'bfloat16', 'float16')."""
    return np.asarray(jax.device_get(a)).astype(_NP_DTYPES[dtype])


def hf_linear(p: dict, dtype: str) -> np.ndarray:
    """A `Linear`'s [in, out] kernel as Hugging Face's [out, in] weight."""
    return np.ascontiguousarray(to_numpy(p["kernel"], dtype).T)
