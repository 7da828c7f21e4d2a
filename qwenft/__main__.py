"""`python -m qwenft`, `torchrun -m qwenft` and `torchrun qwenft` (from the repository root) all land here."""

import os
import sys

if __package__ in (None, ""):  # `torchrun qwenft ...` runs this directory as a script
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from qwenft.cli import entry  # noqa: E402

entry()
