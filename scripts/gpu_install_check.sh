#!/usr/bin/env bash
# Installs qwenft with its `gpu` extra into the current Python environment of a GPU machine (a fresh venv, or a
# GPU image's own environment), as a user would, and checks what it gives there: fla and tilelang import,
# `model.kernels.gdn=auto` picks fla, torchao's float8 training (model.fp8) imports and pairs with the torch
# there, and the GPU tier's tests of fla's GatedDeltaNet forward and backward (tests/gpu/test_packed_kernels.py)
# pass in that environment without skipping.
#
#   bash scripts/gpu_install_check.sh                          # from the package index
#   WHEELS=/path/to/wheels bash scripts/gpu_install_check.sh   # offline: only the wheels found there
#
# pip keeps what the environment already has where it satisfies the requirements (a GPU image's torch, triton
# and CUDA libraries) and adds the rest.
set -euo pipefail
python=${PYTHON:-python3}
index=()
if [ -n "${WHEELS:-}" ]; then index=(--no-index --find-links "$WHEELS"); fi
start=$(date +%s)
"$python" -m pip install -q "${index[@]}" -e '.[gpu]'
echo "installed -e '.[gpu]' in $(( $(date +%s) - start )) s"
"$python" - <<'EOF'
import importlib.metadata as md

import torch
import triton

from qwenft.models.qwen3_5.gdn import resolve_kernel

print("torch", torch.__version__, "triton", triton.__version__, "GPU", torch.cuda.get_device_name())
for dist in ("flash-linear-attention", "fla-core", "tilelang", "apache-tvm-ffi", "z3-solver", "torchao"):
    print(dist, md.version(dist))
import fla  # noqa: F401,E402
import tilelang  # noqa: F401,E402
from torchao.float8 import convert_to_float8_training  # noqa: F401,E402  (what model.fp8 calls)

torch_minor, ao = torch.__version__.split(".")[:2], md.version("torchao")
pairs = {("2", "11"): "0.17.", ("2", "13"): "0.18."}  # as torchao pairs them with torch releases
want = pairs.get(tuple(torch_minor))
assert want is None or ao.startswith(want), f"torchao {ao} with torch {torch.__version__}: want {want}x"

kernel = resolve_kernel("auto")
print("model.kernels.gdn=auto ->", kernel)
assert kernel == "fla", kernel
EOF
"$python" -m pytest -q -rs -p no:cacheprovider tests/gpu/test_packed_kernels.py -k fla | tee /tmp/gpu_install_check.log
if grep -q "SKIPPED" /tmp/gpu_install_check.log; then
  echo "fla's test skipped in the installed environment: the gpu extra does not give the fast path here" >&2
  exit 1
fi
