"""The trained model in HF layout: consolidated safetensors + index + config.json + tokenizer/processor files.

    export_hf(modules, model_cfg, preprocessors, run_dir / "hf", mesh, torch.bfloat16, source_dir)  # end of training
    write_hf(state, model_cfg, preprocessors, out_dir, source_dir)  # `qwenft export`: a DCP checkpoint's state
    write_peft_adapter(state, model_cfg, lora, base, out_dir)  # `qwenft export` of a LoRA run's checkpoint
    merge_into_base(trained, model_cfg, lora, base_dir, seed, dtype)  # ... merged=true: then write_hf
    export_peft_adapter(modules, model_cfg, lora, base, run_dir / "adapter", mesh, torch.float32)   # peft=lora
    save_hf(model, model_cfg, out_dir)                        # one model (any TP/FSDP sharding), weights + config

All end in `write_hf_checkpoint`, so a run's own export and an offline export of its checkpoint are the same
files. Reading an HF checkpoint is qwenft.models.loader's.

A model export writes the run's multi-token-prediction head (`mtp_head`, qwenft.checkpoint.mtp: the source's `mtp.*`
tensors, kept raw at the run's start) beside the trained weights, with its `mtp_*` config keys; a peft adapter dir
holds only adapter weights and never carries it.

A model export can generate on its own: config.json carries the tokenizer's eos and pad ids, and
generation_config.json lists every id that ends a reply (`<|im_end|>`, `<|endoftext|>`, the tokenizer's eos),
merged into the source checkpoint's generation_config.json (`source_dir`, the run's model.path), whose other
keys (the recommended sampling) are kept as written.
"""

import dataclasses
import errno
import json
import os
import shutil
import socket
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from qwenft.checkpoint.mtp import MTP_PREFIX, KeptHead


def full_state_dict(modules: list[torch.nn.Module], pp_group=None) -> dict[str, torch.Tensor]:
    """Unsharded fp32 CPU copies of every parameter of every pipeline stage, on every rank (collective)."""
    out = {name: t.float().clone() for module in modules for name, t in full_native_state_dict(module).items()}
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        parts = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(parts, out, group=pp_group)
        out = {k: v for part in parts for k, v in part.items()}
    return out


def check_out_dir(out_dir: Path, key: str = "out") -> None:
    """An export never writes over existing files: `out_dir` must be new or empty."""
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        what = "is a file" if not out_dir.is_dir() else "exists and is not empty"
        raise ValueError(f"{key}={out_dir} {what}; give a new or empty directory (an export never overwrites files)")


END_OF_TURN, END_OF_TEXT = "<|im_end|>", "<|endoftext|>"


def end_token_ids(tokenizer) -> list[int]:
    """The ids that end a reply, those the tokenizer has, in this order: `<|im_end|>` (a chat turn's end),
    `<|endoftext|>` (a document's end), the tokenizer's eos (one of those two in Qwen's tokenizers)."""
    vocab = tokenizer.get_vocab()
    ids = (vocab.get(END_OF_TURN), vocab.get(END_OF_TEXT), tokenizer.eos_token_id)
    return list(dict.fromkeys(i for i in ids if i is not None))


def generation_config(tokenizer, source_dir=None) -> dict:
    """generation_config.json's content: the source checkpoint's (`source_dir`/generation_config.json, when
    there is one) with its keys kept as written, its eos ids followed by `end_token_ids(tokenizer)` (each
    once), and the tokenizer's pad / bos id where the source sets none."""
    out = {}
    path = Path(source_dir) / "generation_config.json" if source_dir else None
    if path is not None and path.is_file():
        try:
            out = json.loads(path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"model.path={source_dir}: generation_config.json is not valid JSON ({e}); fix or "
                             f"remove it") from None
        if not isinstance(out, dict):
            raise ValueError(f"model.path={source_dir}: generation_config.json holds a {type(out).__name__}, not "
                             f"a JSON object; fix or remove it")
    eos = out.get("eos_token_id")
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    out["eos_token_id"] = list(dict.fromkeys(eos + end_token_ids(tokenizer)))
    for key in ("pad_token_id", "bos_token_id"):
        if out.get(key) is None and getattr(tokenizer, key) is not None:
            out[key] = getattr(tokenizer, key)
    return out


def _with_token_ids(model_cfg, tokenizer):
    """`model_cfg` with the tokenizer's eos and pad ids where the config has none (a random-init model's),
    so config.json names them as Qwen's own checkpoints do."""
    text = model_cfg.text
    ids = {key: getattr(tokenizer, key) for key in ("eos_token_id", "pad_token_id") if getattr(text, key) is None}
    return dataclasses.replace(model_cfg, text=dataclasses.replace(text, **ids))


