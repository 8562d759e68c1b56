"""Dense MLP and the (latent) MoE: sigmoid router with a selection-only correction bias, top-k,
renormalise, routed scaling; sort tokens by expert and run grouped matmuls (no expert computes
tokens it was not chosen for; a decode step's few pairs go unsorted, a tile each); weighted
combine; K3's latent path (down, experts in latent space, RMSNorm, up) and the shared experts.
Math: reference/k3_checkpoint.md section 3.

The math is written once, as pure functions of a parameter dict (`moe_apply`, `experts_combine`,
`mlp_apply`); the Linen modules only declare the weights and call them. Under a mesh the same
`moe_apply` runs per shard inside shard_map (`moe_sharded`), told by `MoEAxes` (the placement in
sharding/rules.py) which of its weights are split over which mesh axis and therefore which partial
sums to reduce.

MoE dedup. Every TP rank holds the same latent vector after the experts'
reduction and the latent RMSNorm. Without dedup each rank multiplies it by the whole latent ->
hidden up-projection and adds the result to the all-reduced shared-expert output. With dedup each
rank multiplies only by the up-projection columns it owns (D / TP output coordinates, the only
rows of HF's [D, L] weight it loads), adds them into its own slice of the shared experts' partial
sum, and the all-reduce the shared experts need anyway assembles both: no new collective, a 1/TP
share of the up-projection FLOPs and weights per rank, and every coordinate receives its routed
contribution exactly once. Collectives per layer either way: one all-reduce of the routed latent
partial sums (when the experts' intermediate is split over TP) and one of the output; without
dedup XLA may combine the two into one all-reduce of the same bytes (tests/sharding/test_moe_sharding.py).

Expert parallelism (Config.moe_placement "expert", or "auto" on a mesh with an `expert` axis > 1):
the routed experts' weights are split over `expert` along the expert dimension, so each rank holds
E / ep whole experts (and, with a tensor axis too, 1/TP of their intermediate). Tokens reach the
MoE replicated over `expert`, so every rank already holds all of them: the token gather costs
nothing. Each rank routes every token, runs the grouped matmuls on the (token, expert) pairs of
its own experts only, and the weighted combine is one all-reduce over (expert, tensor) of the
latent partial sums. Shared experts and the up-projection stay under tensor parallelism.
"""
from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
import flax.linen as nn
from jax import shard_map
from jax.sharding import PartitionSpec as P

from kernels_pallas import resolve_backend
from kernels_pallas.moe import (MXFP4PairedWeight, MXFP4Weight, gather_rows, moe_gmm,
                                moe_gmm_glu, mxfp4)
from kernels_pallas.moe.topk import top_k_scores
from sharding.rules import MoEAxes, moe_axes, param_specs
from .common import F32, INIT_STD, Weight, declared_axes, glu, project, rms_normalize

HIGHEST = jax.lax.Precision.HIGHEST
BF16 = jnp.bfloat16
# From this many bf16 rows the router runs on tensor cores (router_logits). Below it the fp32
# matmul is a memory-bound GEMV reading the fp32 gate once, cheaper than writing and reading its
# three bf16 pieces; above it the fp32 matmul is compute-bound on CUDA cores (FFMA).
ROUTER_SPLIT_ROWS = 256


def split_bf16(w):
    """Three bf16 arrays whose fp32 sum is w exactly: each takes the next leading bits of what the
    ones before left (the last at most 8). By bit masks, not rounding conversions: XLA:GPU treats
    an fp32 -> bf16 -> fp32 round trip as excess precision and removes it, which made the first
    piece w itself and the others zero."""
    def lead(v):  # v truncated to bf16's 8 significant bits, as (bf16, the same value in fp32)
        bits = jax.lax.bitcast_convert_type(v, jnp.uint32)
        top = jax.lax.bitcast_convert_type((bits >> 16).astype(jnp.uint16), BF16)
        return top, jax.lax.bitcast_convert_type(bits & jnp.uint32(0xFFFF0000), F32)

    hi, hi32 = lead(w)
    mid, mid32 = lead(w - hi32)  # exact: the subtraction removes leading bits
    lo, _ = lead(w - hi32 - mid32)  # at most 8 significant bits remain
    return hi, mid, lo


