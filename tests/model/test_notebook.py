"""The quickstart notebook runs end to end."""
import os

import nbformat
from nbclient import NotebookClient
from tests import paths

ROOT = str(paths.ROOT)


def test_quickstart_runs(tmp_path):
    nb = nbformat.read(os.path.join(ROOT, "examples", "quickstart.ipynb"), as_version=4)
    env_path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = ROOT + (os.pathsep + env_path if env_path else "")
    try:
        NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    finally:
        os.environ["PYTHONPATH"] = env_path
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "KDA state" in outputs and "ms per decode step" in outputs and "max |diff| output" in outputs
    assert "bits per byte" in outputs
    plots = sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert plots == 2  # the per-byte loss and the cache images
