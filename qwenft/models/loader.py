"""Build -> (parallelize, by the caller) -> materialize and fill only the local shards -> re-init buffers.

    model = build_model(cfg, kernels="auto", device="meta")       # no memory, no compute
    ... TP / FSDP2 fully_shard may turn parameters into DTensors here ...
    load_hf_weights(model, ckpt_dir, device="cuda")               # or init_random_weights(model, seed)

A DTensor parameter gets only its local chunk, read straight from the safetensors rows it owns. Writing an
HF checkpoint is qwenft.checkpoint.hf_export's.
"""

import hashlib
import json
import math
import os
from pathlib import Path

import torch
from torch import nn

from qwenft.models.lora import is_adapter
from qwenft.models.qwen3_5 import adapter
from qwenft.models.qwen3_5.configs import ModelConfig, check_checkpoint_dir, config_from_hf_dir
from qwenft.models.qwen3_5.gdn import param_dtype
from qwenft.models.qwen3_5.model import Qwen3_5Model

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"


def build_model(cfg: ModelConfig, kernels: str = "auto", layer_ids=None, embed: bool = True, head: bool = True,
                device="meta", dtype: torch.dtype | None = None, ce_chunk_tokens: int = 0,
                attention_kernel: str = "auto", ce_kernel: str = "torch", moe_kernel: str = "auto",
                mtp: str = "keep") -> Qwen3_5Model:
    """The native model on `device` (default meta: shapes only). `dtype` casts all but GDN's fp32 params."""
    with torch.device(device):
        model = Qwen3_5Model(cfg, layer_ids=layer_ids, embed=embed, head=head, kernels=kernels,
                             ce_chunk_tokens=ce_chunk_tokens, attention_kernel=attention_kernel, ce_kernel=ce_kernel,
                             moe_kernel=moe_kernel, mtp=mtp)
    if dtype is not None:
        model.to_dtype(dtype)
    return model


# ---------------------------------------------------------------- materialize + fill local shards

