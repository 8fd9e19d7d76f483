"""The package's structure: no import circles (imports inside functions included), and the lower floors
(models, data, weights) know nothing of training, the stages or the command line."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PACKAGE = ROOT / "mae"
UPPER = ("mae.train", "mae.stages", "mae.cli", "mae.api")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str) -> set[str]:
    """The mae modules `name` imports anywhere in its file (inside functions too): `from pkg import sub`
    counts as importing the submodule when `sub` is one, else `pkg`."""
    path = MODULES[name]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: imports_of(name) for name in MODULES}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a list of modules (first = last), or None."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_circle_in_the_package():
    assert find_cycle(GRAPH) is None, " -> ".join(find_cycle(GRAPH))


def test_the_circle_finder_finds_circles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


LOWER = sorted(n for n in MODULES if n.startswith(("mae.models", "mae.data", "mae.weights", "mae.figures")))


@pytest.mark.parametrize("name", LOWER)
def test_models_data_and_weights_do_not_import_training_stages_or_the_cli(name):
    assert not [m for m in GRAPH[name] if m.startswith(UPPER)]


def test_models_do_not_import_data_weights_or_config():
    for name in (n for n in MODULES if n.startswith("mae.models")):
        assert not [m for m in GRAPH[name] if m.startswith(("mae.data", "mae.weights", "mae.config"))], name
