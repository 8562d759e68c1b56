"""Host-memory tier of the prefix cache: copies of device arrays (evicted MLA pages, KDA
checkpoints) in the host memory kind JAX offers (`pinned_host` where the backend has it, so
host -> device transfers run at DMA speed), under a byte budget.

Saving is one `jax.device_put` to the host memory kind, which is asynchronous: it returns at once
and the copy overlaps whatever the device runs next (nothing waits on it until a restore reads it).
Restoring moves every item a request needs in one `jax.device_put` call.
"""
from __future__ import annotations

import jax
import numpy as np

HOST_KINDS = ("pinned_host", "unpinned_host")


def host_memory_kind(device=None) -> str | None:
    """The best host memory kind `device` can address, or None (then copies go through numpy)."""
    device = device or jax.devices()[0]
    kinds = {m.kind for m in device.addressable_memories()}
    return next((k for k in HOST_KINDS if k in kinds), None)


class HostItem:
    __slots__ = ("arrays", "shardings", "nbytes")

    def __init__(self, arrays, shardings, nbytes):
        self.arrays, self.shardings, self.nbytes = arrays, shardings, nbytes


class HostTier:
    def __init__(self, budget_bytes: int):
        self.budget = int(budget_bytes)
        self.used = 0
        self.kind = host_memory_kind()
        self.saved_bytes = 0
        self.restored_bytes = 0

    def fits(self, nbytes: int) -> bool:
        return self.used + nbytes <= self.budget

    def save(self, arrays, nbytes: int) -> HostItem:
        """Start copying `arrays` (a pytree of device arrays) to host; returns without waiting.
        nbytes: what the copy counts against the budget (the engine's per-device bytes)."""
        shardings = jax.tree.map(lambda a: a.sharding, arrays)
        if self.kind is not None:
            host = jax.device_put(arrays, jax.tree.map(lambda s: s.with_memory_kind(self.kind), shardings))
        else:  # no host memory kind on this backend: a blocking copy into numpy
            host = jax.tree.map(np.asarray, arrays)
        self.used += nbytes
        self.saved_bytes += nbytes
        return HostItem(host, shardings, nbytes)

    def drop(self, item: HostItem):
        self.used -= item.nbytes

    def load(self, items: list[HostItem]) -> list:
        """Device copies of `items` (one transfer for all of them); the items stay on host."""
        if not items:
            return []
        self.restored_bytes += sum(i.nbytes for i in items)
        return jax.device_put([i.arrays for i in items], [i.shardings for i in items])
