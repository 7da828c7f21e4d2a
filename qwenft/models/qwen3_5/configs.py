"""Qwen3.5 configs: `TextConfig` (the decoder), `ModelConfig` (+ vision), named sizes, HF config I/O.

Field names follow transformers' `Qwen3_5TextConfig` and `Qwen3_5MoeTextConfig` so a config.json reads over
one-to-one. One `TextConfig` covers both: `num_experts > 0` makes every layer's MLP the sparse MoE block
(Qwen3.5-MoE has no dense layers: no `mlp_only_layers` / `decoder_sparse_step`), and `intermediate_size`
is then unused.
"""

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"


@dataclass
class TextConfig:
    vocab_size: int = 248320
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 32
    num_attention_heads: int = 16
    num_key_value_heads: int = 4
    head_dim: int = 256
    hidden_act: str = "silu"
    max_position_embeddings: int = 262144
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    mrope_section: list[int] = field(default_factory=lambda: [11, 11, 10])
    attention_bias: bool = False
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    # None = every 4th layer is full attention (transformers' default, `full_attention_interval` 4)
    layer_types: list[str] | None = None
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    # Qwen3.5-MoE; num_experts 0 = the dense model. The other defaults are Qwen3_5MoeTextConfig's.
    num_experts: int = 0
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    router_aux_loss_coef: float = 0.001
    # layers of the multi-token-prediction head (`mtp.*`, models/qwen3_5/mtp.py): 1 in the released checkpoints
    mtp_num_hidden_layers: int = 0

    def __post_init__(self):
        if self.layer_types is None:
            self.layer_types = [
                FULL_ATTENTION if (i + 1) % 4 == 0 else LINEAR_ATTENTION for i in range(self.num_hidden_layers)
            ]
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is {self.num_hidden_layers}"
            )
        bad = sorted(set(self.layer_types) - {FULL_ATTENTION, LINEAR_ATTENTION})
        if bad:
            raise ValueError(f"layer_types has {bad}; valid: {FULL_ATTENTION!r}, {LINEAR_ATTENTION!r}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"linear_num_value_heads {self.linear_num_value_heads} is not a multiple of "
                f"linear_num_key_heads {self.linear_num_key_heads}"
            )
        if sum(self.mrope_section) * 2 != self.rotary_dim:
            raise ValueError(
                f"mrope_section {self.mrope_section} sums to {sum(self.mrope_section)}, expected rotary_dim/2 = "
                f"{self.rotary_dim // 2} (head_dim {self.head_dim} x partial_rotary_factor {self.partial_rotary_factor})"
            )
        if self.num_experts < 0:
            raise ValueError(f"num_experts {self.num_experts} must be >= 0 (0 = dense MLP)")
        if self.is_moe and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} must be in [1, num_experts "
                             f"{self.num_experts}]")
        if self.is_moe and min(self.moe_intermediate_size, self.shared_expert_intermediate_size) < 1:
            raise ValueError(f"moe_intermediate_size {self.moe_intermediate_size} and shared_expert_intermediate_size "
                             f"{self.shared_expert_intermediate_size} must be >= 1")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


@dataclass
class ModelConfig:
    text: TextConfig = field(default_factory=TextConfig)
    vision: dict | None = None  # transformers' Qwen3_5VisionConfig as a dict; None = text-only model
    image_token_id: int = 248056
    video_token_id: int = 248057
    vision_start_token_id: int = 248053
    vision_end_token_id: int = 248054
    tie_word_embeddings: bool = False


def _text(**kw) -> TextConfig:
    return TextConfig(**kw)


