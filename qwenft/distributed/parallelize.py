"""Per-stage parallelization in its fixed order: TP -> EP -> activation checkpointing -> compile -> FSDP2."""

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from qwenft.distributed.activation_checkpointing import apply_activation_checkpointing
from qwenft.distributed.expert_parallel import apply_ep
from qwenft.distributed.fsdp import apply_fsdp
from qwenft.distributed.mesh import batch_mesh, cp_size
from qwenft.distributed.tensor_parallel import apply_tp


def apply_compile(model: nn.Module, cuda_graphs: bool = False, gdn_graphs: bool = False) -> None:
    """torch.compile each decoder layer's fixed-shape pieces and the norms outside the layers (the final norm,
    the MTP head's: `compile_norms`), never the whole model (model.compile_layer says which, and why the kernels
    and cu_seqlens stay out), so FSDP2's per-layer hooks run as without it; `cuda_graphs` replays each layer's
    graphs as CUDA graphs, `gdn_graphs` fla's GatedDeltaNet kernels too."""
    from qwenft.models.qwen3_5.model import compile_layer, compile_norms

    for layer in model.decoder_layers():
        compile_layer(layer, cuda_graphs, gdn_graphs)
    compile_norms(model)


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh, balanced_attention: bool = False) -> None:
    """Context parallel over `cp_mesh`: the model splits each microbatch's stream into spans
    after the embedding (`Qwen3_5Model.forward`), and its layers exchange what crosses spans over this group
    (qwenft.models.qwen3_5.context_parallel). Parameters stay whole on the cp ranks; FSDP2 shards them over dp x
    cp, which also sums their gradients over the spans."""
    model.cp_group = cp_mesh.get_group()
    model.cp_balanced = balanced_attention  # full attention by halves (`context_parallel.attend_balanced`)


def gdn_graphs(cuda_graphs: bool, tp: int) -> bool:
    """Whether fla's GatedDeltaNet kernels are replayed as CUDA graphs too: under model.cuda_graphs where the layer
    is tensor-parallel. A shard's kernels are small and the host sets the pace there; a whole layer's keep the
    GPU busy, and the graphs' fixed layouts add work and memory (docs/performance.md, "Tensor parallel's
    ceiling")."""
    return cuda_graphs and tp > 1


def parallelize(model: nn.Module, mesh: DeviceMesh, *, param_dtype: torch.dtype,
                reduce_dtype: torch.dtype = torch.float32, activation_checkpointing: str | bool = False,
                vocab_parallel: bool = True, sequence_parallel: bool = False,
                reshard_after_forward: bool = True, compile_layers: bool = False, cuda_graphs: bool = False,
                fsdp: bool = True,
                fsdp_prefetch: int = 0, fp8: str = "off", cp_balanced_attention: bool = False) -> nn.Module:
    """`fp8` (model.fp8): the decoder layers' large linears become torchao float8 linears first
    (qwenft.distributed.float8). TP over mesh["tp"] (when its size > 1), then the MoE experts over mesh["ep"] (when
    the mesh has it), then context parallel over mesh["cp"] (`apply_cp`; `cp_balanced_attention`: attention by
    halves), then activation checkpointing, then (compile_layers) per-layer torch.compile and the norms'
    (`apply_compile`; `cuda_graphs`: the layers' replayed as CUDA graphs, which
    `qwenft.train.spec.check_cuda_graphs` allows), then (`fsdp`, see `qwenft.train.spec.uses_fsdp`) FSDP2 over
    mesh["dp_cp"] (the experts over mesh["dp_outer_cp"], the ranks with the same experts), with `fsdp_prefetch`
    units all-gathered ahead (fsdp.set_prefetch). Without FSDP the parameters must already be stored in
    `param_dtype`, but for GDN's fp32 decay (its forward computes in fp32 either way) and LoRA adapters (their hook
    casts them to the input's dtype).

    `model` is a `Qwen3_5Model` (or one pipeline stage of it) on the meta device; load or init its weights
    afterwards (qwenft.models.loader), which fills only each rank's shards. Call
    `tensor_parallel.validate_tp` before building the model so bad head counts fail early.
    """
    if fp8 != "off":  # first: TP, FSDP2 and compile see the float8 linears (float8.convert_fp8)
        from qwenft.distributed.float8 import convert_fp8

        convert_fp8(model, fp8, mesh["tp"].size())
    tp_mesh = mesh["tp"]
    if tp_mesh.size() > 1:
        apply_tp(model, tp_mesh, vocab_parallel=vocab_parallel, sequence_parallel=sequence_parallel)
    expert_mesh = None
    if "ep" in (mesh.mesh_dim_names or ()):
        apply_ep(model, mesh["ep"])
        expert_mesh = mesh["dp_outer_cp"]
    if cp_size(mesh) > 1:
        apply_cp(model, mesh["cp"], cp_balanced_attention)
    # model.activation_checkpointing's modes (activation_checkpointing.MODES); a bool means true or false
    mode = {True: "true", False: "false"}.get(activation_checkpointing, activation_checkpointing)
    if mode != "false":
        apply_activation_checkpointing(model, mode)
    if compile_layers:
        apply_compile(model, cuda_graphs, gdn_graphs(cuda_graphs, tp_mesh.size()))
    if not fsdp:
        if batch_mesh(mesh).size() > 1:
            raise ValueError(f"FSDP2 left out on {batch_mesh(mesh).size()} data- and context-parallel ranks")
        return model
    apply_fsdp(model, batch_mesh(mesh), param_dtype, reshard_after_forward=reshard_after_forward, reduce_dtype=reduce_dtype,
               prefetch=fsdp_prefetch, expert_mesh=expert_mesh)
    return model
