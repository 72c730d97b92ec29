"""The README's example runs as written: it compiles a small Conv+BN+ReLU model, calls it,
saves and loads it, and checks the loaded model against eager (its last line asserts)."""
import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[2]


def readme_example() -> str:
    """The first ```python block of README.md."""
    text = (REPO / "README.md").read_text("utf-8")
    m = re.search(r"^```python\n(.*?)^```", text, re.S | re.M)
    assert m, "README.md has no ```python example"
    return m.group(1)


def test_readme_example_runs(tmp_path, monkeypatch):
    code = readme_example()
    assert len(code.splitlines()) <= 12, "keep the README's example about ten lines"
    assert "opencann.save" in code and "opencann.load" in code and "assert_close" in code
    monkeypatch.chdir(tmp_path)                      # it writes model.ocm
    scope = {}
    exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 - the project's own README
    assert (tmp_path / "model.ocm").exists()
    assert scope["y"].shape == (1, 8, 30, 30)
