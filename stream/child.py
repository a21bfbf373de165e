"""Child processes that run one of this project's modules (``python -m``).

``python -m`` puts the current directory first on ``sys.path``, so a folder
named like one of our packages where the user runs a command (``model/`` is a
common model directory) would be imported instead of ours. A child is
started with ``-P`` (no such entry) and with the directory holding our
packages first on ``PYTHONPATH``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

__all__ = ["module_command"]

_ROOT = str(Path(__file__).resolve().parent.parent)


def module_command(module: str, *args: str) -> tuple[list[str], dict[str, str]]:
    """``(argv, env)`` that run ``python -m module args…`` with this interpreter and these packages."""
    path = os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p)
    return [sys.executable, "-P", "-m", module, *args], {**os.environ, "PYTHONPATH": path}
