"""The house rules that code review alone does not keep (DESIGN.md, "Rules of the house"):
imports run one way, top to bottom (an import-linter layers contract, `.importlinter`),
no import cycle among opencann's modules (inside packages too), no private name is
imported across packages, no function is over 60 lines (numba and
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


# -- import cycles --------------------------------------------------------------------
# import-linter's layers contract sees packages, not the modules inside one: a cycle
# between two modules of one layer (a converter registry and its converters, a planner
# and the scheduler it calls) passes it. This check builds the module import graph from
# the sources with `ast`: every ``import``/``from ... import`` counts, at module level
# and inside functions alike (a deferred import is still a dependency, and deferring one
# is how cycles hide), except under ``if TYPE_CHECKING:`` (never run). ``from pkg import
# name`` is an edge to ``pkg.name`` when that is a module, else to ``pkg`` (its
# ``__init__``). The implicit import of a module's parent packages is not an edge: that
# would make every package that re-exports its children a cycle.


def _module_names(root: pathlib.Path):
    """{dotted module name: path} of every module under ``root/opencann``."""
    out = {}
    for p in sorted((root / "opencann").rglob("*.py")):
        parts = p.relative_to(root).with_suffix("").parts
        out[".".join(parts[:-1] if p.name == "__init__.py" else parts)] = p
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Import nodes of ``tree``, at any depth, outside ``if TYPE_CHECKING:`` blocks."""
    for c in ast.iter_child_nodes(tree):
        if isinstance(c, (ast.Import, ast.ImportFrom)):
            yield c
        elif isinstance(c, ast.If) and _is_type_checking(c.test):
            yield from (n for b in c.orelse for n in _imports_in(b))
        else:
            yield from _imports(c)


def _imports_in(node: ast.AST):
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        yield node
    else:
        yield from _imports(node)


def import_graph(root: pathlib.Path = REPO):
    """{module: {imported opencann module: first line}} over ``root/opencann``."""
    mods = _module_names(root)

    def known(name: str) -> str:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name

    graph = {m: {} for m in mods}
    for m, p in mods.items():
        pkg = m.split(".") if p.name == "__init__.py" else m.split(".")[:-1]
        for node in _imports(ast.parse(p.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = pkg[:len(pkg) - (node.level - 1)] if node.level else []
                mod = ".".join(base + (node.module.split(".") if node.module else []))
                targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else mod
                           for a in node.names]
            for t in map(known, targets):
                if t and t != m:
                    graph[m].setdefault(t, node.lineno)
    return graph


def import_cycles(root: pathlib.Path = REPO):
    """One cycle per strongly connected component of the import graph, as a list of
    ``"module:line"`` steps that returns to its start (Tarjan's algorithm, iterative)."""
    graph = import_graph(root)
    index, low, stack, on, comps = {}, {}, [], set(), []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    comps.append(comp)
    return [_cycle_in(graph, comp) for comp in comps]


def _cycle_in(graph, comp):
    """A shortest cycle through the first module of strongly connected ``comp``."""
    first = min(comp)
    prev, frontier = {first: None}, [first]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w == first:
                    path = [v]
                    while prev[path[-1]] is not None:
                        path.append(prev[path[-1]])
                    path.reverse()
                    return [f"{a}:{graph[a][b]}" for a, b in zip(path, path[1:] + [first])] + [first]
                if w in comp and w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {first}")


def test_no_import_cycles():
    cycles = import_cycles()
    assert cycles == [], "break these import cycles (module:line of the import -> ...): " + \
        "; ".join(" -> ".join(c) for c in cycles)


def test_cycle_check_finds_an_injected_cycle(tmp_path):
    """The check has teeth: a function-level import of the scheduler from ``ir/plan.py``
    (which the scheduler imports through ``opencann.ir``) closes a cycle, named in order."""
    shutil.copytree(REPO / "opencann", tmp_path / "opencann",
                    ignore=shutil.ignore_patterns("__pycache__"))
    assert import_cycles(tmp_path) == []
    plan = tmp_path / "opencann" / "ir" / "plan.py"
    plan.write_text(plan.read_text() + "\n\ndef _late():\n    from ..passes import schedule  # noqa\n")
    cycles = import_cycles(tmp_path)
    assert len(cycles) == 1
    assert any(step.startswith("opencann.ir.plan:") for step in cycles[0])
    assert any(step.startswith("opencann.passes.schedule:") for step in cycles[0])
    assert cycles[0][-1] == cycles[0][0].split(":")[0]


def test_cycle_check_skips_type_checking_imports(tmp_path):
    (tmp_path / "opencann").mkdir()
    (tmp_path / "opencann" / "a.py").write_text("from . import b\n")
    (tmp_path / "opencann" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n")
    assert import_cycles(tmp_path) == []
    (tmp_path / "opencann" / "b.py").write_text("def f():\n    from .a import x\n")
    assert import_cycles(tmp_path) == [["opencann.a:1", "opencann.b:2", "opencann.a"]]


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


def test_serial_tests_are_marked_in_their_own_files():
    """`make test`'s serial pass runs only the test files that spell the serial marker
    (the Makefile's SERIAL_FILES), and its parallel pass deselects ``serial``: a serial
    marker applied from anywhere else (a conftest hook, a helper module's alias) would
    leave its tests out of both passes."""
    for p in (REPO / "tests").rglob("*.py"):
        if p.name.startswith("test_"):
            continue
        text = p.read_text()
        assert "mark." + "serial" not in text and "add_marker" not in text, p   # split: the grep skips this file


def test_extended_files_exist():
    """tests/extended.txt names the files `make test` leaves to `make test-extended`:
    each must be a test file here (a renamed or deleted one would silently run in
    neither target's intended place; a missing path makes pytest fail the whole run)."""
    listed = [ln.strip() for ln in (REPO / "tests" / "extended.txt").read_text().splitlines()
              if ln.strip() and not ln.startswith("#")]
    assert listed and len(listed) == len(set(listed))
    for p in listed:
        assert (REPO / p).is_file() and pathlib.Path(p).name.startswith("test_"), p
