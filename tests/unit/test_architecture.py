"""The house rules that code review alone does not keep (DESIGN.md, "Rules of the house"):
imports run one way, top to bottom (an import-linter layers contract, `.importlinter`),
no private name is imported across packages, no function is over 60 lines (numba and
Triton kernels aside) and every public function, class and method has a docstring.

Run as a script (``python tests/unit/test_architecture.py``) to list the long functions and
the public callables without a docstring."""
import ast
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
LINT = shutil.which("lint-imports") or os.path.join(os.path.dirname(sys.executable), "lint-imports")

needs_lint = pytest.mark.skipif(not os.path.exists(LINT), reason="import-linter not installed "
                                "(pip install -e '.[dev]')")


def _lint(root: pathlib.Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(root))
    return subprocess.run([LINT, "--no-cache"], cwd=root, env=env, capture_output=True,
                          text=True, timeout=300)


@needs_lint
def test_import_contract_is_kept():
    r = _lint(REPO)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "KEPT" in r.stdout


@needs_lint
def test_import_contract_fails_on_an_upward_import(tmp_path):
    """The contract has teeth: an op module importing the compiler breaks it."""
    shutil.copytree(REPO / "opencann", tmp_path / "opencann",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / ".importlinter", tmp_path / ".importlinter")
    opdef = tmp_path / "opencann" / "ops" / "opdef.py"
    opdef.write_text(opdef.read_text() + "\nfrom ..engine import compile_graph  # noqa\n")
    r = _lint(tmp_path)
    assert r.returncode != 0
    assert "opencann.ops is not allowed to import opencann.engine" in r.stdout


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


# -- size and documentation ------------------------------------------------------------

MAX_FUNCTION_LINES = 60
# numba and Triton kernels: one loop nest each, split only at a cost in speed
KERNEL_DECORATORS = {"njit", "jit", "vectorize", "guvectorize", "autotune", "heuristics"}


def _decorator_name(d: ast.expr) -> str:
    d = d.func if isinstance(d, ast.Call) else d
    return d.attr if isinstance(d, ast.Attribute) else getattr(d, "id", "")


def _functions(tree: ast.AST, prefix: str = ""):
    """(qualified name, def node) of every function and method, nested ones included."""
    for c in ast.iter_child_nodes(tree):
        if isinstance(c, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + c.name, c
            yield from _functions(c, f"{prefix}{c.name}.")
        elif isinstance(c, ast.ClassDef):
            yield from _functions(c, f"{prefix}{c.name}.")
        else:
            yield from _functions(c, prefix)


def _sources(root: pathlib.Path):
    for p in sorted((root / "opencann").rglob("*.py")):
        yield p.relative_to(root).as_posix(), ast.parse(p.read_text())


def long_functions(root: pathlib.Path = REPO, limit: int = MAX_FUNCTION_LINES):
    """(path, qualified name, lines) of functions longer than ``limit`` lines (def line to
    last line, decorators not counted), numba/Triton kernels excepted."""
    out = []
    for path, tree in _sources(root):
        for name, f in _functions(tree):
            n = f.end_lineno - f.lineno + 1
            if n > limit and not any(_decorator_name(d) in KERNEL_DECORATORS
                                     for d in f.decorator_list):
                out.append((path, name, n))
    return out


def undocumented(root: pathlib.Path = REPO):
    """(path, qualified name) of public module-level functions and classes, and public
    methods of public classes, without a docstring. Public: no leading underscore."""
    out = []
    for path, tree in _sources(root):
        for c in tree.body:
            if not isinstance(c, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) \
                    or c.name.startswith("_"):
                continue
            if ast.get_docstring(c) is None:
                out.append((path, c.name))
            if isinstance(c, ast.ClassDef):
                out.extend((path, f"{c.name}.{m.name}") for m in c.body
                           if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))
                           and not m.name.startswith("_") and ast.get_docstring(m) is None)
    return out


def test_no_function_over_60_lines():
    found = long_functions()
    assert found == [], "split these functions (at most 60 lines each): " + ", ".join(
        f"{p}:{n} ({k} lines)" for p, n, k in found)


def test_long_function_check_finds_one_and_spares_kernels(tmp_path):
    (tmp_path / "opencann").mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(60))
    (tmp_path / "opencann" / "m.py").write_text(
        f"def long():\n{body}\n@numba.njit(cache=True)\ndef kernel():\n{body}\n"
        f"class C:\n    def short(self):\n        pass\n")
    assert long_functions(tmp_path) == [("opencann/m.py", "long", 61)]


def test_public_callables_have_docstrings():
    found = [f"{p}:{n}" for p, n in undocumented()]
    assert found == [], "add docstrings (shapes, dtypes, units, errors, sources) to: " + ", ".join(found)


def test_docstring_check_finds_one(tmp_path):
    (tmp_path / "opencann").mkdir()
    (tmp_path / "opencann" / "m.py").write_text(
        'def f():\n    pass\n\n\ndef _g():\n    pass\n\n\nclass C:\n    """C."""\n\n'
        '    def m(self):\n        pass\n\n    def _p(self):\n        pass\n')
    assert undocumented(tmp_path) == [("opencann/m.py", "f"), ("opencann/m.py", "C.m")]


if __name__ == "__main__":
    for p, n, k in long_functions():
        print(f"{k:4d} lines  {p}:{n}")
    for p, n in undocumented():
        print(f"no docstring  {p}:{n}")
