"""Per-step metrics: metrics.jsonl in the run dir (always) and Weights & Biases (logger.wandb=true)."""

import json
import resource
import sys
from pathlib import Path

import torch


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory of this rank: allocated CUDA memory on GPU, the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


class MetricsLogger:
    """Writes one JSON object per logged step; rank 0 only (the runner passes enabled=False elsewhere)."""

    def __init__(self, run_dir: Path, enabled: bool, wandb_config: dict | None = None,
                 wandb_project: str = "qwenft", wandb_mode: str | None = None, run_name: str = ""):
        self.enabled = enabled
        self.file = open(run_dir / "metrics.jsonl", "a") if enabled else None
        self.wandb = None
        if enabled and wandb_config is not None:
            import wandb

            self.wandb = wandb.init(project=wandb_project, dir=str(run_dir), config=wandb_config,
                                    mode=wandb_mode, name=run_name)

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.wandb is not None:
            self.wandb.finish()
