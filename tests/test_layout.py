"""The package's layering: models and weights know nothing of training."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[1] / "mae"
LOWER = sorted([*PACKAGE.joinpath("models").glob("*.py"), *PACKAGE.joinpath("weights").glob("*.py"),
                PACKAGE / "run_folder.py", PACKAGE / "visualize.py"])  # fmt: skip


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("path", LOWER, ids=lambda p: p.name)
def test_models_and_weights_do_not_import_training(path):
    assert not [m for m in imported_modules(path) if m.startswith(("mae.train", "mae.cli"))]


def test_models_do_not_import_config():
    for path in PACKAGE.joinpath("models").glob("*.py"):
        assert "mae.config" not in imported_modules(path), path.name