def router_fp32(x, gate):
    """x @ gate in fp32 (HIGHEST: no reduced-precision passes)."""
    return jnp.dot(x.astype(F32), gate.astype(F32), precision=HIGHEST)


def router_pieces(x, gate):
    """x (bf16) @ gate as three bf16 matmuls against the gate's exact bf16 pieces, accumulated in
    fp32 (tensor cores). A bf16 x times a bf16 piece is exact in fp32, so this equals
    router_fp32 up to the order of the fp32 additions."""
    hi, mid, lo = (jnp.dot(x.astype(BF16), piece, preferred_element_type=F32)
                   for piece in split_bf16(gate.astype(F32)))
    return (hi + mid) + lo


def router_logits(x, gate):
    """fp32 router logits x [N, D] @ gate [D, E] (tests/model: the same expert ids as the fp32
    matmul on a large sample). bf16 activations and a bf16 gate (K3's storage): one bf16 matmul
    accumulating in fp32, whose products are exact, so it is the fp32 matmul's arithmetic on
    tensor cores, reading half the bytes. A wider gate (Kimi Linear's fp32): its bf16 pieces
    from ROUTER_SPLIT_ROWS bf16 rows, else the fp32 matmul. (`moe_apply` computes K3's case in the
    launch of the layer's other input projections at decode widths: the same products, summed in
    the kernel's order.)"""
    if x.dtype == BF16 and gate.dtype == BF16:
        return jnp.dot(x, gate, preferred_element_type=F32)
    if x.dtype == BF16 and x.shape[0] >= ROUTER_SPLIT_ROWS:
        return router_pieces(x, gate)
    return router_fp32(x, gate)


def _proj(x, p, dt, backend=None):
    """x @ kernel in the compute dtype (what flax's Dense does)."""
    return project(x, [p["kernel"]], dt, backend)[0]


def mlp_down(cfg, p, a, b, backend=None):
    """A gated MLP's output from its gate and up projections a, b."""
    dt = cfg.jnp_dtype
    return _proj(glu(cfg, a.astype(F32), b.astype(F32)).astype(dt), p["down_proj"], dt, backend)


def mlp_apply(cfg, p, x, backend=None):
    """Gated MLP (gate_proj, up_proj, down_proj); partial over ranks if the intermediate is split."""
    a, b = project(x, [p["gate_proj"]["kernel"], p["up_proj"]["kernel"]], cfg.jnp_dtype, backend)
    return mlp_down(cfg, p, a, b, backend)


def mlp_weights(cfg, intermediate: int) -> dict:
    """Declare gate/up/down kernels in the calling (compact) module; returns them as a dict."""
    D, pdt = cfg.hidden_size, cfg.jnp_param_dtype
    up = ((D, intermediate), ("embed", "mlp"))
    shapes = {"gate_proj": up, "up_proj": up, "down_proj": ((intermediate, D), ("mlp", "embed"))}
    return {n: {"kernel": Weight(s, pdt, axes, name=n)()} for n, (s, axes) in shapes.items()}


class MLP(nn.Module):
    cfg: object
    intermediate: int

    @nn.compact
    def __call__(self, x, backend=None):
        return mlp_apply(self.cfg, mlp_weights(self.cfg, self.intermediate), x, backend)


class MLPWeights(nn.Module):
    """An MLP's weights as a dict (the shared experts, handed to `moe_apply`)."""
    cfg: object
    intermediate: int

    @nn.compact
    def __call__(self):
        return mlp_weights(self.cfg, self.intermediate)


