"""The documentation's links resolve, and the README stays a landing page.

Every relative Markdown link in README.md and docs/ (``[text](path)``, ``[text](path#anchor)``,
``[text](#anchor)``; links inside fenced code blocks and to URLs are left out) must name a
file or folder that exists, and an anchor must be a heading of the file it points into
(GitHub's slugs: lower case, punctuation dropped, spaces to hyphens). Every ``docs/....md``
path written in the code (docstrings, comments and messages under opencann/, bench/ and
examples/) must exist too. README.md has at most 150 lines."""
import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[2]
README_MAX_LINES = 150
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
CODE_REF = re.compile(r"(?<![\w/.-])docs/[\w/.-]+?\.md\b")   # not onnx/docs/...
# Generated files that may be absent in a checkout (none today: docs/guide/options.md is
# generated from CompileOptions and checked in).
GENERATED: set = set()


def _markdown_files():
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def _prose(text: str) -> str:
    """The text outside fenced code blocks."""
    return "".join(part for i, part in enumerate(re.split(r"^```.*$", text, flags=re.M))
                   if i % 2 == 0)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, Markdown code marks and punctuation other
    than ``-`` and ``_`` dropped, spaces to hyphens."""
    h = heading.strip().lower().replace("`", "")
    h = re.sub(r"[^\w\- ]", "", h)
    return h.replace(" ", "-")


def anchors(path: pathlib.Path) -> set:
    """The anchors of the headings of a Markdown file."""
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", _prose(path.read_text("utf-8")), re.M)}


def broken_links(path: pathlib.Path) -> list:
    """The relative links of one Markdown file that do not resolve, as strings."""
    bad = []
    for target in LINK.findall(_prose(path.read_text("utf-8"))):
        if re.match(r"^[a-z]+:", target):          # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        rel = dest.relative_to(REPO).as_posix() if dest.is_relative_to(REPO) else str(dest)
        if not dest.exists():
            if rel not in GENERATED:
                bad.append(f"{path.relative_to(REPO)}: {target} (no such file)")
            continue
        if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{path.relative_to(REPO)}: {target} (no heading with that anchor)")
    return bad


def test_relative_links_resolve():
    bad = [b for f in _markdown_files() for b in broken_links(f)]
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_docs_paths_named_in_code_exist():
    bad = []
    for top in ("opencann", "bench", "examples"):
        for f in sorted((REPO / top).rglob("*.py")):
            for ref in set(CODE_REF.findall(f.read_text("utf-8"))):
                if not (REPO / ref).exists() and ref not in GENERATED:
                    bad.append(f"{f.relative_to(REPO)}: {ref}")
    assert not bad, "docs paths that do not exist:\n" + "\n".join(bad)


def test_readme_is_a_landing_page():
    n = len((REPO / "README.md").read_text("utf-8").splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines; keep it <= {README_MAX_LINES} " \
                                  "and move the detail into docs/"


def test_the_checks_find_a_broken_link_and_anchor(tmp_path, monkeypatch):
    monkeypatch.setattr(__import__(__name__), "REPO", tmp_path)
    (tmp_path / "a.md").write_text("# Top part\n[ok](b.md#the-b-heading) [x](missing.md) "
                                   "[y](b.md#nope) [z](#top-part)\n```\n[in code](gone.md)\n```\n")
    (tmp_path / "b.md").write_text("## The `b` heading\n")
    bad = broken_links(tmp_path / "a.md")
    assert len(bad) == 2 and "missing.md" in bad[0] and "b.md#nope" in bad[1]
