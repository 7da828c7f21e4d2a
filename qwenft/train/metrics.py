"""Per-step metrics: metrics.jsonl in the run dir (always) and Weights & Biases (logger.wandb=true)."""

import json
import logging
import os
import resource
import secrets
import sys
from pathlib import Path

import torch


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory of this rank: allocated CUDA memory on GPU, the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


def read_metrics_rows(path: Path) -> list[dict]:
    """The rows of a metrics.jsonl (none when there is no file); a torn line (a killed write) is left out."""
    rows = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass
    return rows


def keep_aside(path: Path) -> Path | None:
    """A run starting at step 1 over an earlier run's metrics.jsonl (one stopped before any checkpoint, or started
    with checkpoint.resume=none): that file becomes metrics.1.jsonl (or .2, ...: the first free number), so the
    new file holds this run's steps alone and nothing is lost. Returns the new name, None when there was nothing."""
    steps = [row["step"] for row in read_metrics_rows(path) if "step" in row]
    if not steps:
        return None
    aside = next(p for n in range(1, 10**6) if not (p := path.with_name(f"{path.stem}.{n}{path.suffix}")).exists())
    path.rename(aside)
    logging.getLogger("qwenft").warning("%s held an earlier run's steps %d-%d (no checkpoint resumed): kept as %s; "
                                        "this run's steps start afresh in %s", path, min(steps), max(steps),
                                        aside.name, path.name)
    return aside


WANDB_ID = "wandb_run_id"


class MetricsLogger:
    """Writes one JSON object per logged step; rank 0 only (the runner passes enabled=False elsewhere)."""

    def __init__(self, run_dir: Path, enabled: bool, wandb_config: dict | None = None,
                 wandb_project: str = "qwenft", wandb_mode: str | None = None, run_name: str = "",
                 fresh: bool = True):
        """`fresh`: the run starts at step 1, so an earlier run's rows are kept aside (keep_aside)."""
        self.enabled = enabled
        if enabled and fresh:
            keep_aside(run_dir / "metrics.jsonl")
        self.file = open(run_dir / "metrics.jsonl", "a") if enabled else None
        self.wandb = None
        if enabled and wandb_config is not None:
            import wandb

            # a resumed run logs on into the W&B run of its run dir (its id kept in WANDB_ID); the steps it trains
            # again after the checkpoint, which W&B drops as already logged, have the values logged before
            id_file = run_dir / WANDB_ID
            run_id = id_file.read_text().strip() if not fresh and id_file.is_file() else ""
            run_id = run_id or secrets.token_hex(8)
            id_file.write_text(run_id + "\n")
            self.wandb = wandb.init(project=wandb_project, dir=str(run_dir), config=wandb_config,
                                    mode=wandb_mode, name=run_name, id=run_id, resume="allow")

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def cut_after(self, step: int) -> None:
        """Resuming from `step`'s checkpoint: drop the rows of later steps, which the stopped run logged and this one
        logs again, so metrics.jsonl holds each step once, in order."""
        if self.file is None:
            return
        path = Path(self.file.name)
        self.file.close()
        kept = [row for row in read_metrics_rows(path) if row.get("step", 0) <= step]
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("".join(json.dumps(row) + "\n" for row in kept))
        os.replace(tmp, path)
        self.file = open(path, "a")

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.wandb is not None:
            self.wandb.finish()


# Dense bf16 tensor-core peaks (datasheet, no sparsity), for MFU, by a part of the device's name: the first that
# the name holds (the PCIe and NVL H100s before the SXM one, "NVIDIA H100 80GB HBM3").
PEAK_BF16_FLOPS = {"H100 PCIe": 756e12, "H100 NVL": 835e12, "H100": 989e12, "H200 NVL": 835e12, "H200": 989e12,
                   "A100": 312e12}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    return peak_of(torch.cuda.get_device_name(device))


def peak_of(name: str) -> float | None:
    return next((peak for key, peak in PEAK_BF16_FLOPS.items() if key in name), None)


def matmul_params(t) -> dict[str, int]:
    """Parameters that take part in a matmul per token, by layer kind (embedding lookups excluded). MoE: the
    active ones, the router, the `num_experts_per_tok` experts a token is routed to and the shared expert with
    its gate, not all `num_experts` experts."""
    mlp = 3 * t.hidden_size * t.intermediate_size
    if t.is_moe:
        mlp = t.hidden_size * (t.num_experts  # router
                               + 3 * t.num_experts_per_tok * t.moe_intermediate_size  # routed experts
                               + 3 * t.shared_expert_intermediate_size + 1)  # shared expert and its gate
    q, kv = t.num_attention_heads * t.head_dim, t.num_key_value_heads * t.head_dim
    attention = t.hidden_size * (2 * q + 2 * kv) + q * t.hidden_size  # q_proj carries the gate: 2*q rows
    kd = t.linear_num_key_heads * t.linear_key_head_dim
    vd = t.linear_num_value_heads * t.linear_value_head_dim
    gdn = t.hidden_size * (2 * kd + 2 * vd + 2 * t.linear_num_value_heads) + vd * t.hidden_size
    return {"full_attention": attention + mlp, "linear_attention": gdn + mlp,
            "lm_head": t.hidden_size * t.vocab_size}


def flops_per_token(t, seq_len: int, chunk: int = 64, mtp: bool = False) -> float:
    """Training FLOPs (forward + backward = 3x forward) per token of a Qwen3.5 text model.

    6 per matmul parameter (MoE: per active one, `matmul_params`); plus, per full-attention layer, the causal
    QK^T and PV products over seq_len (2 products x 2 FLOPs x seq_len/2 keys x heads x head_dim, x3); plus, per GatedDeltaNet layer, the
    chunked delta rule per value head (state read, correction and update: ~4 dk*dv products; intra-chunk
    attention: chunk*(dk+dv)), x2 FLOPs x3. Packing lowers the real attention term (documents are
    shorter than seq_len); this counts the unpacked upper bound, the convention of MFU reports. `mtp`: a trained
    MTP head too (model.mtp=train|head): its fc [H, 2H], one full-attention layer and a second lm_head pass.
    """
    params = matmul_params(t)
    total = 6 * params["lm_head"]
    if mtp:
        total += 6 * (params["lm_head"] + 2 * t.hidden_size**2 + params["full_attention"])
        total += 3 * 2 * 2 * (seq_len / 2) * t.num_attention_heads * t.head_dim
    dk, dv = t.linear_key_head_dim, t.linear_value_head_dim
    for kind in t.layer_types:
        total += 6 * params[kind]
        if kind == "full_attention":
            total += 3 * 2 * 2 * (seq_len / 2) * t.num_attention_heads * t.head_dim
        else:
            total += 3 * 2 * t.linear_num_value_heads * (4 * dk * dv + chunk * (dk + dv))
    return float(total)