# 27B and 0.8B: the Qwen3.5-27B and Qwen3.5-0.8B config.json (text_config).
# 2B / 4B / 9B: copies of their config.json (text_config) agree with the slime/Miles Megatron model scripts on
# every dimension and on tied (2B, 4B) vs untied (9B) embeddings; see docs/models.md.
def _named() -> dict[str, ModelConfig]:
    tiny = ModelConfig(
        text=_text(
            vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, mrope_section=[1, 1, 0],
            linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=16, linear_value_head_dim=16,
            max_position_embeddings=4096,
        ),
        tie_word_embeddings=False,
    )
    size_0_8b = ModelConfig(
        text=_text(
            hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8,
            num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
        ),
        tie_word_embeddings=True,
    )
    size_2b = ModelConfig(
        text=_text(
            hidden_size=2048, intermediate_size=6144, num_hidden_layers=24, num_attention_heads=8,
            num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
        ),
        tie_word_embeddings=True,
    )
    size_4b = ModelConfig(
        text=_text(
            hidden_size=2560, intermediate_size=9216, num_hidden_layers=32, num_attention_heads=16,
            num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
        ),
        tie_word_embeddings=True,
    )
    size_9b = ModelConfig(
        text=_text(
            hidden_size=4096, intermediate_size=12288, num_hidden_layers=32, num_attention_heads=16,
            num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
        ),
        tie_word_embeddings=False,
    )
    size_27b = ModelConfig(
        text=_text(
            hidden_size=5120, intermediate_size=17408, num_hidden_layers=64, num_attention_heads=24,
            num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48,
        ),
        vision=None,
        tie_word_embeddings=False,
    )
    # MoE. tiny_moe: 8 experts (top 2) with dims that keep torch._grouped_mm's 16-byte alignment in fp32.
    # 35b_a3b: transformers' Qwen3_5MoeTextConfig defaults (documented as Qwen3.5-35B-A3B) and the slime
    # Megatron script for Qwen3.5-35B-A3B agree on every dimension below; rope theta 1e7 is the script's
    # (transformers' default, 1e4, is not the checkpoint's); mrope [11, 11, 10] is every Qwen3.5 with head_dim 256.
    tiny_moe = ModelConfig(
        text=_text(
            vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, mrope_section=[1, 1, 0], linear_num_key_heads=4, linear_num_value_heads=8,
            linear_key_head_dim=16, linear_value_head_dim=16, max_position_embeddings=4096,
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        ),
        tie_word_embeddings=False,
    )
    size_35b_a3b = ModelConfig(
        text=_text(
            hidden_size=2048, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
            linear_num_key_heads=16, linear_num_value_heads=32, num_experts=256, num_experts_per_tok=8,
            moe_intermediate_size=512, shared_expert_intermediate_size=512, router_aux_loss_coef=0.001,
        ),
        tie_word_embeddings=False,
    )
    # 122b_a10b, 397b_a17b: their config.json (text_config), as quoted by several independent sources that cite it;
    # the slime Megatron script for 397B-A17B agrees on every dimension it gives (docs/models.md).
    size_122b_a10b = ModelConfig(
        text=_text(
            hidden_size=3072, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=2, head_dim=256,
            linear_num_key_heads=16, linear_num_value_heads=64, num_experts=256, num_experts_per_tok=8,
            moe_intermediate_size=1024, shared_expert_intermediate_size=1024, router_aux_loss_coef=0.001,
        ),
        tie_word_embeddings=False,
    )
    size_397b_a17b = ModelConfig(
        text=_text(
            hidden_size=4096, num_hidden_layers=60, num_attention_heads=32, num_key_value_heads=2, head_dim=256,
            linear_num_key_heads=16, linear_num_value_heads=64, num_experts=512, num_experts_per_tok=10,
            moe_intermediate_size=1024, shared_expert_intermediate_size=1024, router_aux_loss_coef=0.001,
        ),
        tie_word_embeddings=False,
    )
    return {"tiny": tiny, "0.8b": size_0_8b, "2b": size_2b, "4b": size_4b, "9b": size_9b, "27b": size_27b,
            "tiny_moe": tiny_moe, "35b_a3b": size_35b_a3b, "122b_a10b": size_122b_a10b, "397b_a17b": size_397b_a17b}


