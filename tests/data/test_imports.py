"""mae.data imports no circle (function-level imports included) and nothing of the training side."""

import ast
from pathlib import Path

import mae

ROOT = Path(mae.__file__).parent
FORBIDDEN = ("mae.train", "mae.cli", "mae.stages", "mae.config")


def _imports(path: Path) -> set[str]:
    """The mae.* modules a file imports anywhere in it (`from mae.x import y` names mae.x and mae.x.y)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.update([node.module] + [f"{node.module}.{a.name}" for a in node.names])
    return {n for n in names if n == "mae" or n.startswith("mae.")}


def _module(path: Path) -> str:
    return ".".join(("mae", *path.relative_to(ROOT).with_suffix("").parts)).removesuffix(".__init__")


def test_mae_data_has_no_import_circle_and_no_training_imports():
    modules = {_module(p): p for p in (ROOT / "data").glob("*.py")}
    graph = {m: {n for n in _imports(p) if n in modules and n != m} for m, p in modules.items()}
    for m, p in modules.items():
        assert not [n for n in _imports(p) if n.startswith(FORBIDDEN)], m
    done: set[str] = set()

    def visit(m: str, path: tuple[str, ...]) -> None:
        assert m not in path, " -> ".join((*path, m))
        if m not in done:
            for n in graph[m]:
                visit(n, (*path, m))
            done.add(m)

    for m in graph:
        visit(m, ())
    assert graph["mae.data.images"] == set()  # the leaf
