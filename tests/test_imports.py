"""Imports run one way (pyproject.toml's [tool.importlinter] contract), checked by import-linter on this checkout."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_import_layers_contract_kept():
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    assert lint, "lint-imports not found; pip install -e '.[test]' (import-linter)"
    out = subprocess.run([lint, "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout
