"""CANN's precision files (`opencann.tools.precision_files`): what the writers write, the
readers take back, an empty list included (a keep_dtype file without names keeps no node;
a mixlist adding nothing changes nothing); bad files are one error line naming the file
and the fix."""
import pytest

from opencann.tools.precision_files import read_keep_dtype, read_mixlist, write_keep_dtype, write_mixlist


@pytest.mark.parametrize("names", [[], ["addmm_1"], ["convolution", "addmm_1", "convolution_1_1"]])
def test_keep_dtype_round_trips(names, tmp_path):
    p = str(tmp_path / "keep.txt")
    write_keep_dtype(p, names)
    assert read_keep_dtype(p) == names


@pytest.mark.parametrize("text, want", [
    ("", []),
    ("\n  \n", []),
    ("# nodes kept in fp32: none\n\n", []),
    ("# kept\n addmm_1 \n\naddmm\naddmm_1\n", ["addmm_1", "addmm"]),
])
def test_keep_dtype_skips_blank_and_comment_lines(text, want, tmp_path):
    p = tmp_path / "keep.txt"
    p.write_text(text)
    assert read_keep_dtype(str(p)) == want


@pytest.mark.parametrize("keep, lower", [([], []), (["MatMulV2"], []), ([], ["MatMulV2", "Conv2D"]),
                                         (["Conv2D"], ["MatMulV2"])])
def test_mixlist_round_trips(keep, lower, tmp_path):
    p = str(tmp_path / "mix.json")
    write_mixlist(p, keep, lower)
    assert read_mixlist(p) == (sorted(keep), sorted(lower))


@pytest.mark.parametrize("content, msg", [
    (None, "no such file; write one node name per line"),
    (b"\xff\xfeaddmm\n", "not UTF-8 text"),
])
def test_bad_keep_dtype_file_is_one_line(content, msg, tmp_path):
    p = tmp_path / "keep.txt"
    if content is not None:
        p.write_bytes(content)
    with pytest.raises(ValueError) as e:
        read_keep_dtype(str(p))
    assert msg in str(e.value) and str(p) in str(e.value) and "\n" not in str(e.value)


def test_files_with_a_byte_order_mark_read_as_without(tmp_path):
    """An editor that writes UTF-8 with a byte-order mark (Notepad) gives the same lists
    and records as without it."""
    from opencann.tools.precision_files import read_keep_dtype, read_mixlist, read_quant_config
    keep, mix, q = tmp_path / "k.txt", tmp_path / "m.json", tmp_path / "q.json"
    keep.write_bytes("\ufeffaddmm_1\nconvolution\n".encode("utf-8"))
    mix.write_bytes('\ufeff{"black-list": {"to-add": ["MatMulV2"]}}'.encode("utf-8"))
    q.write_bytes('\ufeff{"layers": {"fc": {"scale_d": 0.5, "offset_d": 3}}}'.encode("utf-8"))
    assert read_keep_dtype(str(keep)) == ["addmm_1", "convolution"]
    assert read_mixlist(str(mix)) == (["MatMulV2"], [])
    assert read_quant_config(str(q))["layers"] == {"fc": {"scale_d": 0.5, "offset_d": 3}}
