"""Process group and the (pp, dp, cp, tp) DeviceMesh.

tp is the innermost dimension (neighbouring ranks, so the most frequent collectives stay on NVLink within
a node), then cp (context parallel: a few exchanges per layer), pp the outermost. With expert parallelism
(ep > 1) dp is split into ("dp_outer", "ep"), ep inner (the all-to-all of every MoE layer stays among
neighbouring ranks), and "dp" is their flattening: the mesh is (pp, dp_outer, cp, ep, tp) and mesh["dp"] names
the same ranks as without ep. "dp_cp" flattens dp and cp: the ranks that hold different tokens of a step, over
which FSDP2 shards and reduces and the loss is summed (`batch_mesh`).
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
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("mesh.backend=nccl needs CUDA GPUs, and this machine has none; use mesh.backend=auto or gloo")
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
    """The (pp, dp, cp, tp) mesh on `device` (default: cuda when available, else cpu); with layout.ep > 1 the
    (pp, dp_outer, cp, ep, tp) mesh with "dp" flattened from (dp_outer, ep), and "dp_outer_cp" from (dp_outer,
    cp). "dp_cp" flattens dp and cp."""
    # torch 2.13 warns at every slice of a flattened dim from the root that it "will be deprecated"; it works,
    # and every user of the mesh reads "dp" and "dp_cp" by name
    warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")
    if layout.ep == 1:
        mesh = init_device_mesh(device or device_type(), (layout.pp, layout.dp, layout.cp, layout.tp),
                                mesh_dim_names=("pp", "dp", "cp", "tp"))
        mesh["dp", "cp"]._flatten("dp_cp")  # no public flatten yet (torch 2.13); torchtitan uses it the same way
        return mesh
    # cp outside ep: the experts' FSDP2 mesh (dp_outer x cp, the ranks holding the same experts) then comes
    # before ep in the mesh, as a 2-D (FSDP, ep) placement needs
    mesh = init_device_mesh(device or device_type(),
                            (layout.pp, layout.dp // layout.ep, layout.cp, layout.ep, layout.tp),
                            mesh_dim_names=("pp", "dp_outer", "cp", "ep", "tp"))
    mesh["dp_outer", "ep"]._flatten("dp")
    mesh["dp_outer", "cp", "ep"]._flatten("dp_cp")
    mesh["dp_outer", "cp"]._flatten("dp_outer_cp")
    return mesh


def batch_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The ranks that hold different tokens of a step (dp x cp): FSDP2 shards over them, gradients and the loss
    are summed over them. A mesh built without a cp dimension (by hand, as some tests do): its dp."""
    return mesh["dp_cp"] if "cp" in (mesh.mesh_dim_names or ()) else mesh["dp"]


def cp_size(mesh: DeviceMesh) -> int:
    """The mesh's context-parallel size (1 where it has no cp dimension)."""
    names = mesh.mesh_dim_names or ()
    # the size straight from the mesh's shape: slicing out mesh["cp"] costs a tenth of a ms, once a microbatch
    return mesh.size(names.index("cp")) if "cp" in names else 1
