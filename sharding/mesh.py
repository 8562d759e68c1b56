"""Device meshes with the library's axis names."""
from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Mesh

AXES = ("data", "tensor", "dcp", "expert")


def make_mesh(data: int = 1, tensor: int = 1, dcp: int = 1, expert: int = 1, devices=None) -> Mesh:
    """A mesh over data x tensor x dcp x expert (axes of size 1 are kept, so specs stay valid)."""
    sizes = (data, tensor, dcp, expert)
    if any(not isinstance(s, int) or s < 1 for s in sizes):
        raise ValueError(f"mesh axis sizes must be positive ints, got {dict(zip(AXES, sizes))}")
    devices = list(jax.devices() if devices is None else devices)
    n = math.prod(sizes)
    if n > len(devices):
        raise ValueError(f"a {dict(zip(AXES, sizes))} mesh needs {n} devices, only {len(devices)} are visible")
    return Mesh(np.array(devices[:n]).reshape(sizes), AXES)
