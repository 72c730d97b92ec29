"""docs/guide/options.md is the table `opencann.engine.options_doc` generates from
`CompileOptions`: documentation and code cannot drift apart."""
from __future__ import annotations

import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_options_doc_is_the_generated_table():
    from opencann.engine.options_doc import options_markdown
    with open(os.path.join(ROOT, "docs", "guide", "options.md"), encoding="utf-8") as f:
        assert f.read() == options_markdown(), (
            "docs/guide/options.md is stale: regenerate it with "
            "`python -m opencann.engine.options_doc > docs/guide/options.md`")


def test_every_option_is_documented_once_with_its_default():
    import dataclasses

    from opencann.engine.options import (GEAR_OPTIONS, KNOWN_OPTIONS, TRAINING_OPTIONS,
                                         CompileOptions)
    from opencann.engine.options_doc import options_markdown
    text = options_markdown()
    names = [f.name for f in dataclasses.fields(CompileOptions)]
    assert set(names) == set(KNOWN_OPTIONS) | set(GEAR_OPTIONS) | set(TRAINING_OPTIONS)
    for f in dataclasses.fields(CompileOptions):
        assert text.count(f"| `{f.name}` |") == 1, f.name
        assert f.metadata["doc"] and f.metadata["kind"], f.name
