"""LoRA adapters beside the model's projections (`peft=lora`): y = W x + (alpha / r) B A dropout(x).

    lora = LoRAConfig(rank=16, alpha=32)
    check_targets(model_cfg, lora)                 # a target matching no module fails before anything is built
    apply_lora(model, lora, adapter_dtype=fp32)    # on the meta model or stage, before parallelizing

A target `nn.Linear` keeps its (frozen) weight and gains two children, `lora_A` (r x in) and `lora_B`
(out x r), plus a forward hook adding the adapter's output. Parameter names of the base stay as they are, so
the HF loader, tensor parallelism's `ShardedLinear`, FSDP units and checkpoints see the same model; the adapters
ride inside each layer's FSDP unit. The hook runs before tensor parallelism's row-parallel output hook (applied
later), so the block's one collective sums the adapter's partial output with the base's.

Targets are transformers' modules, named as transformers names them (`in_proj_qkv`, `in_proj_z`, `o_proj`, ...).
Where the native model splits one (GatedDeltaNet's `in_proj_qkv` into q_proj/k_proj/v_proj), the adapter is still
one LoRA of that module: one A, on the first piece (`q_proj.lora_A`), shared by the pieces' hooks, and B's rows
split as the base weight's are (`q_proj/k_proj/v_proj.lora_B`); `hf_source` maps it one to one onto peft's
`in_proj_qkv.lora_A` / `lora_B`. Each piece's hook multiplies A again (r rows: a few percent of the piece's
own matmul) and, with dropout, draws its own mask.

Initialisation as peft's default (qwenft.models.loader.init_value): A Kaiming-uniform (a = sqrt(5)), B zeros, so
the adapted model computes exactly what the base does until the first update.
"""

import functools
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .qwen3_5 import adapter
from .qwen3_5.attention import local

ALL_LINEAR = "all-linear"
ADAPTER_NAMES = ("lora_A", "lora_B")


@dataclass(frozen=True)
class LoRAConfig:
    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = (ALL_LINEAR,)  # transformers' leaf names or regexes on `hf_module_name`
    vision: bool = False  # also the vision tower's linears
    train_embeddings: bool = False
    train_head: bool = False

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def is_adapter(name: str) -> bool:
    """Whether a parameter name is a LoRA adapter's."""
    return any(f".{a}." in name for a in ADAPTER_NAMES)


def modules_to_save(lora: LoRAConfig, tied: bool) -> list[str]:
    """The modules trained whole, by transformers' leaf name (adapter_config.json's `modules_to_save`). With tied
    embeddings (`tie_word_embeddings`: embed_tokens and lm_head one matrix) either flag trains that matrix, named
    `embed_tokens` as peft names it with `ensure_weight_tying` (peft ties lm_head to it on load)."""
    if tied:
        return ["embed_tokens"] if lora.train_embeddings or lora.train_head else []
    return [name for flag, name in ((lora.train_embeddings, "embed_tokens"), (lora.train_head, "lm_head")) if flag]


def in_adapter_dir(name: str, lora: LoRAConfig, tied: bool) -> bool:
    """Whether a native parameter goes into peft's adapter dir: an adapter's, or that of a module trained whole
    (tied: the shared matrix, `embed_tokens.weight`, the one name torch gives it)."""
    return is_adapter(name) or name.removesuffix(".weight") in modules_to_save(lora, tied)


def hf_module_name(native_module: str, text_cfg) -> str:
    """transformers' name of the module a native linear is (a piece of), without the `model.` prefix:
    `layers.0.linear_attn.q_proj` -> `layers.0.linear_attn.in_proj_qkv`, `visual.blocks.0.attn.qkv` unchanged."""
    if native_module.startswith("visual."):
        return native_module
    return adapter.hf_source(native_module + ".weight", text_cfg, prefix="").hf_key.removesuffix(".weight")


def _candidates(model: nn.Module, text_cfg, vision: bool) -> dict[str, list[tuple[int, str, nn.Linear]]]:
    """{hf module name: [(first row in it, native name, linear), ...] in row order} of the linears LoRA may
    adapt: the decoder layers' (the lm_head and embeddings are trained whole or not at all), and the vision
    tower's when `vision`. Not an MoE router (`mlp.gate`): it computes from its weight directly (a hook on its
    output would never get a gradient), and transformers' router is no `nn.Linear`, so peft leaves it out too."""
    from .qwen3_5.moe import MoE

    routers = {id(m.gate) for m in model.modules() if isinstance(m, MoE)}
    found = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or id(module) in routers:
            continue
        if not (name.startswith(("layers.", "mtp.")) or (vision and name.startswith("visual."))):
            continue
        start = 0 if name.startswith("visual.") else adapter.hf_source(name + ".weight", text_cfg, "").row_start or 0
        found.setdefault(hf_module_name(name, text_cfg), []).append((start, name, module))
    return {k: sorted(v, key=lambda piece: piece[0]) for k, v in found.items()}