def _umask() -> int:
    try:  # Linux names it without changing it
        with open("/proc/self/status") as f:
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        mask = os.umask(0o022)
        os.umask(mask)
        return mask


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def _idle(tmp: Path, seconds: float = 3600.0) -> bool:
    """Nothing in `tmp` written for `seconds`: no export is writing it (a live one writes a file at least every
    few minutes, a shard at a time)."""
    import time

    newest = max((p.stat().st_mtime for p in (tmp, *tmp.iterdir())), default=0.0)
    return time.time() - newest > seconds


def _remove_dead_temps(out_dir: Path, any_host: bool) -> None:
    """Remove what exports into `out_dir` that were killed left (a full-size model each): `<out>.tmp-<host>-<pid>`
    dirs of this host whose process is gone, or is this one (a pid reused after a reboot or in a new container).
    Another host's (a shared filesystem) and a live process's are left alone, as they may be being written, unless
    `any_host` (the caller holds the run dir that `out_dir` is in: a requeued run's export on another node) and it
    has not been written for an hour (`qwenft export` takes no lock, and may write there from another host)."""
    host, prefix = socket.gethostname(), f"{out_dir.name}.tmp-"
    for tmp in out_dir.parent.iterdir():
        where, _, pid = tmp.name.removeprefix(prefix).rpartition("-")
        if not (tmp.name.startswith(prefix) and pid.isdigit()):
            continue
        # `where` "": the <out>.tmp-<pid> of an earlier qwenft
        if where in (host, "") and (int(pid) == os.getpid() or not _alive(int(pid))) or any_host and _idle(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def _written_beside(out_dir: Path, own_run_dir: bool):
    """A temp dir beside `out_dir` for the block to write an export into, renamed to `out_dir` when the block ends
    (replacing an earlier export only in the caller's own run dir; elsewhere `out_dir` must still be absent or
    empty then) and removed when it raises or is interrupted, so neither `out_dir` nor a temp dir is ever left
    half written. Temp dirs of killed exports into `out_dir` are removed first (`_remove_dead_temps`;
    `own_run_dir`: `out_dir` is in the run dir the caller has locked)."""
    if out_dir.parent.is_dir():
        _remove_dead_temps(out_dir, any_host=own_run_dir)
    tmp = out_dir.with_name(f"{out_dir.name}.tmp-{socket.gethostname()}-{os.getpid()}")
    try:
        yield tmp
        same_file_modes(tmp)
        if own_run_dir and out_dir.exists():
            shutil.rmtree(out_dir)
        elif out_dir.is_dir() and not any(out_dir.iterdir()):
            out_dir.rmdir()
        try:
            tmp.rename(out_dir)  # fails onto a dir another export into the same `out` filled first: it stays
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
                raise
            raise ValueError(f"out={out_dir} was written by another export meanwhile; this export is removed "
                             "(an export never overwrites files)") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def same_file_modes(directory: Path) -> None:
    """Give every file under `directory` the mode a plain `open` gives (0666 less the umask): safetensors
    writes its files through a private temp file (0600), the other writers get 0644 under the usual umask."""
    mode = 0o666 & ~_umask()
    for path in directory.rglob("*"):
        if path.is_file():
            path.chmod(mode)


def write_hf(state: dict[str, torch.Tensor], model_cfg, preprocessors: list, out_dir: Path, source_dir=None,
             replace: bool = False, mtp_head: KeptHead | None = None) -> None:
    """Write native parameters `state` (already in the export dtype) as an HF checkpoint + preprocessor files
    (the first is the tokenizer) + generation_config.json (merged with `source_dir`'s, see `generation_config`).

    `mtp_head`'s tensors are written as they are (their own dtypes) and its config keys go into config.json's text
    config. A `state` whose HF names already hold `mtp.*` tensors (a head the run trained) replaces its tensors
    whole, so the two expert layouts never mix.

    Written to a temp dir next to `out_dir` and renamed (`_written_beside`), so `out_dir` is never half written.
    `replace=True` (the run's own <run_dir>/hf, e.g. after a requeue, written under the run dir's lock) swaps an
    earlier export out whole; otherwise an existing non-empty `out_dir` is an error."""
    from qwenft.models.qwen3_5 import adapter

    if not replace:
        check_out_dir(out_dir)
    tokenizer = preprocessors[0]
    generation = generation_config(tokenizer, source_dir)  # a bad source file fails before anything is written
    prefix = adapter.CAUSAL_LM_PREFIX if model_cfg.vision is None else adapter.VLM_PREFIX
    hf_sd = adapter.to_hf_state_dict(state, model_cfg.text, prefix, tied=model_cfg.tie_word_embeddings)
    mtp_config = dict(mtp_head.config) if mtp_head is not None else {}
    if any(k.startswith(MTP_PREFIX) for k in hf_sd):  # a head the run trained (model.mtp=train|head)
        mtp_config["mtp_num_hidden_layers"] = model_cfg.text.mtp_num_hidden_layers
    elif mtp_head is not None:
        hf_sd.update(mtp_head.tensors)
    with _written_beside(out_dir, own_run_dir=replace) as tmp:
        write_hf_checkpoint(hf_sd, _with_token_ids(model_cfg, tokenizer), tmp, text_config_extra=mtp_config or None)
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n")
        for item in preprocessors:
            item.save_pretrained(str(tmp))


def _gather_on_rank0(modules: list[torch.nn.Module], mesh, dtype: torch.dtype, keep=lambda name: True) -> dict:
    """Full CPU copies (in `dtype`, GDN's decay in fp32) of the parameters `keep(name)` selects, of every stage, on
    global rank 0 (collective; empty elsewhere). Each stage's parameters are gathered over its dp x cp x tp ranks; only
    the stage's (dp 0, cp 0, tp 0) rank keeps them, and those ranks (one pp group) send them to rank 0, so no rank holds
    more than one stage on the CPU except rank 0."""
    from qwenft.models.qwen3_5.gdn import param_dtype

    batch = mesh["dp_cp"] if "cp" in (mesh.mesh_dim_names or ()) else mesh["dp"]  # dp x cp: qwenft's meshes
    leader = batch.get_local_rank() == 0 and mesh["tp"].get_local_rank() == 0
    state = {}
    for module in modules:
        for name, p in module.named_parameters():
            if not keep(name):
                continue
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            if leader:
                state[name] = full.detach().to(param_dtype(name.rsplit(".", 1)[-1], dtype)).cpu()
    if leader and mesh["pp"].size() > 1:
        parts = [None] * mesh["pp"].size() if dist.get_rank() == 0 else None
        dist.gather_object(state, parts, dst=0, group=mesh["pp"].get_group())
        if parts is not None:
            state = {k: v for part in parts for k, v in part.items()}
    return state if dist.get_rank() == 0 else {}


def export_hf(modules: list[torch.nn.Module], model_cfg, preprocessors: list, out_dir: Path, mesh,
              dtype: torch.dtype, source_dir=None, mtp_head: KeptHead | None = None) -> None:
    """Write the trained model as an HF checkpoint + tokenizer files (collective; global rank 0 writes). An
    earlier export in `out_dir` is replaced whole. `mtp_head`: the MTP head to write (see `write_hf`), read by rank
    0 alone (the others pass None)."""
    state = _gather_on_rank0(modules, mesh, dtype)
    if dist.get_rank() == 0:
        write_hf(state, model_cfg, preprocessors, out_dir, source_dir, replace=True, mtp_head=mtp_head)
    dist.barrier()


def export_merged_hf(modules: list[torch.nn.Module], model_cfg, preprocessors: list, lora, out_dir: Path, mesh,
                     dtype: torch.dtype, source_dir=None, mtp_head: KeptHead | None = None) -> None:
    """Write the base with its LoRA adapters merged in (W + alpha / r B A, computed in fp32) as an HF checkpoint,
    as `export_hf` does for a fully finetuned model (collective; global rank 0 writes)."""
    from qwenft.models.lora import merge_adapters
    from qwenft.models.qwen3_5.gdn import param_dtype

    state = _gather_on_rank0(modules, mesh, torch.float32)
    if dist.get_rank() == 0:
        state = {k: v.to(param_dtype(k.rsplit(".", 1)[-1], dtype))
                 for k, v in merge_adapters(state, model_cfg, lora.scaling).items()}
        write_hf(state, model_cfg, preprocessors, out_dir, source_dir, replace=True, mtp_head=mtp_head)
    dist.barrier()


def write_peft_adapter(state: dict[str, torch.Tensor], model_cfg, lora, base_model: str, out_dir: Path,
                       replace: bool = False) -> None:
    """Native LoRA adapter tensors `state` (and embed_tokens / lm_head when trained whole) as a peft adapter dir:
    adapter_model.safetensors under transformers' module names + adapter_config.json, which `peft.PeftModel.from_pretrained(model, out_dir)` loads (and
    vLLM / SGLang serve). Written to a temp dir and renamed, as `write_hf`."""
    from safetensors.torch import save_file

    from qwenft.models.lora import peft_adapter_config, to_peft_state_dict

    if not replace:
        check_out_dir(out_dir)
    tensors = {k: t.contiguous() for k, t in to_peft_state_dict(state, model_cfg).items()}
    config = peft_adapter_config(model_cfg, lora, base_model)
    with _written_beside(out_dir, own_run_dir=replace) as tmp:
        tmp.mkdir(parents=True)
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))


