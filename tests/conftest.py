"""CPU test setup: 8 fake host devices for mesh tests, fp32 matmuls at full precision."""
import os
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    flags += " --xla_force_host_platform_device_count=8"
# The suite is dominated by XLA:CPU compiling many small programs (tiny models, interpreted
# kernels); LLVM's optimisation passes are most of that and the tiny programs barely need them.
if "xla_backend_optimization_level" not in flags:
    flags += " --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = flags.strip()

import kimik3  # noqa: E402,F401  (applies the XLA:CPU workarounds before JAX starts)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

import pytest  # noqa: E402

TINY_VARIANTS = ("tiny", "tiny-linear")


@pytest.fixture(scope="session")
def tiny_models():
    """One random model per tiny variant, shared by the whole session (init compiles once)."""
    return {name: _tiny_model(name) for name in TINY_VARIANTS}


def _tiny_model(name: str):
    """kimik3.init of the preset (seed 0). Under tests/run_all.py ($KIMIK3_TEST_MODELS names a
    folder of the run) the files' processes share it: the first initialises and saves it, the
    others load it (a second or so, where init traces and compiles the whole model)."""
    shared = os.environ.get("KIMIK3_TEST_MODELS")
    if not shared:
        return kimik3.init(kimik3.Config.preset(name), seed=0)
    path = os.path.join(shared, f"{name}-seed0")
    if os.path.isdir(path):  # only whole saves appear there (renamed into place)
        loaded = kimik3.load(path)
        # as init's are: not committed to a device, so they mix with arrays placed on a mesh
        return kimik3.Model(params=jax.tree.map(lambda a: jnp.asarray(np.asarray(a)), loaded.params),
                            cfg=loaded.cfg)
    model = kimik3.init(kimik3.Config.preset(name), seed=0)
    staging = tempfile.mkdtemp(dir=shared)
    kimik3.save(model, os.path.join(staging, name))
    try:
        os.rename(os.path.join(staging, name), path)
    except OSError:  # another process saved it first
        pass
    return model


@pytest.fixture(scope="session")
def tiny_greedy(tiny_models):
    """The one-device reference the mesh tests compare with: the tiny model, prompts of different
    lengths (some shorter than 8 DCP shards), their prefill's last logits and 8 greedy tokens each."""
    from types import SimpleNamespace

    model = tiny_models["tiny"]
    prompts = [[5, 6, 7], list(range(30, 52)), [9], list(range(100, 113))]
    last, _ = kimik3.prefill(model, prompts, 64)
    tokens = kimik3.generate(model, prompts, max_new_tokens=8, stop_tokens=[], max_seq_len=64)
    return SimpleNamespace(model=model, prompts=prompts, last=last, tokens=tokens)
