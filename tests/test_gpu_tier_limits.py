"""The GPU tier's time limits, checked where there is no GPU: every test under tests/gpu carries one (its own mark
or tests/gpu/conftest.py's default), by SIGALRM, under the `timeout -s KILL` that scripts/h200_runs.sh puts around
its file."""

import json
import os
import re
import subprocess
import sys

import pytest

from helpers import REPO

RECORDER = '''
import json, os

def pytest_collection_finish(session):
    limits = {}
    for item in session.items:
        mark = item.get_closest_marker("timeout")
        limits[item.nodeid] = None if mark is None else [mark.args[0] if mark.args else mark.kwargs.get("timeout"),
                                                         mark.kwargs.get("method")]
    with open(os.environ["GPU_LIMITS_OUT"], "w") as f:
        json.dump(limits, f)
'''


@pytest.mark.slow  # collecting tests/gpu in a subprocess: ~6 s
def test_every_gpu_test_has_a_limit_inside_its_call(tmp_path):
    (tmp_path / "gpu_limits_recorder.py").write_text(RECORDER)
    out = tmp_path / "limits.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO), os.environ.get("PYTHONPATH", "")]),
           "GPU_LIMITS_OUT": str(out)}
    subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                    "-p", "gpu_limits_recorder", "tests/gpu"], cwd=REPO, env=env, check=True, capture_output=True,
                   timeout=120)
    limits = json.loads(out.read_text())
    files = ("test_cuda_model", "test_kernels", "test_cudnn_pieces", "test_packed_kernels", "test_cp_kernels",
             "test_multi_gpu")
    assert len(limits) >= 20 and {n.split("::")[0] for n in limits} == {f"tests/gpu/{name}.py" for name in files}
    # the outer limit of the h200_runs.sh part that runs the test's file
    script = (REPO / "scripts" / "h200_runs.sh").read_text()
    # (a command may run several files: each gets the command's limit)
    outer = {f: int(s) for s, files in re.findall(r"timeout -s KILL (\d+) python -m pytest ((?:.|\\\n)*?)>", script)
             for f in re.findall(r"tests/gpu/\w+\.py", files)}
    assert set(outer) == {n.split("::")[0] for n in limits}, outer
    for nodeid, limit in limits.items():
        assert limit is not None and limit[1] == "signal", (nodeid, limit)
        assert 60 <= limit[0] <= outer[nodeid.split("::")[0]] - 60, (nodeid, limit)