def export_peft_adapter(modules: list[torch.nn.Module], model_cfg, lora, base_model: str, out_dir: Path, mesh,
                        dtype: torch.dtype) -> None:
    """Write the trained LoRA adapters (and embed_tokens / lm_head when trained whole) as a peft adapter dir
    (collective; global rank 0 writes)."""
    from qwenft.models.lora import in_adapter_dir

    tied = model_cfg.tie_word_embeddings
    state = _gather_on_rank0(modules, mesh, dtype, keep=lambda name: in_adapter_dir(name, lora, tied))
    if dist.get_rank() == 0:
        write_peft_adapter(state, model_cfg, lora, base_model, out_dir, replace=True)
    dist.barrier()


def merge_into_base(trained: dict[str, torch.Tensor], model_cfg, lora, base_dir: Path, seed: int,
                    dtype: torch.dtype, mtp: str = "keep") -> dict[str, torch.Tensor]:
    """A LoRA checkpoint's trained parameters (`dcp.load_model_state(..., lora=lora)`) merged into the base
    weights read from `base_dir` (the run's model.path), in fp32, as `export_merged_hf` merges them: full native
    parameters in `dtype` (GDN's decay in fp32), for `write_hf`. `mtp`: the run's model.mtp (a trained MTP head's
    base weights come from `base_dir` too, with its adapters merged)."""
    from qwenft.models.loader import build_model, load_hf_weights
    from qwenft.models.lora import apply_lora, merge_adapters
    from qwenft.models.qwen3_5.gdn import param_dtype

    model = build_model(model_cfg, kernels="torch", device="meta", dtype=torch.float32, mtp=mtp)
    apply_lora(model, lora, adapter_dtype=torch.float32)
    load_hf_weights(model, base_dir, device="cpu", dtype=torch.float32, seed=seed)
    state = {name: p.detach() for name, p in model.named_parameters()}
    state.update({name: t.float() for name, t in trained.items()})
    return {k: v.to(param_dtype(k.rsplit(".", 1)[-1], dtype))
            for k, v in merge_adapters(state, model_cfg, lora.scaling).items()}


