"""A run's LoRA settings (peft.*): the adapters' config, what a checkpoint records of them and of the frozen base
they fit, and the adapters' config read back from a checkpoint."""

from pathlib import Path

from qwenft.conf.schema import Config


def lora_config(cfg: Config):
    """peft.* as a `qwenft.models.lora.LoRAConfig`, or None for full finetuning (peft=none)."""
    if cfg.peft.method == "none":
        return None
    from qwenft.models.lora import LoRAConfig

    targets = cfg.peft.target_modules
    return LoRAConfig(rank=cfg.peft.rank, alpha=cfg.peft.alpha, dropout=cfg.peft.dropout,
                      target_modules=(targets,) if isinstance(targets, str) else tuple(targets),
                      vision=cfg.peft.vision, train_embeddings=cfg.peft.train_embeddings, train_head=cfg.peft.train_head)


def peft_meta(cfg: Config) -> dict | None:
    """What a checkpoint records of peft.* (None: full finetuning): the keys that decide what is trained, alpha
    (the adapters' scale, which their values were trained at) and the frozen base they fit (`base_fingerprint`)."""
    if cfg.peft.method == "none":
        return None
    targets = cfg.peft.target_modules
    return {"method": cfg.peft.method, "rank": cfg.peft.rank, "alpha": float(cfg.peft.alpha),
            "target_modules": [targets] if isinstance(targets, str) else list(targets), "vision": cfg.peft.vision,
            "train_embeddings": cfg.peft.train_embeddings, "train_head": cfg.peft.train_head,
            "base": base_fingerprint(cfg)}


def base_fingerprint(cfg: Config) -> dict:
    """The frozen base of a LoRA run: its weights' `models.loader.weights_fingerprint` (the same wherever the
    checkpoint dir is and however it is sharded), or the seed of a random-init base."""
    from qwenft.models.loader import weights_fingerprint

    if not cfg.model.path:
        return {"random_init_seed": cfg.seed}
    return weights_fingerprint(Path(cfg.model.path))


def checkpoint_lora(saved: dict, cfg: Config):
    """The LoRA a checkpoint's adapters were trained with: its recorded peft.* (alpha: config.yaml's for a
    checkpoint saved before alpha was recorded; dropout, which the adapters' values do not depend on, too)."""
    from qwenft.models.lora import LoRAConfig

    return LoRAConfig(rank=saved["rank"], alpha=saved.get("alpha", cfg.peft.alpha), dropout=cfg.peft.dropout,
                      target_modules=tuple(saved["target_modules"]), vision=saved["vision"],
                      train_embeddings=saved["train_embeddings"], train_head=saved["train_head"])
