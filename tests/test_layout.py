"""Project ground rules that are cheap to check."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN_IN_ENGINE = {"ray", "grpc", "yaml"}
ALLOWED_IN_ENGINE = {"torch", "transformers", "engine"}


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("path", sorted((ROOT / "engine").rglob("*.py")), ids=lambda p: p.name)
def test_engine_imports_only_torch_transformers_and_stdlib(path):
    import sys

    roots = imported_roots(path)
    assert not roots & FORBIDDEN_IN_ENGINE
    third_party = {r for r in roots if r not in sys.stdlib_module_names and r != "__future__"}
    assert third_party <= ALLOWED_IN_ENGINE, f"{path.name} imports {sorted(third_party - ALLOWED_IN_ENGINE)}"


def test_required_layout():
    for name in ("pyproject.toml", "cluster", "actors", "protos", "engine", "configs", "tests", "k8s"):
        assert (ROOT / name).exists(), name
