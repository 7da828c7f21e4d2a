"""The trained model in HF layout: consolidated safetensors + index + config.json + tokenizer/processor files.

    export_hf(modules, model_cfg, preprocessors, run_dir / "hf", mesh, torch.bfloat16)   # end of training
    write_hf(state, model_cfg, preprocessors, out_dir)       # `qwenft export`: a state loaded from a DCP checkpoint

Both end in `write_hf`, so a run's own export and an offline export of its checkpoint are the same files.
"""

import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist


def full_state_dict(modules: list[torch.nn.Module], pp_group=None) -> dict[str, torch.Tensor]:
    """Unsharded fp32 CPU copies of every parameter of every pipeline stage, on every rank (collective)."""
    from qwenft.models.loader import full_native_state_dict

    out = {name: t.float().clone() for module in modules for name, t in full_native_state_dict(module).items()}
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        parts = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(parts, out, group=pp_group)
        out = {k: v for part in parts for k, v in part.items()}
    return out


def check_out_dir(out_dir: Path, key: str = "out") -> None:
    """An export never writes over existing files: `out_dir` must be new or empty."""
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ValueError(f"{key}={out_dir} exists and is not empty; give a new or empty directory "
                         f"(an export never overwrites files)")


def write_hf(state: dict[str, torch.Tensor], model_cfg, preprocessors: list, out_dir: Path,
             replace: bool = False) -> None:
    """Write native parameters `state` (already in the export dtype) as an HF checkpoint + preprocessor files.

    Written to a temp dir next to `out_dir` and renamed, so `out_dir` is never half written. `replace=True`
    (the run's own <run_dir>/hf, e.g. after a requeue) swaps an earlier export out whole; otherwise an existing
    non-empty `out_dir` is an error."""
    from qwenft.models.loader import write_hf_checkpoint
    from qwenft.models.qwen3_5 import adapter

    if not replace:
        check_out_dir(out_dir)
    prefix = adapter.CAUSAL_LM_PREFIX if model_cfg.vision is None else adapter.VLM_PREFIX
    tmp = out_dir.with_name(out_dir.name + f".tmp-{os.getpid()}")
    write_hf_checkpoint(adapter.to_hf_state_dict(state, model_cfg.text, prefix, tied=model_cfg.tie_word_embeddings),
                        model_cfg, tmp)
    for item in preprocessors:
        item.save_pretrained(str(tmp))
    if out_dir.exists():  # replace=True, or an empty dir
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)


def export_hf(modules: list[torch.nn.Module], model_cfg, preprocessors: list, out_dir: Path, mesh,
              dtype: torch.dtype) -> None:
    """Write the trained model as an HF checkpoint + tokenizer files (collective; global rank 0 writes).

    Each stage's parameters are gathered over its dp x tp ranks; only the stage's (dp 0, tp 0) rank keeps
    them, and those ranks (one pp group) send them to rank 0, so no rank holds more than one stage on the
    CPU except rank 0, which holds the model. An earlier export in `out_dir` is replaced whole.
    """
    from qwenft.models.qwen3_5.gdn import param_dtype

    leader = mesh["dp"].get_local_rank() == 0 and mesh["tp"].get_local_rank() == 0
    state = {}
    for module in modules:
        for name, p in module.named_parameters():
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            if leader:
                state[name] = full.detach().to(param_dtype(name.rsplit(".", 1)[-1], dtype)).cpu()
    if leader and mesh["pp"].size() > 1:
        parts = [None] * mesh["pp"].size() if dist.get_rank() == 0 else None
        dist.gather_object(state, parts, dst=0, group=mesh["pp"].get_group())
        if parts is not None:
            state = {k: v for part in parts for k, v in part.items()}
    if dist.get_rank() == 0:
        write_hf(state, model_cfg, preprocessors, out_dir, replace=True)
    dist.barrier()