def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _local_box(param) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(local shape, global offset) of a DTensor's local chunk when it is one contiguous box, else None.

    Shard and Replicate placements give a box. So does FSDP over a tensor- or expert-parallel Shard(d): FSDP's
    `_StridedShard(d, split_factor=n)` on the dp dim, where n is the product of the later mesh dims that shard d
    (FSDP chunks the rank's tp / ep shard, so its part is one slice of it); any other _StridedShard may be
    strided, and gets None. So does a _StridedShard over an uneven split of the tp / ep shard: there torch's
    offset can be off while the shape is right."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard
    # No public equivalent yet (torch 2.13); used by DCP's planner too.
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements = param.device_mesh, param.placements
    for i, p in enumerate(placements):
        if isinstance(p, _StridedShard):
            later = [mesh.size(j) for j, q in enumerate(placements[i + 1:], i + 1)
                     if type(q) is Shard and q.dim == p.dim]
            if p.split_factor != math.prod(later) or param.shape[p.dim] % (mesh.size(i) * p.split_factor):
                return None
        elif type(p) not in (Shard, Replicate):
            return None
    shape, offset = compute_local_shape_and_global_offset(param.shape, mesh, placements)
    if tuple(shape) != tuple(param.to_local().shape):
        return None
    return tuple(shape), tuple(offset)


def _materialize(model: nn.Module, device, dtype):
    device = torch.device(device) if device is not None else None
    if device is not None and any(p.is_meta for p in model.parameters()):
        model.to_empty(device=device)
        if isinstance(model, Qwen3_5Model):
            model.tie_weights()
    if dtype is not None:
        for module in model.modules():
            for name, p in module.named_parameters(recurse=False):
                want = param_dtype(name, dtype)
                if p.dtype == want:
                    continue
                if _is_dtensor(p):
                    raise ValueError(f"parameter {name} is a {p.dtype} DTensor but dtype={want} was asked; pass "
                                     f"dtype to build_model before parallelizing")
                p.data = p.data.to(want)


def _fill(model: nn.Module, read_full, read_box, names=None):
    """Copy each parameter's local part (of those `names` holds, default all). read_full(name) -> full tensor;
    read_box(name, shape, offset) -> box."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if names is not None and name not in names:
                continue
            if _is_dtensor(p):
                box = _local_box(p)
                if box is None:
                    from torch.distributed.tensor import distribute_tensor

                    full = read_full(name).to(p.dtype)
                    # src_data_rank=None: every rank holds the same full tensor; no communication
                    local = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
                else:
                    local = read_box(name, *box)
                p.to_local().copy_(local)
            else:
                p.copy_(read_full(name))


def _reinit_buffers(model: nn.Module):
    for m in model.modules():
        if hasattr(m, "init_buffers"):
            m.init_buffers()


def _model_info(model) -> tuple[ModelConfig, dict[str, torch.Size]]:
    """The model's config and its base parameters' shapes (LoRA adapters are not in an HF checkpoint)."""
    if not isinstance(model, Qwen3_5Model):
        raise ValueError(f"expected a Qwen3_5Model, got {type(model).__name__}")
    return model.cfg, {n: p.shape for n, p in model.named_parameters() if not is_adapter(n)}


def _init_adapters(model: nn.Module, seed: int, device) -> None:
    """LoRA adapters as peft initialises them (`init_value`), the same full tensors on any mesh."""
    shapes = {n: p.shape for n, p in model.named_parameters() if is_adapter(n)}
    init_device = torch.device(device) if device is not None and torch.device(device).type == "cuda" else "cpu"

    def read_box(name, local_shape, offset):
        full = init_value(name, tuple(shapes[name]), seed, device=init_device)
        return full[tuple(slice(o, o + n) for o, n in zip(offset, local_shape))]

    _fill(model, lambda name: read_box(name, tuple(shapes[name]), (0,) * len(shapes[name])), read_box, set(shapes))


def checkpoint_files(ckpt_dir: Path) -> dict[str, Path]:
    """{hf_key: safetensors file} from the index, or from the single model.safetensors."""
    check_checkpoint_dir(ckpt_dir)
    index = ckpt_dir / SAFETENSORS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise ValueError(f"{index} is not a safetensors index ({type(e).__name__}: {e})") from None
        files = {}
        for key, fname in weight_map.items():
            path = ckpt_dir / fname
            if fname not in files and not path.is_file():
                raise FileNotFoundError(f"shard {fname!r} listed in {SAFETENSORS_INDEX} is missing from {ckpt_dir}; "
                                        f"copy or download it again")
            files[key] = path
        for path in set(files.values()):
            _check_shard(path)
        return files
    single = ckpt_dir / SAFETENSORS_SINGLE
    if single.is_file():
        return {k: single for k in _check_shard(single)}
    raise FileNotFoundError(f"no {SAFETENSORS_SINGLE} or {SAFETENSORS_INDEX} in {str(ckpt_dir)!r}; give a dir with "
                            f"the checkpoint's safetensors weights")


def weights_fingerprint(ckpt_dir: Path, samples: int = 64) -> dict:
    """A checkpoint's weights as {"tensors": count, "sha256": ...}: a hash of every tensor's name, dtype and shape
    and of the first and last 4 KiB of `samples` tensors spread over the sorted names. The same for the same
    weights however they are sharded into files or wherever the dir is, and read in a few dozen small reads."""
    files = checkpoint_files(ckpt_dir)
    headers = {}
    for path in set(files.values()):
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            headers[path] = (json.loads(f.read(size)), 8 + size)
    names = sorted(files)
    digest = hashlib.sha256()
    for name in names:
        entry = headers[files[name]][0][name]
        digest.update(json.dumps([name, entry["dtype"], entry["shape"]]).encode())
    handles = {}
    try:
        for name in names[::max(1, len(names) // samples)]:
            path = files[name]
            header, data_at = headers[path]
            begin, end = header[name]["data_offsets"]
            n = min(4096, end - begin)
            if path not in handles:
                handles[path] = os.open(path, os.O_RDONLY)
            fd = handles[path]
            digest.update(os.pread(fd, n, data_at + begin) + os.pread(fd, n, data_at + end - n))
    finally:
        for fd in handles.values():
            os.close(fd)
    return {"tensors": len(names), "sha256": digest.hexdigest()}


def _check_shard(path: Path) -> list[str]:
    """The tensor names of a safetensors file, whose header and size are checked on opening (a truncated
    file fails here, named, instead of as safetensors' bare `incomplete metadata` on the first read)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, "pt") as f:
            return list(f.keys())
    except SafetensorError as e:
        raise ValueError(f"{path} ({path.stat().st_size} bytes) is truncated or corrupt ({e}); copy or download "
                         f"it again") from None


def _first(items, n=5) -> str:
    items = sorted(items)
    return ", ".join(items[:n]) + (f" (+{len(items) - n} more)" if len(items) > n else "")


def load_hf_weights(model: nn.Module, ckpt_dir, device=None, dtype: torch.dtype | None = None,
                    seed: int = 0) -> nn.Module:
    """Materialize `model` (meta -> `device`) and fill it from an HF Qwen3.5 checkpoint, reading only each
    rank's rows. Accepts `model.`- and `model.language_model.`-prefixed layouts; `mtp.*` is read into the MTP head
    when the model has one (model.mtp=train|head) and skipped otherwise, and
    `model.visual.*` too when the model has no vision tower. LoRA adapters (qwenft.models.lora) get peft's
    initialisation from `seed`."""
    from safetensors import safe_open

    ckpt_dir = Path(ckpt_dir)
    cfg, shapes = _model_info(model)
    ckpt_cfg = config_from_hf_dir(ckpt_dir)  # also checks dir / config.json / model_type
    files = checkpoint_files(ckpt_dir)
    # A model may keep only the first layers of a checkpoint (model.num_layers), never more.
    if ckpt_cfg.text.num_hidden_layers < cfg.text.num_hidden_layers or ckpt_cfg.text.hidden_size != cfg.text.hidden_size:
        raise ValueError(
            f"checkpoint {ckpt_dir} has {ckpt_cfg.text.num_hidden_layers} layers x hidden {ckpt_cfg.text.hidden_size}, "
            f"model has {cfg.text.num_hidden_layers} x {cfg.text.hidden_size}"
        )
    dropped = {str(i) for i in range(cfg.text.num_hidden_layers, ckpt_cfg.text.num_hidden_layers)}
    prefix = adapter.detect_prefix(files)
    per_expert = adapter.detect_per_expert(files)
    tied = cfg.tie_word_embeddings and "lm_head.weight" not in files
    sources = {n: adapter.hf_source(n, cfg.text, prefix, tied, per_expert) for n in shapes}

    needed = {k for s in sources.values() for k in adapter.source_keys(s, cfg.text.num_experts)}
    if any(n.startswith(adapter.MTP_PREFIX) for n in shapes) and not any(k.startswith(adapter.MTP_PREFIX) for k in files):
        raise ValueError(f"model.mtp={model.mtp_mode}: checkpoint {ckpt_dir} has no mtp.* tensors (no MTP head to "
                         f"train); use model.mtp=keep")
    missing = needed - set(files)
    if missing:
        raise ValueError(f"checkpoint {ckpt_dir} is missing {len(missing)} keys the model needs: {_first(missing)}")
    # unexpected = not used by the WHOLE model (a pipeline stage legitimately skips other stages' keys)
    allowed = adapter.expected_hf_keys(_all_native_keys(cfg), cfg.text, prefix, tied, per_expert) | {"lm_head.weight"}
    unexpected = {
        k for k in files
        if k not in allowed and not k.startswith(adapter.IGNORED_HF_PREFIXES)
        and not (cfg.vision is None and k.startswith(adapter.VISUAL_PREFIX))
        and not (k.startswith(prefix + "layers.") and k[len(prefix + "layers."):].split(".")[0] in dropped)
    }
    if unexpected:
        raise ValueError(f"checkpoint {ckpt_dir} has {len(unexpected)} keys this model does not know: "
                         f"{_first(unexpected)}")

    handles = {}

    def open_(path):
        if path not in handles:
            handles[path] = safe_open(path, "pt")
        return handles[path]

    def check_rows(name, sl):
        src = sources[name]
        shape = list(sl.get_shape())
        if src.row_start is not None:
            shape[0] = src.row_end - src.row_start
        if tuple(shape) != tuple(shapes[name]):
            raise ValueError(f"shape mismatch for {name} (from {src.hf_key}): model expects {tuple(shapes[name])}, "
                             f"checkpoint has {tuple(shape)}")

    def read_box(name, local_shape, offset):
        src = sources[name]
        if isinstance(src, adapter.ExpertSource):
            return read_expert_box(lambda key: open_(files[key]).get_slice(key), src, tuple(shapes[name]),
                                   local_shape, offset)
        sl = open_(files[src.hf_key]).get_slice(src.hf_key)
        check_rows(name, sl)
        row0 = src.row_start or 0
        index = tuple(
            slice(row0 + o, row0 + o + n) if d == 0 else slice(o, o + n)
            for d, (o, n) in enumerate(zip(offset, local_shape))
        )
        return sl[index]

    def read_full(name):
        return read_box(name, tuple(shapes[name]), (0,) * len(shapes[name]))

    _materialize(model, device, dtype)
    _fill(model, read_full, read_box, set(shapes))
    _init_adapters(model, seed, device)
    _reinit_buffers(model)
    return model


def read_expert_box(get_slice, src: adapter.ExpertSource, shape, local_shape, offset) -> torch.Tensor:
    """Experts [e0, e0+ne) x rows [r0, r0+nr) x columns [c0, c0+nc) of a fused native expert tensor of `shape`,
    read from a checkpoint that stores one tensor per expert and projection (`get_slice(key)`: safetensors)."""
    (e0, r0, c0), (ne, nr, nc) = offset, local_shape
    experts = []
    for j in range(e0, e0 + ne):
        rows, part0, cols = [], 0, None
        for key in src.keys(j):
            sl = get_slice(key)
            part_rows, cols = sl.get_shape()
            lo, hi = max(r0, part0), min(r0 + nr, part0 + part_rows)
            if lo < hi:
                rows.append(sl[lo - part0:hi - part0, c0:c0 + nc])
            part0 += part_rows
        if (part0, cols) != tuple(shape[1:]):
            raise ValueError(f"shape mismatch for {src.keys(j)}: the model expects {tuple(shape[1:])} per expert "
                             f"(projections stacked), the checkpoint has {(part0, cols)}")
        experts.append(torch.cat(rows))
    return torch.stack(experts)


def _all_native_keys(cfg: ModelConfig) -> list[str]:
    with torch.device("meta"):
        full = Qwen3_5Model(cfg, kernels="torch")
    return [n for n, _ in full.named_parameters()] + (["lm_head.weight"] if cfg.tie_word_embeddings else [])


# ---------------------------------------------------------------- random init

def _seed_for(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & (2**63 - 1)


def init_value(name: str, shape, seed: int, std: float = 0.02, device="cpu") -> torch.Tensor:
    """The full fp32 initial value of a native parameter; depends only on (seed, name, shape, device type),
    so every sharding of the model gets the same numbers. Matches transformers' init scheme for Qwen3.5.
    On CUDA the values come from CUDA's generator (different numbers than on the CPU, the same on every GPU
    and mesh): drawing 5.6 B values on the CPU took ~50 s per rank, on a GPU well under a second."""
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(_seed_for(seed, name))
    with torch.device(device):
        return _init_value(name, shape, gen, std)


def _init_value(name: str, shape, gen: torch.Generator, std: float) -> torch.Tensor:
    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("lora_A.weight"):  # peft's: kaiming_uniform_(a=sqrt(5)), a bound of 1 / sqrt(fan_in)
        bound = 1.0 / shape[-1] ** 0.5
        return torch.empty(shape).uniform_(-bound, bound, generator=gen)
    if name.endswith("lora_B.weight"):  # zeros: the adapted model starts as the base model
        return torch.zeros(shape)
    if leaf == "A_log":
        return torch.empty(shape).uniform_(0.01, 16, generator=gen).log_()
    if leaf == "dt_bias" or name.endswith("linear_attn.norm.weight"):
        return torch.ones(shape)
    if name.startswith("visual.") and ".norm" in name and leaf == "weight":  # vision LayerNorms: plain weight
        return torch.ones(shape)
    if leaf == "weight" and "norm" in name.rsplit(".", 2)[-2]:  # zero-centred RMSNorm: (1 + weight)
        return torch.zeros(shape)
    if name.endswith(".bias"):
        return torch.zeros(shape)
    if leaf.startswith("conv_"):  # nn.Conv1d's default (kaiming-uniform, fan_in = kernel size)
        bound = 1.0 / shape[-1] ** 0.5
        return torch.empty(shape).uniform_(-bound, bound, generator=gen)
    return torch.empty(shape).normal_(0.0, std, generator=gen)


def init_random_weights(model: nn.Module, seed: int = 0, device=None, dtype: torch.dtype | None = None) -> nn.Module:
    """Materialize and initialize deterministically per parameter name (same full tensors on any mesh)."""
    cfg, shapes = _model_info(model)
    tied_to_embed = cfg.tie_word_embeddings
    init_device = torch.device(device) if device is not None and torch.device(device).type == "cuda" else "cpu"
    values: dict[str, torch.Tensor] = {}

    def read_full(name):
        key = "embed_tokens.weight" if tied_to_embed and name == "lm_head.weight" else name
        if key not in values:
            values.clear()  # one full tensor alive at a time
            values[key] = init_value(key, tuple(shapes[name]), seed, device=init_device)
        return values[key]

    def read_box(name, local_shape, offset):
        full = read_full(name)
        return full[tuple(slice(o, o + n) for o, n in zip(offset, local_shape))]

    _materialize(model, device, dtype)
    _fill(model, read_full, read_box, set(shapes))
    _init_adapters(model, seed, device)
    _reinit_buffers(model)
    return model
