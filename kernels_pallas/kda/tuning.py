"""Launch parameters of the chunked KDA prefill: `ChunkConfig`, the tuned configurations as a
table, and the rules for what a table row cannot fix.

A call's configuration (`chunk_config`):
  1. the TUNED row for (device kind, K, V, operand dtype), else the fallback row: the one measured
     configuration (H200, K = V = 128, bf16), whose tiles step 4 narrows to the head;
  2. every field the caller's ChunkConfig sets, over that row;
  3. the per-call rules for what follows the grid's size: `scan_groups` (`auto_scan_groups`) and
     the state scan's value tiles (`pick_block_v`), where still unset;
  4. tiles no wider than the head, then checked: each divides the head's K / V and is >= 16
     (Triton's smallest dot).
Rows are added where a device or shape has been measured (`python -m benchmarks kda`,
`--chunk-config`); figures live in BENCHMARKS.md. The ROCm targets have no row: they take the
fallback, which stays inside MI300X's 64 KiB of LDS per CU.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from .._backend import num_sms
from .chunk_common import C


@dataclasses.dataclass(frozen=True)
class ChunkConfig:
    """Launch parameters per stage (chunk_pallas.py's launches). None: from the tuning table or
    its rules (`chunk_config`); a set field overrides it."""
    # 1. diagonal blocks: key-tile width (a device loop over tiles), warps, pipeline stages
    diag_block_k: int | None = None
    num_warps_diag: int | None = None
    num_stages_diag: int | None = None
    # 2. off-diagonal blocks + inverse. Few warps: a 16x16 dot's accumulator is replicated on
    # every warp past the first two, so extra warps redo the whole inverse.
    block_k_inter: int | None = None
    num_warps_inter: int | None = None
    num_stages_inter: int | None = None
    # 3. W / U: the column tile over K and over V
    block_wu: int | None = None
    num_warps_wu: int | None = None
    num_stages_wu: int | None = None
    # 4. state scan: value-column tile (None: `pick_block_v`), the same for the two-level
    # scan's transition maps (K columns wide), two-level scan groups (None: `auto_scan_groups`;
    # 1: the plain sequential scan)
    block_v_state: int | None = None
    block_v_maps: int | None = None
    num_warps_state: int | None = None
    num_stages_state: int | None = None
    scan_groups: int | None = None
    # 5. output: value-column tile (wide, so q, G and A are read once per chunk), key tile
    block_v_out: int | None = None
    block_k_out: int | None = None
    num_warps_out: int | None = None
    num_stages_out: int | None = None


# key: (device kind, K, V, operand dtype); value: the launch parameters measured fastest there
# at the benchmark's prefill shapes (BENCHMARKS.md). The scan's grid-size choices are rules
# (`auto_scan_groups`, `pick_block_v`), so rows leave them unset.
TUNED = {
    ("NVIDIA H200", 128, 128, "bfloat16"): ChunkConfig(
        diag_block_k=32, num_warps_diag=1, num_stages_diag=2,
        block_k_inter=16, num_warps_inter=1, num_stages_inter=3,
        block_wu=64, num_warps_wu=4, num_stages_wu=3,
        num_warps_state=4, num_stages_state=2,
        # out's 3 stages would need more shared memory than MI300X's 64 KiB of LDS
        block_v_out=128, block_k_out=32, num_warps_out=4, num_stages_out=2),
}
FALLBACK = ("NVIDIA H200", 128, 128, "bfloat16")


def tuned_row(device_kind: str, K: int, V: int, op_dtype) -> ChunkConfig:
    """The table's row for this device and head shape, else the fallback row."""
    return TUNED.get((device_kind, K, V, jnp.dtype(op_dtype).name), TUNED[FALLBACK])


def pick_block_v(B, H, V, n_sm=None):
    """The scan's value-column tile. Each V tile re-reads the chunk's W and Kg, so the scan is
    bound by those bytes and 64 columns are the default; narrower tiles only where 64-column
    ones would leave more than half the SMs idle."""
    n_sm = n_sm or num_sms()
    for bv in (64, 32, 16):
        if V % bv == 0 and (B * H * (V // bv) >= n_sm // 2 or bv == 16):
            return bv
    return V


def auto_scan_groups(B, H, V, n_chunks, n_sm=None, min_chunks=8):
    """Groups for the two-level scan when B * H sequential programs leave the GPU idle: the
    smallest power of two that gives >= 2 programs per SM (32 value columns a program), keeping
    >= `min_chunks` chunks a group; 1 (plain sequential scan) when the batch fills the GPU.
    A cost model (BENCHMARKS.md). n_sm: the device's SM count."""
    n_sm = n_sm or num_sms()
    groups = 1
    while (B * H * groups * max(V // 32, 1) < 2 * n_sm
           and n_chunks // (groups * 2) >= min_chunks):
        groups *= 2
    return groups


def _device_kind() -> str:
    try:
        return str(jax.devices()[0].device_kind)
    except RuntimeError:  # no backend
        return ""


def chunk_config(B, T, H, K, V, op_dtype, config: ChunkConfig | None = None, *,
                 device_kind: str | None = None, n_sm: int | None = None) -> ChunkConfig:
    """The configuration a [B, T, H] call with heads of K keys and V values runs with, every
    field set (see the module docstring). device_kind / n_sm: default the first device's."""
    row = tuned_row(_device_kind() if device_kind is None else device_kind, K, V, op_dtype)
    user = {} if config is None else {f.name: getattr(config, f.name)
                                      for f in dataclasses.fields(config)
                                      if getattr(config, f.name) is not None}
    cfg = dataclasses.replace(row, **user)
    n_chunks = -(-T // C)
    if cfg.scan_groups is None:
        groups = auto_scan_groups(B, H, V, n_chunks, n_sm=n_sm)
    elif cfg.scan_groups < 1:
        raise ValueError(f"scan_groups={cfg.scan_groups}: >= 1 (1: the sequential scan)")
    else:
        groups = max(1, min(cfg.scan_groups, n_chunks))
    cfg = dataclasses.replace(
        cfg, scan_groups=groups,
        block_v_state=(pick_block_v(B * groups, H, V, n_sm=n_sm) if cfg.block_v_state is None
                       else cfg.block_v_state),
        block_v_maps=(pick_block_v(B * groups, H, K, n_sm=n_sm) if cfg.block_v_maps is None
                      else cfg.block_v_maps),
        diag_block_k=min(cfg.diag_block_k, K), block_k_inter=min(cfg.block_k_inter, K),
        block_k_out=min(cfg.block_k_out, K), block_v_out=min(cfg.block_v_out, V))
    tiles = {"diag_block_k": (cfg.diag_block_k, K), "block_k_inter": (cfg.block_k_inter, K),
             "block_wu": (min(cfg.block_wu, K), K), "block_wu ": (min(cfg.block_wu, V), V),
             "block_v_state": (cfg.block_v_state, V), "block_v_maps": (cfg.block_v_maps, K),
             "block_k_out": (cfg.block_k_out, K),
             "block_v_out": (cfg.block_v_out, V)}
    bad = [f"{name.strip()}={t} (head {n})" for name, (t, n) in tiles.items()
           if t < 16 or n % t]
    if bad:
        raise ValueError(f"ChunkConfig tiles {', '.join(bad)}: each must divide the head's "
                         "K / V and be >= 16")
    return cfg