def full_native_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded CPU copies of all parameters (collective under DTensor: every rank must call it)."""
    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = t.detach().cpu()
    return out


def _parse_size(size) -> int:
    if isinstance(size, int):
        return size
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    s = str(size).strip().upper()
    for unit in sorted(units, key=len, reverse=True):
        if s.endswith(unit):
            return int(float(s[: -len(unit)]) * units[unit])
    return int(s)


def write_hf_checkpoint(hf_sd: dict[str, torch.Tensor], cfg, out_dir, max_shard_size="5GB",
                        text_config_extra: dict | None = None):
    """Write an HF state dict as safetensors shards + index + config.json (its text config with
    `text_config_extra`'s keys added)."""
    from safetensors.torch import save_file

    from qwenft.models.loader import SAFETENSORS_INDEX, SAFETENSORS_SINGLE
    from qwenft.models.qwen3_5.configs import to_hf_config

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    limit = _parse_size(max_shard_size)
    shards, current, size = [], {}, 0
    for key in sorted(hf_sd):
        t = hf_sd[key].contiguous()
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > limit:
            shards.append(current)
            current, size = {}, 0
        current[key] = t
        size += nbytes
    shards.append(current)
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = SAFETENSORS_SINGLE if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out_dir / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for t in hf_sd.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True))
    config = to_hf_config(cfg, text_config_extra)
    # the weights' dtype, by element count (GDN's A_log and dt_bias stay fp32 in a bf16 export): the one loaders
    # such as vLLM take for dtype=auto, as from Qwen's own config.json
    counts = Counter()
    for t in hf_sd.values():
        counts[t.dtype] += t.numel()
    for part in {id(c): c for c in (config, config.get_text_config())}.values():
        part.dtype = counts.most_common(1)[0][0]
    config.save_pretrained(str(out_dir))


def save_hf(model: torch.nn.Module, cfg, out_dir, max_shard_size="5GB") -> None:
    """Gather full tensors and write a transformers-loadable checkpoint (rank 0 writes). Text-only configs use
    the Qwen3_5ForCausalLM layout (`model.`), VLM configs `model.language_model.` + `model.visual.`.
    Pipeline stages each hold part of the model: gather their `full_native_state_dict`s and call
    `write_hf_checkpoint(adapter.to_hf_state_dict(...))` instead."""
    from qwenft.models.qwen3_5 import adapter

    native = full_native_state_dict(model)
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return
    prefix = adapter.CAUSAL_LM_PREFIX if cfg.vision is None else adapter.VLM_PREFIX
    hf_sd = adapter.to_hf_state_dict(native, cfg.text, prefix, tied=cfg.tie_word_embeddings)
    write_hf_checkpoint(hf_sd, cfg, out_dir, max_shard_size)
