"""One process of a multi-process CPU run (tests/test_multiprocess.py starts several): joins the
runtime with sharding.initialize_distributed, reads the weights the test saved (--params, host
numpy, as a checkpoint loader holds them), places them on one mesh over every process's devices
and runs `CASES` (prefill logits and greedy tokens); process 0 writes them to --out (npz).
`run_cases` is also what the test runs in one process on 8 devices: the same program either way.

    python tests/multiprocess_worker.py --coordinator 127.0.0.1:PORT --num-processes 2 --process-id I \
        --params P.npz --out F.npz
(with XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu); --join-only stops
after joining (the start-up error tests); --load HF_DIR --orbax-out DIR runs `load_cases` instead.
"""
from __future__ import annotations

import argparse
import os
import sys

# mesh name: (make_mesh axes, dcp_axes); EP puts the tiny model's 8 experts 4 per process
CASES = {
    "tp8": (dict(tensor=8), ()),
    "tp4_dcp2": (dict(tensor=4, dcp=2), ("dcp",)),
    "tp4_ep2": (dict(tensor=4, expert=2), ()),
}
PROMPTS = [[5, 6, 7], list(range(30, 52)), [9], list(range(100, 113))]
MAX_SEQ_LEN, NEW_TOKENS = 64, 8


def config():
    """The tiny preset cut to 3 layers that keep every kind (KDA with a dense MLP, MLA + MoE, KDA +
    MoE): each process compiles every mesh's programs, and compile time grows with layers."""
    import kimik3

    return kimik3.Config.preset("tiny").replace(num_layers=3, layer_types=("kda", "mla", "kda"))


def save_params(model, path) -> None:
    """The weights as one npz, keyed by tree path."""
    import jax
    import numpy as np

    flat = jax.tree_util.tree_flatten_with_path(model.params)[0]
    np.savez(path, **{jax.tree_util.keystr(k): np.asarray(v) for k, v in flat})


def load_params(cfg, path):
    """`save_params`'s file as a Model of host numpy arrays (placing it is the caller's step)."""
    import jax
    import numpy as np

    import kimik3

    paths, tree = jax.tree_util.tree_flatten_with_path(kimik3.abstract(cfg))
    with np.load(path) as f:
        leaves = [f[jax.tree_util.keystr(k)] for k, _ in paths]
    return kimik3.Model(params=jax.tree_util.tree_unflatten(tree, leaves), cfg=cfg)


def spans(mesh) -> dict:
    """Per axis, how many processes one line along it touches (1: the axis stays in a process)."""
    import numpy as np

    procs = np.vectorize(lambda d: d.process_index)(mesh.devices)
    out = {}
    for i, name in enumerate(mesh.axis_names):
        lines = np.moveaxis(procs, i, -1).reshape(-1, procs.shape[i])
        out[name] = max(len(set(line)) for line in lines)
    return out


def run_cases(model, cases=CASES) -> dict:
    """{f"{case}/last": prefill's last logits [B, V], f"{case}/tokens": greedy tokens [B, N],
    f"{case}/spans": processes per mesh axis} for each case, as numpy on every process."""
    import numpy as np

    import kimik3
    import sharding

    out = {}
    for name, (axes, dcp_axes) in cases.items():
        mesh = sharding.make_mesh(**axes)
        placed = sharding.place_model(model, mesh)
        last, _ = kimik3.prefill(placed, PROMPTS, MAX_SEQ_LEN, mesh=mesh, dcp_axes=dcp_axes)
        out[f"{name}/last"] = sharding.host_value(last)
        toks = kimik3.generate(placed, PROMPTS, max_new_tokens=NEW_TOKENS, stop_tokens=[], max_seq_len=MAX_SEQ_LEN,
                               mesh=mesh, dcp_axes=dcp_axes)
        out[f"{name}/tokens"] = np.array(toks, np.int32)
        out[f"{name}/spans"] = np.array([spans(mesh)[a] for a in sharding.AXES], np.int32)
    return out


LOAD_CASES = {"tp8": dict(tensor=8), "tp4_ep2": dict(tensor=4, expert=2)}


def load_config():
    """`config` with experts that outweigh the embeddings, as in a real MoE checkpoint (loading
    compiles nothing: the size costs the test no time)."""
    return config().replace(num_experts=32, moe_intermediate_size=256)


