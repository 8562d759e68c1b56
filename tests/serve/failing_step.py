"""`python -m serve ARGS` whose process 0 fails its engine's Nth step ($KIMIK3_FAIL_STEP, default
1) with RuntimeError("injected failure"), the other processes stepping normally: how a
multi-process run meets a failure of one process (tests/serve/test_multiprocess_failures.py)."""
from __future__ import annotations

import os
import sys


def main(argv) -> int:
    from serve import cli
    from serve.engine import Engine

    fail_at, count, real = int(os.environ.get("KIMIK3_FAIL_STEP", "1")), [0], Engine.step

    def step(self):
        import jax

        if jax.process_index() == 0:
            count[0] += 1
            if count[0] == fail_at:
                raise RuntimeError("injected failure")
        return real(self)
    Engine.step = step
    return cli.main(argv)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    sys.exit(main(sys.argv[1:]))