def _matches(entry: str, hf_name: str) -> bool:
    return entry == ALL_LINEAR or entry == hf_name.rsplit(".", 1)[-1] or re.fullmatch(entry, hf_name) is not None


def check_targets(model_cfg, lora: LoRAConfig, mtp: str = "keep") -> None:
    """Raise before anything is built when a peft.* value cannot work for this model (with its MTP head where
    `mtp`, model.mtp, trains one): a target_modules entry that matches no module (naming those that exist), vision
    without a vision tower. (rank, alpha and dropout are checked with the rest of the config, in
    qwenft.conf.schema.)"""
    from .qwen3_5.model import Qwen3_5Model

    if lora.vision and model_cfg.vision is None:
        raise ValueError("peft.vision=true but the model has no vision tower; set peft.vision=false")
    with torch.device("meta"):
        full = Qwen3_5Model(model_cfg, kernels="torch", mtp=mtp)
    names = list(_candidates(full, model_cfg.text, lora.vision))
    for entry in lora.target_modules:
        try:
            hit = any(_matches(entry, n) for n in names)
        except re.error as e:
            raise ValueError(f"peft.target_modules entry {entry!r} is not a module name nor a valid regex ({e})") from None
        if not hit:
            leaves = sorted({n.rsplit(".", 1)[-1] for n in names})
            raise ValueError(f"peft.target_modules entry {entry!r} matches no module; the model's linears are "
                             f"{', '.join(leaves)} (or a regex on names like {names[0]!r}), or {ALL_LINEAR}")


def target_modules(model: nn.Module, text_cfg, lora: LoRAConfig) -> dict[str, list[tuple[int, str, nn.Linear]]]:
    """The modules `apply_lora` adapts in `model` (a model or a pipeline stage), by transformers' name."""
    return {hf: pieces for hf, pieces in _candidates(model, text_cfg, lora.vision).items()
            if any(_matches(entry, hf) for entry in lora.target_modules)}


def apply_lora(model: nn.Module, lora: LoRAConfig, adapter_dtype: torch.dtype) -> dict[str, list[str]]:
    """Freeze `model` (a `Qwen3_5Model` or a pipeline stage of it, on meta or real) and add adapters in
    `adapter_dtype` to its target linears; embeddings and lm_head are trained whole (cast to `adapter_dtype`)
    with `train_embeddings` / `train_head`. Tied, they are one parameter (`Qwen3_5Model.tie_weights`): either
    flag trains it, with one gradient summing both uses and one optimizer state. Call before tensor parallelism.
    Returns {hf module: native pieces}."""
    text_cfg = model.cfg.text
    targets = target_modules(model, text_cfg, lora)
    for p in model.parameters():
        p.requires_grad_(False)
    for hf_name, pieces in targets.items():
        owner = pieces[0][2]
        device = owner.weight.device
        owner.lora_A = nn.Linear(owner.in_features, lora.rank, bias=False, device=device, dtype=adapter_dtype)
        for _, _, linear in pieces:
            linear.lora_B = nn.Linear(lora.rank, linear.out_features, bias=False, device=device, dtype=adapter_dtype)
            linear.register_forward_hook(functools.partial(_add_adapter, lora_A=owner.lora_A, scaling=lora.scaling,
                                                           dropout=lora.dropout))
    for flag, name in ((lora.train_embeddings, "embed_tokens"), (lora.train_head, "lm_head")):
        module = getattr(model, name, None)
        if flag and module is not None:
            module.weight.data = module.weight.data.to(adapter_dtype)
            module.weight.requires_grad_(True)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    return {hf: [name for _, name, _ in pieces] for hf, pieces in targets.items()}


def _add_adapter(linear: nn.Linear, args, out: torch.Tensor, lora_A: nn.Linear, scaling: float,
                 dropout: float) -> torch.Tensor:
    """Forward hook: the base's output plus the adapter's. Under tensor parallelism A and B are DTensors: `local`
    gives their shards, and for a replicated one (A of a column-parallel projection, B of a row-parallel one) sums
    its gradient over the tp ranks, each of which saw only its shard of the rows or columns."""
    x = args[0]
    if dropout:
        x = F.dropout(x, dropout, linear.training)
    a = F.linear(x, local(lora_A.weight).to(x.dtype))
    return out + F.linear(a, local(linear.lora_B.weight).to(x.dtype)) * scaling


# ---------------------------------------------------------------- peft's adapter format

PEFT_PREFIX = "base_model.model."  # peft's PeftModel wraps transformers' model as base_model.model


def _hf_prefix(model_cfg) -> str:
    return adapter.CAUSAL_LM_PREFIX if model_cfg.vision is None else adapter.VLM_PREFIX


