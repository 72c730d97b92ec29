"""Record the kernel signatures file again after kernels change (the developer's side of
`opencann.tools.numba_warm`, whose ``warm`` the suite's controller runs before the
pytest-xdist workers start: ``conftest.py``'s ``pytest_configure``; ``OPENCANN_NUMBA_WARM=0``
turns it off).

The file is ``opencann/tools/numba_signatures.tsv``, shipped with the package (``opencann
warm`` compiles it into a user's cache). Record every opencann numba signature a test
compiles, with its compile seconds, in the order the suite met them, then rewrite it::

    OPENCANN_NUMBA_RECORD=/tmp/sigs.tsv OPENCANN_CACHE_DIR=$(mktemp -d) \\
        .venv/bin/python -m pytest tests -n 2 -m "not serial and not onnx_full and not full"
    .venv/bin/python tests/numba_warm.py --replace /tmp/sigs.tsv

(``--replace``: the file becomes that recording; ``--merge``: the recording's entries are
added to the file's, for a recording of a few test files). The file format is in
`opencann.tools.numba_warm`'s docstring.
"""
from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from opencann.tools.numba_warm import merge, signatures_path
    if sys.argv[1:2] in (["--merge"], ["--replace"]) and len(sys.argv) == 3:
        n = merge(sys.argv[2], keep=sys.argv[1] == "--merge")
        print(f"{n} signatures in {signatures_path()}")
    else:
        print(f"usage: {sys.argv[0]} --merge|--replace RECORDED.tsv", file=sys.stderr)
        sys.exit(2)