def _tiny_vlm(tiny: ModelConfig) -> ModelConfig:
    """tiny + a two-block vision tower; the token ids are the tiny VLM tokenizer's (qwenft.data.tiny_vlm):
    3 <|vision_start|>, 4 <|vision_end|>, 5 <|image_pad|>, 6 <|video_pad|>. Built on request only, since
    the vision module imports transformers' Qwen3.5 modeling (seconds)."""
    from .vision import tiny_vision_config

    return dataclasses.replace(tiny, vision=tiny_vision_config(tiny.text.hidden_size), image_token_id=5,
                               video_token_id=6, vision_start_token_id=3, vision_end_token_id=4)


def named_config(name: str) -> ModelConfig:
    """A fresh config for a named size (mutable; callers may override e.g. `text.vocab_size`)."""
    named = _named()
    if name in named:
        return named[name]
    if name == "tiny_vlm":
        return _tiny_vlm(named["tiny"])
    raise ValueError(f"model.name={name!r} is not a named size; valid: {', '.join(sorted(named) + ['tiny_vlm'])} "
                     "(or a checkpoint dir as model.path)")


def transformers_default_mrope_section(half_rotary_dim: int) -> list[int]:
    """The section transformers' Qwen3.5 rotary embedding applies when config.json gives none: it takes
    [11, 11, 10] (the released sizes' 32 = rotary_dim/2) and interleaves H at 1, 4, 7, ... and W at 2, 5, 8, ...
    as far as the dims go; with fewer dims that is fewer H and W slots, here counted, so a checkpoint made with
    transformers' defaults (head_dim 32: rotary_dim/2 = 4 -> [2, 1, 1]) loads and computes as transformers'."""
    h = len(range(1, min(11 * 3, half_rotary_dim), 3))
    w = len(range(2, min(10 * 3, half_rotary_dim), 3))
    return [half_rotary_dim - h - w, h, w]


# what transformers' Qwen3.5 configs take for a config.json without rope_theta (the named sizes' 1e7 is what
# Qwen's own checkpoints write)
HF_DEFAULT_ROPE_THETA = 10_000.0


