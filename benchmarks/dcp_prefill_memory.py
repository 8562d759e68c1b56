"""Per-device scratch of one DCP prefill chunk's attention (kimik3.layers.mla.dcp_attention,
T > 1), from XLA's memory analysis of the compiled function on CPU with 8 fake devices (no GPU
needed): a 1024-token prefill chunk of 8 rows and 12 heads (one TP8 rank) over a paged bf16 MLA
cache split over DCP8.

  S=32768 PYTHONPATH=. python3 benchmarks/dcp_prefill_memory.py    # S: positions a row
"""
import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import sharding  # noqa: E402
from kimik3.layers.mla import dcp_attention  # noqa: E402

B, T, H, P = 8, 1024, 12, 16
S = int(os.environ.get("S", 32768))
sd = jax.ShapeDtypeStruct
args = (sd((B, T, H, 512), jnp.bfloat16), sd((B, T, H, 64), jnp.bfloat16),
        sd((B * S // P, P, 576), jnp.bfloat16), sd((B, S // P), jnp.int32),
        sd((B,), jnp.int32), sd((B,), jnp.int32))
with jax.set_mesh(sharding.make_mesh(dcp=8)):
    f = jax.jit(lambda q, r, c, t, s, n: dcp_attention(q, r, c, s, n, 0.07, ("dcp",),
                                                       backend="reference", page_table=t))
    m = f.lower(*args).compile().memory_analysis()
print(f"B{B} T{T} H{H} S{S} DCP8 bf16: scratch {m.temp_size_in_bytes / 2**30:.2f} GiB a device")
