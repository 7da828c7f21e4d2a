"""Process group and the (pp, dp, tp) DeviceMesh.

tp is the innermost dimension (neighbouring ranks, so the most frequent collectives stay on NVLink within
a node), pp the outermost. With expert parallelism (ep > 1) dp is split into ("dp_outer", "ep"), ep inner (the
all-to-all of every MoE layer stays among neighbouring ranks), and "dp" is their flattening: the mesh is
(pp, dp_outer, ep, tp) and mesh["dp"] names the same ranks as without ep.
"""

import datetime
import os
import socket
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from qwenft.conf.layout import Layout
from qwenft.distributed.slurm_env import env_from_slurm


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_process_group(backend: str = "auto") -> None:
    """Join (or, for a lone process, create) the default process group."""
    if dist.is_initialized():
        return
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    os.environ.update(env_from_slurm())  # a hand-written `srun qwenft train`: one task per rank, no torchrun
    if "RANK" not in os.environ:  # a single process started without torchrun
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
    if backend == "nccl":
        # modulo: srun --gpus-per-task=1 leaves each task one visible GPU whatever its local rank
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=30))


def build_mesh(layout: Layout, device: str | None = None) -> DeviceMesh:
    """The (pp, dp, tp) mesh on `device` (default: cuda when available, else cpu); with layout.ep > 1 the
    (pp, dp_outer, ep, tp) mesh with "dp" flattened from (dp_outer, ep)."""
    if layout.ep == 1:
        return init_device_mesh(device or device_type(), (layout.pp, layout.dp, layout.tp),
                                mesh_dim_names=("pp", "dp", "tp"))
    mesh = init_device_mesh(device or device_type(), (layout.pp, layout.dp // layout.ep, layout.ep, layout.tp),
                            mesh_dim_names=("pp", "dp_outer", "ep", "tp"))
    mesh["dp_outer", "ep"]._flatten("dp")  # no public flatten yet (torch 2.13); torchtitan uses it the same way
    # torch 2.13 warns at every mesh["dp"] that slicing a flattened dim from the root "will be deprecated"; it
    # works, and every user of the mesh reads "dp" by name, with or without ep
    warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")
    return mesh
