"""CPU test setup: 8 fake host devices for mesh tests, fp32 matmuls at full precision."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()

import kimik3  # noqa: E402,F401  (applies the XLA:CPU workarounds before JAX starts)
import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

import pytest  # noqa: E402

TINY_VARIANTS = ("tiny", "tiny-linear")


@pytest.fixture(scope="session")
def tiny_models():
    """One random model per tiny variant, shared by the whole session (init compiles once)."""
    return {name: kimik3.init(kimik3.Config.preset(name), seed=0) for name in TINY_VARIANTS}
