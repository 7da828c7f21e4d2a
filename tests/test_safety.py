"""Loading never runs code from a file (torch.load weights_only, no trust_remote_code), and a training run
writes no secret from its environment into the run dir."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO
from qwenft.conf import load_run_config

SOURCES = sorted(p for d in ("qwenft", "scripts", "tests") for p in (REPO / d).rglob("*.py"))


def _is_true(node) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def _unsafe_calls(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        where = f"{path}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            owner = func.value.id if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) else None
            if name == "load" and owner == "torch":
                if not any(k.arg == "weights_only" and _is_true(k.value) for k in node.keywords):
                    found.append(f"{where}: torch.load without weights_only=True")
            for k in node.keywords:
                if k.arg == "trust_remote_code" and not (isinstance(k.value, ast.Constant) and k.value.value is False):
                    found.append(f"{where}: trust_remote_code={ast.unparse(k.value)}")
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values):
                if isinstance(key, ast.Constant) and key.value == "trust_remote_code" and not (
                        isinstance(value, ast.Constant) and value.value is False):
                    found.append(f"{where}: trust_remote_code={ast.unparse(value)}")
    return found


def test_no_unsafe_loading_in_any_source_file():
    assert len(SOURCES) > 30
    assert [line for path in SOURCES for line in _unsafe_calls(path)] == []


def test_the_scan_finds_unsafe_loading(tmp_path):
    """The check above is not vacuous: it flags each form it looks for."""
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\nx = torch.load('f')\ny = torch.load('f', weights_only=False)\n"
                   "m = AutoModel.from_pretrained('p', trust_remote_code=True)\nkw = {'trust_remote_code': flag}\n")
    ok = tmp_path / "ok.py"
    ok.write_text("import torch\nx = torch.load('f', weights_only=True)\nm = f(trust_remote_code=False)\n")
    assert len(_unsafe_calls(bad)) == 4 and _unsafe_calls(ok) == []


SECRETS = {
    "WANDB_API_KEY": "wandbkey0123456789abcdef0123456789abcdef",
    "HF_TOKEN": "hf_tokenvalue_9f8e7d6c5b4a",
    "MY_SERVICE_KEY": "service-key-value-31415",
    "SOME_SECRET": "some-secret-value-27182",
}


@pytest.mark.slow
def test_no_secret_from_the_environment_reaches_the_run_dir(tmp_path):
    """`qwenft train recipe=tiny` with wandb (offline), a checkpoint per step and the HF export: no secret value
    of the environment appears in any file under the run dir (config.yaml, train.log, metrics.jsonl,
    checkpoints, hf/, wandb/), one read into the config by `${oc.env:...}` included: config.yaml (and wandb's
    config) hold the interpolation as written, which reading the run back resolves."""
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "qwenft", "train", "recipe=tiny", "train.max_steps=2", "data.seq_len=64",
         "train.progress_bar=false", "logger=wandb", "checkpoint.every_steps=1", f"run_dir={run_dir}",
         "launcher.job_name=${oc.env:SOME_SECRET}"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, **SECRETS, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    kinds = {p.relative_to(run_dir).parts[0] for p in files}
    assert {"config.yaml", "train.log", "metrics.jsonl", "checkpoints", "hf", "wandb"} <= kinds, kinds
    leaks = [(str(p.relative_to(run_dir)), name) for p in files for name, value in SECRETS.items()
             if value.encode() in p.read_bytes()]
    assert leaks == []
    assert "  job_name: ${oc.env:SOME_SECRET}\n" in (run_dir / "config.yaml").read_text()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("SOME_SECRET", SECRETS["SOME_SECRET"])
        assert load_run_config(run_dir).launcher.job_name == SECRETS["SOME_SECRET"]
