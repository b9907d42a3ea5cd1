"""The layering rule: nothing under engine/, kernels/ or weights/ imports tgi_compat (at any depth,
inside functions too); kernels import nothing of the engine."""
import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("package,forbidden", [("engine", ("tgi_compat",)), ("kernels", ("tgi_compat", "engine")),
                                               ("weights", ("tgi_compat",))])
def test_lower_layers_do_not_import_higher_ones(package, forbidden):
    offenders = [f"{path.relative_to(REPO)} imports {name}"
                 for path in sorted((REPO / package).rglob("*.py"))
                 for name in imported_modules(path) if name.split(".")[0] in forbidden]
    assert offenders == []


def test_the_walk_sees_imports_inside_functions(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from tgi_compat.app import create_app\n")
    assert "tgi_compat.app" in imported_modules(module)
