"""The source checkpoint's multi-token-prediction (MTP) head, kept through a run so that every HF export carries it.

Released Qwen3.5 checkpoints hold top-level `mtp.*` tensors (`fc`, three norms, one full-attention decoder layer with
a dense MLP or an MoE block) that vLLM serves as the speculative-decoding draft; qwenft's model does not compute them
(the loader skips them). At a run's start rank 0 copies them raw from model.path into `<run_dir>/mtp.safetensors`:
the same names, dtypes, bytes and expert layout (per-expert tensors or fused `gate_up_proj` / `down_proj`), with the
source config's `mtp_*` keys in the file's metadata. Every HF export of the run (checkpoint.export_hf=true|merged,
`qwenft export`) writes them beside the trained weights, so no export needs model.path to still exist.

    line = keep(model_path, run_dir, resumed)   # rank 0, at the run's start: the log line
    head = read(run_dir)                         # a KeptHead, or None: write_hf(..., mtp_head=head)
"""

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from qwenft.checkpoint.dcp import size_text

MTP_PREFIX = "mtp."
MTP_FILE = "mtp.safetensors"
NO_HEAD = "exports carry no MTP head (vLLM's MTP speculative decoding needs one)"


@dataclass(frozen=True)
class KeptHead:
    """An MTP head for an HF export: `tensors` under their HF names (`mtp.*`), `config` the `mtp_*` keys that
    config.json's text config gets, `source` where they came from (for messages)."""
    tensors: dict[str, torch.Tensor]
    config: dict
    source: str

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def source_config(model_path) -> dict:
    """The `mtp_*` keys of a checkpoint's config.json: its text config's (`text_config` of a VLM config), over any
    at the top level."""
    d = json.loads((Path(model_path) / "config.json").read_text())
    return {k: v for level in (d, d.get("text_config") or {}) for k, v in level.items() if k.startswith("mtp_")}


def _head_line(count: int, nbytes: int, source: str, where: str) -> str:
    return f"mtp: {count} tensors ({size_text(nbytes)}) kept from {source}{where}, written with every HF export"


def keep(model_path: str | None, run_dir: Path, resumed: bool) -> str:
    """Copy model.path's `mtp.*` tensors to `<run_dir>/mtp.safetensors` (written under a temp name and renamed, so
    never half written) and return the line to log. A resumed run reuses its copy (its header and size checked, its
    tensors not read); a fresh start copies again, and removes a copy an earlier attempt left when the source has no
    head. Tensors are read one at a time with safetensors' `safe_open`, so only the head, never the whole
    checkpoint, is in memory."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from qwenft.models.loader import checkpoint_files

    kept = run_dir / MTP_FILE
    if resumed and kept.is_file():
        return _head_line(*_open(kept, lambda f: (len(f.keys()), _data_bytes(kept), f.metadata().get("source"))),
                          f" (reused {kept})")
    if not model_path:
        kept.unlink(missing_ok=True)
        return f"mtp: none (random init, no model.path); {NO_HEAD}"
    files = {k: f for k, f in checkpoint_files(Path(model_path)).items() if k.startswith(MTP_PREFIX)}
    if not files:
        kept.unlink(missing_ok=True)
        return f"mtp: none in {model_path}; {NO_HEAD}"
    tensors = {}
    for path in sorted(set(files.values())):
        with safe_open(path, "pt") as f:
            for key in sorted(k for k, p in files.items() if p == path):
                tensors[key] = f.get_tensor(key)
    head = KeptHead(tensors, source_config(model_path), str(model_path))
    tmp = kept.with_name(f".{MTP_FILE}.tmp-{os.getpid()}")
    try:
        save_file(head.tensors, str(tmp), metadata={"format": "pt", "source": head.source,
                                                     "config": json.dumps(head.config)})
        os.replace(tmp, kept)
    finally:
        tmp.unlink(missing_ok=True)
    return _head_line(len(head.tensors), head.nbytes, head.source, f" to {kept}")


def read(run_dir: Path) -> KeptHead | None:
    """The head kept in `<run_dir>/mtp.safetensors`, or None when the run keeps none."""
    path = Path(run_dir) / MTP_FILE
    if not path.is_file():
        return None
    return _open(path, lambda f: KeptHead({key: f.get_tensor(key) for key in f.keys()},
                                          json.loads(f.metadata()["config"]), f.metadata()["source"]))


def _data_bytes(path: Path) -> int:
    """The tensor bytes of a safetensors file: all but its 8-byte header length and the header."""
    with open(path, "rb") as f:
        return path.stat().st_size - 8 - int.from_bytes(f.read(8), "little")


def _open(path: Path, fn):
    """fn(the safetensors file at `path`, opened); a damaged file (safetensors checks the header and the size it
    gives on opening) is one line naming it."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, "pt") as f:
            return fn(f)
    except (SafetensorError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{path} ({path.stat().st_size} bytes) is truncated or corrupt ({type(e).__name__}: {e}); "
                         f"delete it, then resume the run (checkpoint.resume=auto) to copy the head from model.path "
                         f"again, or export without one") from None