def hf_source(native_key: str, model_cfg) -> adapter.Source:
    """Where a native adapter tensor sits in peft's adapter_model.safetensors: A whole, B as the row range its
    base weight has in transformers' (possibly fused) weight; embed_tokens / lm_head trained whole under their
    module's name (peft saves `...embed_tokens.modules_to_save.default.weight` as `...embed_tokens.weight`)."""
    if not is_adapter(native_key):
        return adapter.Source(PEFT_PREFIX + adapter.hf_source(native_key, model_cfg.text, _hf_prefix(model_cfg)).hf_key)
    module, _, leaf = native_key.rpartition(".lora_")  # "layers.0.linear_attn.q_proj", "B.weight"
    if module.startswith("visual."):
        base = adapter.Source(adapter.VISUAL_PREFIX + module[len("visual."):] + ".weight")
    else:
        base = adapter.hf_source(module + ".weight", model_cfg.text, _hf_prefix(model_cfg))
    key = PEFT_PREFIX + base.hf_key.removesuffix("weight") + f"lora_{leaf}"
    return adapter.Source(key) if leaf.startswith("A") else adapter.Source(key, base.row_start, base.row_end)


def to_peft_state_dict(native: dict[str, torch.Tensor], model_cfg) -> dict[str, torch.Tensor]:
    """peft's adapter state dict (transformers' module names) from the full native tensors `in_adapter_dir`. A
    trained tied matrix is written twice, under embed_tokens and lm_head, as peft's `ensure_weight_tying` saves it
    (a copy: safetensors refuses tensors that share memory)."""
    pieces: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for name, t in native.items():
        src = hf_source(name, model_cfg)
        pieces.setdefault(src.hf_key, []).append((src.row_start or 0, t))
    out = {k: torch.cat([t for _, t in sorted(parts, key=lambda p: p[0])]) for k, parts in pieces.items()}
    if model_cfg.tie_word_embeddings and "embed_tokens.weight" in native:
        out[hf_source("lm_head.weight", model_cfg).hf_key] = native["embed_tokens.weight"].clone()
    return out


def peft_target_modules(model_cfg, lora: LoRAConfig) -> list[str]:
    """adapter_config.json's target_modules: transformers' leaf names (q_proj, in_proj_qkv, ...) when every
    module of that name is adapted, else the adapted modules' full names (peft matches a name by its suffix)."""
    from .qwen3_5.model import Qwen3_5Model

    with torch.device("meta"):
        full = Qwen3_5Model(model_cfg, kernels="torch")
    candidates = list(_candidates(full, model_cfg.text, vision=True))
    chosen = [n for n in candidates if any(_matches(e, n) for e in lora.target_modules)
              and (lora.vision or not n.startswith("visual."))]
    # peft adapts a module of any type whose name ends in a target (the vision tower's Conv3d patch_embed.proj
    # shares `proj` with its attention's output linears)
    not_linear = {n.rsplit(".", 1)[-1] for n, m in full.named_modules() if not isinstance(m, nn.Linear)}
    names = []
    for leaf in sorted({n.rsplit(".", 1)[-1] for n in chosen}):
        of_leaf = [n for n in candidates if n.rsplit(".", 1)[-1] == leaf]
        if leaf not in not_linear and all(n in chosen for n in of_leaf):
            names.append(leaf)
        else:
            names += [adapter.VISUAL_PREFIX + n[len("visual."):] if n.startswith("visual.") else
                      _hf_prefix(model_cfg) + n for n in of_leaf if n in chosen]
    return sorted(names)


def peft_adapter_config(model_cfg, lora: LoRAConfig, base_model: str) -> dict:
    """adapter_config.json as peft's LoraConfig writes it, for `lora` on transformers' model of `model_cfg`. A
    trained tied matrix needs `ensure_weight_tying`: without it peft 0.21 gives embed_tokens the trained copy and
    leaves lm_head on the base's matrix."""
    saved = modules_to_save(lora, model_cfg.tie_word_embeddings)
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
            "target_modules": peft_target_modules(model_cfg, lora), "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "use_dora": False, "init_lora_weights": True, "inference_mode": True,
            "modules_to_save": saved or None, "ensure_weight_tying": bool(saved) and model_cfg.tie_word_embeddings}


def merge_adapters(state: dict[str, torch.Tensor], model_cfg, scaling: float) -> dict[str, torch.Tensor]:
    """The base weights with their adapters merged in (W + scaling B A, in the state's dtype), adapters dropped:
    full native parameters, as `checkpoint.export_hf=merged` writes them."""
    owners = {hf_source(k, model_cfg).hf_key: k for k in state if k.endswith(".lora_A.weight")}
    merged = {k: v for k, v in state.items() if not is_adapter(k)}
    for key, b in state.items():
        if key.endswith(".lora_B.weight"):
            a = state[owners[hf_source(key, model_cfg).hf_key.replace("lora_B", "lora_A")]]
            base = key.removesuffix(".lora_B.weight") + ".weight"
            merged[base] = merged[base] + scaling * (b @ a).to(merged[base].dtype)
    return merged
