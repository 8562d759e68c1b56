"""One-way layering: kernels_pallas <- sharding <- kimik3 <- serve. Every module's imports
(function-level ones included) are read with `ast`; a module may import its own package or a
lower one, never a higher one."""
import ast
import pathlib
from tests import paths

ROOT = paths.ROOT
LAYERS = ["kernels_pallas", "sharding", "kimik3", "serve"]


def _imported(tree, package: str, module: str):
    """Top-level package names a module imports (anywhere in it), relative imports resolved."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name.split(".")[0], node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: stays inside `package` unless it climbs out of it
                depth = len(module.split(".")) - 1  # levels up to the top package
                yield (package if node.level <= depth else "<outside>"), node.lineno
            elif node.module:
                yield node.module.split(".")[0], node.lineno


def upward_imports(root: pathlib.Path = ROOT) -> list[str]:
    bad = []
    for rank, package in enumerate(LAYERS):
        for path in sorted((root / package).rglob("*.py")):
            module = ".".join(path.relative_to(root).with_suffix("").parts)
            tree = ast.parse(path.read_text(), filename=str(path))
            for name, line in _imported(tree, package, module):
                if name == "<outside>" or (name in LAYERS and LAYERS.index(name) > rank):
                    bad.append(f"{path.relative_to(root)}:{line} imports {name}")
    return bad


def test_no_package_imports_a_higher_layer():
    assert upward_imports() == []


def test_the_check_sees_function_level_imports(tmp_path):
    pkg = tmp_path / "sharding"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("def f():\n    from kimik3.params import abstract\n    return abstract\n")
    for other in ("kernels_pallas", "kimik3", "serve"):
        (tmp_path / other).mkdir()
    assert upward_imports(tmp_path) == ["sharding/__init__.py:2 imports kimik3"]

