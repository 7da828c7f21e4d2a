"""HF Qwen3.5 state dict <-> native state dict.

Every native tensor is one contiguous row range of one HF tensor, expressed as `Source(hf_key, row_start,
row_end)`, so a loader can read just the rows a rank owns with safetensors' `get_slice`. The only non-renames:
HF `linear_attn.in_proj_qkv.weight` and `linear_attn.conv1d.weight` are [all Q | all K | all V] rows and
split into q_proj/k_proj/v_proj and conv_q/conv_k/conv_v. (A contiguous column split of the fused tensor for
TP would be wrong: split into q/k/v first.)

Key prefixes: `model.` (Qwen3_5ForCausalLM) or `model.language_model.` (the VLM layout of the released
checkpoints); `lm_head.weight` sits at the top. Native `visual.*` maps to HF `model.visual.*` unchanged.

Qwen3.5-MoE's routed experts are fused natively as transformers holds them in memory
(`mlp.experts.gate_up_proj [E, 2I, H]`, `mlp.experts.down_proj [E, H, I]`); a checkpoint stores them either
so (one `Source` each, rows = experts, so an expert-parallel rank reads its experts' rows) or one tensor per
expert and projection, `mlp.experts.{j}.{gate,up,down}_proj.weight`, which is what transformers 5.24's
`save_pretrained` writes (`ExpertSource`). transformers' `from_pretrained` reads both; `to_hf_state_dict`
writes the fused form. Router, shared expert and its gate are plain renames.
"""

from typing import NamedTuple

import torch

from .configs import TextConfig

CAUSAL_LM_PREFIX = "model."
VLM_PREFIX = "model.language_model."
VISUAL_PREFIX = "model.visual."
# The multi-token-prediction head: top-level `mtp.*` in released checkpoints, the same names natively (mtp.py);
# skipped by a model without the head (model.mtp=keep, which passes the tensors through to exports untouched)
MTP_PREFIX = "mtp."
IGNORED_HF_PREFIXES = (MTP_PREFIX,)

_GDN_RENAMES = {"z_proj": "in_proj_z", "a_proj": "in_proj_a", "b_proj": "in_proj_b"}


class Source(NamedTuple):
    hf_key: str
    row_start: int | None = None  # None = all rows
    row_end: int | None = None


class ExpertSource(NamedTuple):
    """A fused native expert tensor stored per expert: expert j's `projections` (`{prefix}{j}.{proj}.weight`)
    concatenated along dim 1 (gate rows, then up rows), stacked along dim 0."""
    prefix: str  # e.g. "model.layers.3.mlp.experts."
    projections: tuple[str, ...]  # ("gate_proj", "up_proj") or ("down_proj",)

    def keys(self, expert: int) -> list[str]:
        return [f"{self.prefix}{expert}.{proj}.weight" for proj in self.projections]


_EXPERT_PROJECTIONS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


class PerExpert(NamedTuple):
    """Which experts a checkpoint stores one tensor per expert (`mlp.experts.0.gate_proj.weight`), not fused: the
    trunk's, the MTP head's. They may differ: an export of a run that kept its source's head (model.mtp=keep) writes
    the trunk's experts fused beside the head as the source stored it."""
    trunk: bool = False
    mtp: bool = False


def detect_per_expert(hf_keys) -> PerExpert:
    first = [k for k in hf_keys if k.endswith(".mlp.experts.0.gate_proj.weight")]
    return PerExpert(trunk=any(not k.startswith(MTP_PREFIX) for k in first),
                     mtp=any(k.startswith(MTP_PREFIX) for k in first))


def source_keys(src, num_experts: int) -> list[str]:
    """The HF keys a `Source` or `ExpertSource` reads."""
    if isinstance(src, ExpertSource):
        return [k for j in range(num_experts) for k in src.keys(j)]
    return [src.hf_key]


def detect_prefix(hf_keys) -> str:
    """`model.language_model.` if the checkpoint uses the VLM layout, else `model.`."""
    return VLM_PREFIX if any(k.startswith(VLM_PREFIX) for k in hf_keys) else CAUSAL_LM_PREFIX