def _text_from_hf(d: dict, moe: bool = False) -> TextConfig:
    rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"config.json rope_type {rope_type!r} is not supported; valid: 'default'")
    if d.get("hidden_act", "silu") != "silu":  # the MLPs, the experts and GatedDeltaNet's conv compute SiLU
        raise ValueError(f"config.json hidden_act {d['hidden_act']!r} is not supported; valid: 'silu'")
    names = {f.name for f in dataclasses.fields(TextConfig)}
    kw = {k: v for k, v in d.items() if k in names}
    kw["rope_theta"] = rope.get("rope_theta", d.get("rope_theta", HF_DEFAULT_ROPE_THETA))
    kw["partial_rotary_factor"] = rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.25))
    if "mrope_section" in rope:
        kw["mrope_section"] = list(rope["mrope_section"])
    else:
        head_dim = kw.get("head_dim", TextConfig.head_dim)
        kw["mrope_section"] = transformers_default_mrope_section(int(head_dim * kw["partial_rotary_factor"]) // 2)
    if d.get("layer_types") is None and "num_hidden_layers" in d:
        every = d.get("full_attention_interval", 4)
        kw["layer_types"] = [
            FULL_ATTENTION if (i + 1) % every == 0 else LINEAR_ATTENTION for i in range(d["num_hidden_layers"])
        ]
    if moe:
        kw.setdefault("num_experts", 256)  # Qwen3_5MoeTextConfig's default; the others are TextConfig's
    else:
        kw["num_experts"] = 0
    return TextConfig(**kw)


TEXT_MODEL_TYPES = {"qwen3_5_text": False, "qwen3_5_moe_text": True}  # -> is MoE
VLM_MODEL_TYPES = {"qwen3_5": False, "qwen3_5_moe": True}


def check_checkpoint_dir(path: Path) -> None:
    """FileNotFoundError naming `path` unless it is a directory."""
    if not path.is_dir():
        what = "is a file, not a directory" if path.exists() else "does not exist"
        raise FileNotFoundError(f"checkpoint directory {str(path)!r} {what}")


def config_from_hf_dir(path) -> ModelConfig:
    """Read `config.json` of a transformers Qwen3.5 or Qwen3.5-MoE checkpoint (text-only or VLM)."""
    path = Path(path)
    check_checkpoint_dir(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"no config.json in checkpoint directory {str(path)!r}")
    d = json.loads(cfg_file.read_text())
    model_type = d.get("model_type")
    if model_type in TEXT_MODEL_TYPES:
        return ModelConfig(text=_text_from_hf(d, TEXT_MODEL_TYPES[model_type]),
                           tie_word_embeddings=bool(d.get("tie_word_embeddings", False)))
    if model_type in VLM_MODEL_TYPES:
        tok = {k: d[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
               if k in d}
        tie = d.get("tie_word_embeddings", False)  # the top level's alone, as transformers reads it
        return ModelConfig(text=_text_from_hf(d.get("text_config") or {}, VLM_MODEL_TYPES[model_type]),
                           vision=d.get("vision_config"), tie_word_embeddings=bool(tie), **tok)
    raise ValueError(
        f"config.json in {str(path)!r} has model_type {model_type!r}; valid: "
        f"{sorted(TEXT_MODEL_TYPES) + sorted(VLM_MODEL_TYPES)}"
    )


MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
              "router_aux_loss_coef")


def _hf_text_kwargs(t: TextConfig, tie: bool) -> dict:
    kw = {f.name: getattr(t, f.name) for f in dataclasses.fields(TextConfig)}
    # mtp_num_hidden_layers: written by the export that writes the head's tensors (to_hf_config's text_extra)
    for k in ("rope_theta", "partial_rotary_factor", "mrope_section", "mtp_num_hidden_layers"):
        kw.pop(k)
    # each transformers class takes only its own fields: the MoE config has no intermediate_size
    for k in (("intermediate_size",) if t.is_moe else MOE_FIELDS):
        kw.pop(k)
    kw["layer_types"] = list(t.layer_types)
    kw["rope_parameters"] = {
        "rope_type": "default", "rope_theta": t.rope_theta, "partial_rotary_factor": t.partial_rotary_factor,
        "mrope_section": list(t.mrope_section), "mrope_interleaved": True,
    }
    kw["tie_word_embeddings"] = tie
    return kw


def to_hf_config(cfg: ModelConfig, text_extra: dict | None = None):
    """A transformers config: `Qwen3_5TextConfig` (text-only) or `Qwen3_5Config` (when `cfg.vision` is set),
    or their `Qwen3_5Moe*` counterparts when `cfg.text.num_experts > 0`. `text_extra`: keys the text config
    carries as given (transformers keeps unknown keys), e.g. a source checkpoint's `mtp_num_hidden_layers`."""
    if cfg.text.is_moe:
        from transformers.models.qwen3_5_moe import Qwen3_5MoeConfig as VLMConfig
        from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig as TextConfigHF
        arch = "Qwen3_5Moe"
    else:
        from transformers.models.qwen3_5 import Qwen3_5Config as VLMConfig
        from transformers.models.qwen3_5 import Qwen3_5TextConfig as TextConfigHF
        arch = "Qwen3_5"

    text = {**_hf_text_kwargs(cfg.text, cfg.tie_word_embeddings), **(text_extra or {})}
    if cfg.vision is None:
        hf = TextConfigHF(**text)
        hf.architectures = [f"{arch}ForCausalLM"]
        return hf
    hf = VLMConfig(
        text_config=text, vision_config=dict(cfg.vision), image_token_id=cfg.image_token_id,
        video_token_id=cfg.video_token_id, vision_start_token_id=cfg.vision_start_token_id,
        vision_end_token_id=cfg.vision_end_token_id, tie_word_embeddings=cfg.tie_word_embeddings,
    )
    hf.architectures = [f"{arch}ForConditionalGeneration"]
    return hf
