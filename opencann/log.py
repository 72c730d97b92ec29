"""The ``opencann`` logger. Level from ``OPENCANN_LOG_LEVEL`` (DEBUG, INFO, WARNING...).

Skipped optimizations are logged at INFO with the node's source location: that is a
product feature (users learn why an optimization did not apply), not debug output."""
from __future__ import annotations

import logging
import os

logger = logging.getLogger("opencann")
if not logger.handlers:
    _h = logging.StreamHandler()
    _h.setFormatter(logging.Formatter("[opencann %(levelname)s] %(message)s"))
    logger.addHandler(_h)
    logger.propagate = False
logger.setLevel(os.environ.get("OPENCANN_LOG_LEVEL", "WARNING").upper())