def route(logits, bias, cfg, backend=None):
    """Router: (expert ids [N, k], combine weights [N, k] fp32) from fp32 router logits [N, E].

    The correction bias only decides which experts are selected; the weights come from the
    unbiased sigmoid scores, renormalised over the chosen k, times routed_scaling_factor. Without
    expert groups the choice is one kernel on the Pallas backend (`top_k_scores`: the same ids
    and scores bitwise), where XLA sorts.
    """
    scores = jax.nn.sigmoid(logits.astype(F32))
    if cfg.num_expert_group == 1:
        idx, w = top_k_scores(scores, bias.astype(F32), cfg.num_experts_per_token, backend=backend)
        return idx, _combine_weights(w, cfg)
    # group-limited selection (DeepSeek V3): the best groups by their top-2 sum
    choice = scores + bias.astype(F32)
    N, E = choice.shape
    grouped = choice.reshape(N, cfg.num_expert_group, E // cfg.num_expert_group)
    group_score = jax.lax.top_k(grouped, 2)[0].sum(-1)
    keep = jax.lax.top_k(group_score, cfg.topk_group)[1]
    group_mask = jnp.zeros_like(group_score, bool).at[jnp.arange(N)[:, None], keep].set(True)
    choice = jnp.where(jnp.repeat(group_mask, E // cfg.num_expert_group, axis=1), choice, -jnp.inf)
    _, idx = jax.lax.top_k(choice, cfg.num_experts_per_token)
    return idx, _combine_weights(jnp.take_along_axis(scores, idx, axis=-1), cfg)


def _combine_weights(w, cfg):
    """The chosen experts' scores w [N, k], renormalised over the k if the config says so, times
    routed_scaling_factor."""
    if cfg.moe_renormalize and cfg.num_experts_per_token > 1:
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
    return w * cfg.routed_scaling_factor


# Up to this many (token, expert) pairs their order by expert is counted (one fused compare and
# sum) rather than sorted: a sort kernel costs several launches even for a decode step's few pairs.
COUNTED_ORDER_PAIRS = 4096


def expert_order(key):
    """(order, rank) of key [M] int: the stable ascending order (what argsort(stable=True)
    returns) and each entry's place in it (order[rank[i]] == i). The same permutation either way."""
    M = key.shape[0]
    at = jnp.arange(M, dtype=jnp.int32)
    if M <= COUNTED_ORDER_PAIRS:  # entries before i: smaller keys, and equal keys earlier
        before = (key[None, :] < key[:, None]) | ((key[None, :] == key[:, None]) & (at[None, :] < at[:, None]))
        rank = jnp.sum(before, axis=1, dtype=jnp.int32)
        return jnp.zeros((M,), jnp.int32).at[rank].set(at, unique_indices=True), rank
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    return order, jnp.zeros((M,), jnp.int32).at[order].set(at, unique_indices=True)


def _grouped_weight(experts: dict, name: str, dtype, layout: str = "k3"):
    """Routed expert weight `name` for moe_gmm: dense [E, in, out], or MXFP4 kept packed
    ([E, out, in/2] + scales; the kernel dequantises in place, the reference path dequantises),
    its bytes in Config.mxfp4_layout."""
    if name in experts:
        return experts[name].astype(dtype)
    cls = MXFP4PairedWeight if layout == "paired" else MXFP4Weight
    return cls(experts[f"{name}_packed"], experts[f"{name}_scale"])


# Up to this many (token, expert) pairs the kernels take them in pair order, a row tile each
# (`moe_gmm(row_groups=)`): no sort, counts, tile plan or un-permute, about six launches a layer
# at a decode step's one to four tokens. A token's k experts are distinct, so one token re-reads
# no weights; four tokens repeat an expert in ~2 of 64 pairs over K3's 896.
PAIR_ORDER_PAIRS = 64


def experts_combine(cfg, experts: dict, u, idx, weights, backend=None, first=0,
                    fuse_glu=False):
    """sum_j weights[n, j] * expert_{idx[n, j]}(u[n]) in fp32 [N, in], over the experts held here:
    `experts` holds E_local of them (its leading dimension), ids first .. first + E_local - 1;
    pairs routed elsewhere contribute 0. With the whole set (first 0, E_local = E) this is the
    layer's routed output; split intermediates give a partial sum. `fuse_glu`: gate/up and the
    activation in one kernel (see `moe_gmm_glu`); off by default: at K3 dims the two products
    plus the activation in XLA measured faster at every token count (BENCHMARKS.md, MoE).
    The kernel backends take up to PAIR_ORDER_PAIRS pairs unsorted; each pair's product is the
    same either way."""
    dt = cfg.jnp_dtype
    w = {n: _grouped_weight(experts, n, dt, cfg.mxfp4_layout) for n in ("w1", "w3", "w2")}
    E_local = w["w1"].shape[0]
    N, k = idx.shape
    key = idx.reshape(-1)  # every expert held here: the ids as they are (no launch at decode)
    if not (isinstance(first, int) and first == 0 and E_local == cfg.num_experts):
        local = key - first  # held elsewhere: E_local, sorted last (a zero row unsorted)
        key = jnp.where((local >= 0) & (local < E_local), local, E_local)
    pairs = resolve_backend(backend) != "reference" and N * k <= PAIR_ORDER_PAIRS
    if pairs:  # in pair order, a row tile each (group E_local: a zero row, a pair held elsewhere)
        rows, plan = jnp.arange(N * k, dtype=jnp.int32), dict(row_groups=key)
    else:
        order, rank = expert_order(key)
        rows = order[:N * min(k, E_local)]  # a token's k experts are distinct: its held pairs fit
        plan = dict(group_sizes=jnp.bincount(key, length=E_local + 1)[:E_local].astype(jnp.int32))
    # x split (where the kernel wants it) on the N tokens, then the rows gathered
    xs = gather_rows(u, rows // k, w["w1"], backend=backend, fused_glu=fuse_glu)
    act = "situ" if cfg.hidden_act == "situ" else "swiglu"
    h = moe_gmm_glu(xs, w["w1"], w["w3"], **plan, activation=act, backend=backend,
                    situ_beta=cfg.situ_beta, situ_linear_beta=cfg.situ_linear_beta, fuse=fuse_glu)
    y = moe_gmm(h.astype(dt), w["w2"], **plan, backend=backend)  # rows past the sum are zero
    if pairs:
        yk = y.reshape(N, k, -1)
    else:
        # Un-permute as a gather through the inverse of `rows` (pairs without a row read zeros),
        # then the weighted k-sum: the gather fuses into the sum, where a scatter of y into pair
        # order was a kernel of its own.
        pos = jnp.where(rank < rows.shape[0], rank, rows.shape[0])
        yk = jnp.take(y, pos.reshape(N, k), axis=0, mode="fill", fill_value=0)  # [N, k, D]
    return jnp.sum(weights.astype(F32)[..., None] * yk.astype(F32), axis=1)


def sum_partials(terms):
    """sum over ranks of [(x, axes x is a partial sum over)]: one psum over the union of the axes
    (a term whole along some of them counts on their rank 0 only); whole terms are added after."""
    union = tuple(dict.fromkeys(a for _, axes in terms for a in axes))
    partial = []
    for x, axes in terms:
        if axes:
            for a in union:
                if a not in axes:
                    x = jnp.where(jax.lax.axis_index(a) == 0, x, jnp.zeros_like(x))
            partial.append(x)
    whole = [x for x, axes in terms if not axes]
    parts = ([jax.lax.psum(functools.reduce(operator.add, partial), union)] if partial else []) + whole
    return functools.reduce(operator.add, parts)


def moe_apply(cfg, p, xf, backend=None, axes: MoEAxes = MoEAxes(), fuse_glu=False):
    """One MoE layer on tokens xf [N, D] -> [N, D]; p holds this rank's slices of the weights as
    `axes` says (the default: whole weights, no collective). Collectives: the routed experts'
    partial latent sums reduce over their axes (latent MoE; one psum), then one psum assembles
    shared experts + up-projection (dedup) or shared + routed (no latent). `fuse_glu`: see
    `experts_combine`."""
    dt = cfg.jnp_dtype
    L = cfg.routed_expert_hidden_size
    shared = p["shared_experts"] if cfg.num_shared_experts else None
    # the latent down-projection and the shared experts' gate and up: one launch at decode; with
    # bf16 tokens and a bf16 gate (K3) the router's logits too, kept in fp32 (`router_logits`)
    grouped_router = xf.dtype == BF16 and p["gate"].dtype == BF16 and dt == BF16
    ins = ([p["gate"]] if grouped_router else []) + ([p["routed_expert_down_proj"]["kernel"]] if L else []) + (
        [shared["gate_proj"]["kernel"], shared["up_proj"]["kernel"]] if shared else [])
    out_dtypes = [F32] * grouped_router + [None] * (len(ins) - grouped_router)
    outs = list(project(xf, ins, dt, backend, out_dtypes=out_dtypes))
    logits = outs.pop(0) if grouped_router else router_logits(xf, p["gate"])
    idx, w = route(logits, p["e_score_correction_bias"], cfg, backend)
    u = outs.pop(0) if L else xf
    first = 0
    if axes.expert:
        first = jax.lax.axis_index(axes.expert) * jax.tree.leaves(p["experts"])[0].shape[0]
    routed = experts_combine(cfg, p["experts"], u, idx, w, backend, first, fuse_glu)
    routed_axes = tuple(a for a in (axes.expert, axes.expert_inner) if a)
    terms = []
    if shared:
        terms.append((mlp_down(cfg, shared, *outs, backend), (axes.shared,) if axes.shared else ()))
    if not L:
        return sum_partials(terms + [(routed.astype(dt), routed_axes)])
    latent = (jax.lax.psum(routed, routed_axes) if routed_axes else routed).astype(dt)
    if cfg.latent_moe_use_norm:
        latent = p["routed_expert_norm"]["weight"].astype(dt) * rms_normalize(latent, cfg.rms_norm_eps)
    up = _proj(latent, p["routed_expert_up_proj"], dt, backend)  # [N, D], or this rank's D / TP columns
    if axes.up:  # dedup: the owned columns go into this rank's slice of the partial sum
        cols = up.shape[-1]
        up = jax.lax.dynamic_update_slice_in_dim(jnp.zeros((xf.shape[0], cfg.hidden_size), dt), up,
                                                 jax.lax.axis_index(axes.up) * cols, 1)
    return sum_partials(terms + [(up, (axes.up,) if axes.up else ())])


class Experts(nn.Module):
    """Routed experts' weights, stored dense ([E, in, out]) or as MXFP4 ([E, out, in/2] +
    [E, out, in/32]); returns them as a dict for `experts_combine`."""
    cfg: object

    @nn.compact
    def __call__(self):
        cfg = self.cfg
        E, I, Din = cfg.num_experts, cfg.moe_intermediate_size, cfg.expert_in_dim
        up = ((Din, I), ("expert_embed", "expert_mlp"))
        shapes = {"w1": up, "w3": up, "w2": ((I, Din), ("expert_mlp", "expert_embed"))}  # gate, up, down
        param = lambda name, init, shape, axes, *dtype: self.param(  # noqa: E731
            name, nn.with_logical_partitioning(init, ("expert", *axes)), (E, *shape), *dtype)
        experts = {}
        for n, ((din, dout), (ain, aout)) in shapes.items():
            if cfg.expert_format == "dense":
                experts[n] = param(n, nn.initializers.normal(INIT_STD), (din, dout), (ain, aout),
                                   cfg.jnp_param_dtype)
            else:  # [E, out, in / 2] bytes, [E, out, in / 32] scales
                experts[f"{n}_packed"] = param(
                    f"{n}_packed", lambda k, s: jax.random.randint(k, s, 0, 256, jnp.int32).astype(jnp.uint8),
                    (dout, din // 2), (aout, ain))
                experts[f"{n}_scale"] = param(  # 2^-8..2^-6: magnitudes near INIT_STD
                    f"{n}_scale", lambda k, s: jax.random.randint(k, s, 119, 122, jnp.int32).astype(jnp.uint8),
                    (dout, din // mxfp4.GROUP), (aout, ain))
        return experts


def moe_weights(module, cfg) -> dict:
    """Declare one MoE layer's weights in `module` (a compact Linen module), with their logical
    axes, and return them as the dict `moe_apply` takes."""
    D, L, pdt = cfg.hidden_size, cfg.routed_expert_hidden_size, cfg.jnp_param_dtype
    E = cfg.num_experts
    p = {"gate": module.param("gate", nn.with_logical_partitioning(nn.initializers.normal(INIT_STD),
                                                                   ("embed", "expert_score")),
                              (D, E), jnp.dtype(cfg.router_dtype)),
         "e_score_correction_bias": module.param(
             "e_score_correction_bias", nn.with_logical_partitioning(nn.initializers.normal(0.01), ("expert_score",)),
             (E,), F32)}
    if L:
        p["routed_expert_down_proj"] = {"kernel": Weight((D, L), pdt, ("embed", "moe_latent"),
                                                         name="routed_expert_down_proj")()}
    p["experts"] = Experts(cfg, name="experts")()
    if L and cfg.latent_moe_use_norm:
        p["routed_expert_norm"] = {"weight": Weight((L,), pdt, ("moe_latent",), nn.initializers.ones, "weight",
                                                    name="routed_expert_norm")()}
    if L:  # its output columns: the hidden coordinates each rank owns under MoE dedup
        p["routed_expert_up_proj"] = {"kernel": Weight((L, D), pdt, ("moe_latent", "dedup_embed"),
                                                       name="routed_expert_up_proj")()}
    if cfg.num_shared_experts:
        p["shared_experts"] = MLPWeights(cfg, cfg.moe_intermediate_size * cfg.num_shared_experts,
                                         name="shared_experts")()
    return p


def moe_weight_axes(cfg) -> dict:
    """The logical axes of one MoE layer's weights (a tree shaped like `moe_weights`' dict)."""
    return declared_axes(moe_weights, cfg)


def _splitting_mesh():
    """The ambient mesh if it splits MoE weights (a tensor or expert axis > 1), else None."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or all(mesh.shape.get(a, 1) == 1 for a in ("tensor", "expert")):
        return None
    return mesh


def moe_sharded(cfg, moe_params, x, backend=None, mesh=None):
    """One MoE layer, tokens x [N, D] -> [N, D] (replicated in and out), per shard on `mesh`
    (default: the ambient one); traceable inside jit."""
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    axes = moe_axes(cfg, mesh.shape)
    specs = param_specs(moe_weight_axes(cfg), moe_params, mesh, cfg)
    f = shard_map(lambda p, x: moe_apply(cfg, p, x, backend, axes), mesh=mesh, in_specs=(specs, P()),
                  out_specs=P(), check_vma=False)
    return f(moe_params, x)


def moe_layer(cfg, mesh, backend=None):
    """A jitted f(moe_params, x [N, D]) -> [N, D]: the MoE layer as the model runs it on `mesh`
    (params placed by `sharding.place_moe_params` with the same cfg)."""
    moe_axes(cfg, mesh.shape)  # bad placements fail here, not at the first call
    return jax.jit(lambda moe_params, x: moe_sharded(cfg, moe_params, x, backend, mesh))


def moe_layer_tp(cfg, mesh, dedup: bool = True, backend=None):
    """`moe_layer` with MoE dedup on or off, refusing shapes that would leave a weight unsplit over
    `tensor` (the experts' intermediate, hidden, the shared experts' intermediate)."""
    tp = mesh.shape["tensor"]
    if not cfg.routed_expert_hidden_size:
        raise ValueError("MoE dedup applies to the latent MoE (routed_expert_hidden_size set)")
    for name, dim in (("moe_intermediate_size", cfg.moe_intermediate_size),
                      ("hidden_size", cfg.hidden_size),
                      ("shared intermediate", cfg.moe_intermediate_size * cfg.num_shared_experts)):
        group = 32 * tp if cfg.expert_format == "mxfp4" and name == "moe_intermediate_size" else tp
        if dim % group:
            raise ValueError(f"{name}={dim} must be divisible by {group} to split over {tp} 'tensor' ranks")
    return moe_layer(cfg.replace(moe_dedup=dedup), mesh, backend)


class MoE(nn.Module):
    """The MoE layer. Under an ambient mesh with a tensor or expert axis > 1 (kimik3's functions
    set the model's mesh) it runs `moe_apply` per shard in shard_map (`moe_sharded`), with MoE
    dedup (Config.moe_dedup) and the expert placement the config and mesh select."""
    cfg: object

    @nn.compact
    def __call__(self, x, backend=None):
        B, T, D = x.shape
        p = moe_weights(self, self.cfg)
        xf = x.reshape(B * T, D)
        mesh = _splitting_mesh()
        if mesh is None:
            out = moe_apply(self.cfg, p, xf, backend)
        else:
            out = moe_sharded(self.cfg, p, xf, backend, mesh)
        return out.reshape(B, T, D)
