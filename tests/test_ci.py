"""CI runs the README's test command: .ci/run's one command (besides comments and the shebang) is
the line of README.md after "# 2. set up, then run the tests"."""
from tests import paths

ROOT = paths.ROOT


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text().splitlines()
    marker = next(i for i, line in enumerate(readme) if line.startswith("# 2. set up, then run the tests"))
    ci = (ROOT / ".ci" / "run").read_text().rstrip("\n").splitlines()
    commands = [line for line in ci if line.strip() and not line.lstrip().startswith("#")]
    assert commands == [readme[marker + 1]], (commands, readme[marker + 1])
    assert "tests/run_all.py" in commands[0]
