"""`CompileOptions`: the typed options, their defaults and validation."""
from __future__ import annotations

import pytest

from opencann.engine.options import CompileOptions, check_options, complete, option


def test_from_dict_types_the_given_options_and_fills_defaults():
    o = CompileOptions.from_dict({"disable": ["cse"], "streams": 2})
    assert o.disable == ("cse",) and o.streams == 2
    assert o.inplace is True and o.stream_costs == "measured" and o.precision_mode is None
    assert CompileOptions.from_dict(None) == CompileOptions()


def test_readers_take_defaults_from_compile_options():
    assert option({}, "streams") == 1 == CompileOptions.default("streams")
    assert option({"streams": 3}, "streams") == 3
    assert option(None, "freezing") is True
    full = complete({"verify": True})
    assert full["verify"] is True and full["alignment"] == CompileOptions().alignment
    assert set(full) == set(CompileOptions.names("compile"))
    with pytest.raises(KeyError, match="no compile option 'nope'"):
        option({}, "nope")


def test_validation_keeps_its_one_line_errors():
    with pytest.raises(ValueError, match=r"^option 'streams' takes a positive int"):
        CompileOptions.from_dict({"streams": 0})
    with pytest.raises(ValueError, match=r"^unknown compile option\(s\) \['stream'\]"):
        check_options({"stream": 2})
    with pytest.raises(ValueError, match=r"^option 'disable' takes a list of names, e\.g\. \['cse'\]"):
        CompileOptions.from_dict({"disable": "cse"})