def count_reads():
    """A list whose [0] counts the tensor bytes every SafetensorsFile reads from here on (all
    tensor data goes through `read_at`)."""
    from kimik3.checkpoint.safetensors_io import SafetensorsFile

    count, read_at = [0], SafetensorsFile.read_at

    def counting(self, offset, buf):
        count[0] += len(buf)
        return read_at(self, offset, buf)
    SafetensorsFile.read_at = counting
    return count


def io_read_bytes() -> int:
    """Bytes this process has read through read()/pread() so far (Linux /proc/self/io rchar):
    Orbax reads through TensorStore's C++ I/O, which no Python hook sees."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def check_shards(model, ref) -> int:
    """How many of this process's shards differ from the same rows of `ref` (save_params's npz)."""
    import jax
    import numpy as np

    bad = 0
    for k, leaf in jax.tree_util.tree_flatten_with_path(model.params)[0]:
        want = ref[jax.tree_util.keystr(k)]
        bad += sum(not np.array_equal(np.asarray(s.data), want[s.index]) for s in leaf.addressable_shards)
    return bad


def owned_bytes(model) -> int:
    """The bytes of every leaf's part that this process's devices hold (`local_box`)."""
    import math

    import jax

    from kimik3.checkpoint.hf import local_box

    return sum(math.prod(b.stop - b.start for b in local_box(x.shape, x.sharding)) * x.dtype.itemsize
               for x in jax.tree.leaves(model.params))


def load_cases(hf_dir, params_path, orbax_dir) -> dict:
    """Load the HF checkpoint `hf_dir` onto each LOAD_CASES mesh, counting the bytes this process
    reads; save the last as Orbax to `orbax_dir` (every process) and restore it onto the first
    mesh. Every loaded shard is compared with the weights in `params_path`."""
    import numpy as np

    import kimik3
    import sharding

    count, out, ref = count_reads(), {}, dict(np.load(params_path))
    for name, axes in LOAD_CASES.items():
        count[0] = 0
        model = kimik3.load(hf_dir, mesh=sharding.make_mesh(**axes))
        out.update({f"{name}/bytes_read": count[0], f"{name}/owned": owned_bytes(model),
                    f"{name}/mismatches": check_shards(model, ref)})
    kimik3.save(model, orbax_dir)
    before = io_read_bytes()
    restored = kimik3.load(orbax_dir, mesh=sharding.make_mesh(**LOAD_CASES["tp8"]))
    out["orbax/bytes_read"] = io_read_bytes() - before
    out["orbax/mismatches"] = check_shards(restored, ref)
    return {k: np.asarray(v) for k, v in out.items()}


def mesh_errors() -> dict:
    """The one-line error a mesh that does not use every device gives (no program is compiled)."""
    import numpy as np

    import sharding

    try:
        sharding.make_mesh(tensor=3)
    except ValueError as e:
        return {"error/mesh": np.array(str(e))}
    return {"error/mesh": np.array("")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--coordinator", required=True)
    p.add_argument("--num-processes", type=int, required=True)
    p.add_argument("--process-id", type=int, required=True)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--params")
    p.add_argument("--out")
    p.add_argument("--join-only", action="store_true")
    p.add_argument("--load", metavar="HF_DIR", help="load this checkpoint (load_cases) instead of running CASES; "
                   "--out gets the process id before its suffix (each process writes its own counts)")
    p.add_argument("--orbax-out", metavar="DIR", help="with --load: where the processes save the model")
    args = p.parse_args(argv)

    import kimik3  # noqa: F401  (its XLA:CPU workarounds must be in place before JAX starts)
    import sharding

    try:
        sharding.initialize_distributed(args.coordinator, args.num_processes, args.process_id, timeout_s=args.timeout)
    except sharding.DistributedError as e:
        print(f"kimik3: {e}", file=sys.stderr)
        return 2
    import jax

    print(f"process {jax.process_index()} of {jax.process_count()}: {jax.local_device_count()} of "
          f"{jax.device_count()} devices", flush=True)
    if args.join_only:
        return 0
    jax.config.update("jax_default_matmul_precision", "highest")  # as tests/conftest.py
    import numpy as np

    if args.load:
        np.savez(args.out.replace(".npz", f"{jax.process_index()}.npz"),
                 **load_cases(args.load, args.params, args.orbax_out))
        return 0
    model = load_params(config(), args.params)  # the same weights in every process
    results = {**run_cases(model), **mesh_errors()}
    if sharding.is_primary():
        np.savez(args.out, **results)
    return 0


if __name__ == "__main__":
    repository = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, repository)
    sys.exit(main())
