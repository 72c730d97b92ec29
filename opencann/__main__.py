"""``python -m opencann ...``: the ``opencann`` command line (`opencann.cli.main`)."""
import sys

from .cli import main

sys.exit(main())
