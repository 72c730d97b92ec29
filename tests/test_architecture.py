"""The house rules that code review alone does not keep (DESIGN.md, "Rules of the house"):
imports run one way, top to bottom (an import-linter layers contract, `.importlinter`),
and no private name is imported across packages."""
import ast
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
LINT = shutil.which("lint-imports") or os.path.join(os.path.dirname(sys.executable), "lint-imports")

pytestmark = pytest.mark.skipif(not os.path.exists(LINT), reason="import-linter not installed "
                                "(pip install -e '.[dev]')")


def _lint(root: pathlib.Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(root))
    return subprocess.run([LINT, "--no-cache"], cwd=root, env=env, capture_output=True,
                          text=True, timeout=300)


def test_import_contract_is_kept():
    r = _lint(REPO)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "KEPT" in r.stdout


def test_import_contract_fails_on_an_upward_import(tmp_path):
    """The contract has teeth: an op module importing the compiler breaks it."""
    shutil.copytree(REPO / "opencann", tmp_path / "opencann",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / ".importlinter", tmp_path / ".importlinter")
    opdef = tmp_path / "opencann" / "ops" / "opdef.py"
    opdef.write_text(opdef.read_text() + "\nfrom ..compiler import compile_graph  # noqa\n")
    r = _lint(tmp_path)
    assert r.returncode != 0
    assert "opencann.ops is not allowed to import opencann.compiler" in r.stdout


def _private_imports_across_packages(root: pathlib.Path):
    """(file:line, name, module) for ``from <other opencann package> import _name``."""
    out = []
    for p in sorted((root / "opencann").rglob("*.py")):
        parts = p.relative_to(root).with_suffix("").parts
        pkg = list(parts if p.name == "__init__.py" else parts[:-1])
        if p.name == "__init__.py":
            pkg = pkg[:-1] if pkg[-1] == "__init__" else pkg
        for node in ast.walk(ast.parse(p.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = pkg[:len(pkg) - (node.level - 1)]
                target = base + (node.module.split(".") if node.module else [])
            else:
                target = (node.module or "").split(".")
            if target[0] != "opencann" or target[:2] == list(parts[:2]):
                continue
            for a in node.names:
                if a.name.startswith("_") and not a.name.startswith("__"):
                    out.append((f"{p.relative_to(root)}:{node.lineno}", a.name, ".".join(target)))
    return out


def test_no_private_name_imported_across_packages():
    assert _private_imports_across_packages(REPO) == []


def test_private_import_check_finds_one(tmp_path):
    (tmp_path / "opencann" / "passes").mkdir(parents=True)
    (tmp_path / "opencann" / "passes" / "x.py").write_text("from ..ops.opdef import _nbytes\n")
    found = _private_imports_across_packages(tmp_path)
    assert [(n, m) for _, n, m in found] == [("_nbytes", "opencann.ops.opdef")]