def hf_source(native_key: str, cfg: TextConfig, prefix: str = CAUSAL_LM_PREFIX, tied: bool = False,
              per_expert: PerExpert = PerExpert()) -> Source | ExpertSource:
    """Where a native tensor comes from in an HF checkpoint (`per_expert`: whose experts are stored one per
    tensor)."""
    if native_key.startswith("visual."):
        return Source(VISUAL_PREFIX + native_key[len("visual."):])
    if native_key == "lm_head.weight":
        return Source(prefix + "embed_tokens.weight") if tied else Source("lm_head.weight")
    parts = native_key.split(".")
    if parts[0] == "mtp":  # top-level, native names; its layer is full attention (no GDN splits)
        if per_expert.mtp and parts[1] == "layers" and parts[3:5] == ["mlp", "experts"]:
            return ExpertSource(".".join(parts[:5]) + ".", _EXPERT_PROJECTIONS[parts[5]])
        return Source(native_key)
    if per_expert.trunk and parts[0] == "layers" and parts[2:4] == ["mlp", "experts"]:
        return ExpertSource(prefix + ".".join(parts[:4]) + ".", _EXPERT_PROJECTIONS[parts[4]])
    if parts[0] == "layers" and parts[2] == "linear_attn":
        name = ".".join(parts[3:])
        base = prefix + ".".join(parts[:3]) + "."
        key_dim = cfg.linear_num_key_heads * cfg.linear_key_head_dim
        value_dim = cfg.linear_num_value_heads * cfg.linear_value_head_dim
        split = {"q": (0, key_dim), "k": (key_dim, 2 * key_dim), "v": (2 * key_dim, 2 * key_dim + value_dim)}
        if name in ("q_proj.weight", "k_proj.weight", "v_proj.weight"):
            return Source(base + "in_proj_qkv.weight", *split[name[0]])
        if name in ("conv_q", "conv_k", "conv_v"):
            return Source(base + "conv1d.weight", *split[name[-1]])
        module, _, rest = name.partition(".")
        if module == "decay":  # native decay.A_log / decay.dt_bias sit directly under linear_attn in HF
            return Source(base + rest)
        if module in _GDN_RENAMES:
            return Source(base + _GDN_RENAMES[module] + "." + rest)
    return Source(prefix + native_key)


def native_to_hf_keys(native_keys, cfg: TextConfig, prefix: str = CAUSAL_LM_PREFIX, tied: bool = False):
    """{native_key: Source} for the given native keys (tied lm_head is omitted: HF does not store it)."""
    return {k: hf_source(k, cfg, prefix, tied) for k in native_keys if not (tied and k == "lm_head.weight")}


def from_hf_state_dict(hf_sd: dict, native_keys, cfg: TextConfig, prefix: str | None = None,
                       tied: bool = False) -> dict:
    """Native state dict for `native_keys` from a full HF state dict (fused or per-expert MoE layout)."""
    prefix = detect_prefix(hf_sd) if prefix is None else prefix
    per_expert = detect_per_expert(hf_sd)
    out = {}
    for k in native_keys:
        src = hf_source(k, cfg, prefix, tied, per_expert)
        if isinstance(src, ExpertSource):
            out[k] = torch.stack([torch.cat([hf_sd[key] for key in src.keys(j)]) for j in range(cfg.num_experts)])
            continue
        t = hf_sd[src.hf_key]
        out[k] = t if src.row_start is None else t[src.row_start:src.row_end]
    return out


def to_hf_state_dict(native_sd: dict, cfg: TextConfig, prefix: str = CAUSAL_LM_PREFIX, tied: bool = False) -> dict:
    """HF state dict from a full native one: fused tensors are re-assembled from their row ranges."""
    pieces: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for k, t in native_sd.items():
        if tied and k == "lm_head.weight":
            continue
        src = hf_source(k, cfg, prefix, tied)
        pieces.setdefault(src.hf_key, []).append((src.row_start or 0, t))
    out = {}
    for hf_key, parts in pieces.items():
        parts.sort(key=lambda p: p[0])
        out[hf_key] = parts[0][1] if len(parts) == 1 else torch.cat([t for _, t in parts], dim=0)
    return out


def expected_hf_keys(native_keys, cfg: TextConfig, prefix: str, tied: bool,
                     per_expert: PerExpert = PerExpert()) -> set[str]:
    return {key for k in native_keys if not (tied and k == "lm_head.weight")
            for key in source_keys(hf_source(k, cfg, prefix, tied, per_expert), cfg.num_experts)}
