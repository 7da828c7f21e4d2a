"""The settings that do nothing in a run, which its start names (`build_job`)."""

from qwenft.conf.schema import Config, LoggerOptions, MeshOptions, ModelOptions, PipelineOptions
from qwenft.train.spec import RunSpec


def moot_settings(cfg: Config, max_steps: int, spec: RunSpec, has_vision: bool) -> list[str]:
    """Settings that do nothing in this run of `spec` (the run's start warns of each): a key whose switch is off or
    whose layout or model is not there, a schedule too short for its own shape. Not errors: a recipe's defaults may
    meet an override that makes them moot."""
    notes = []
    layout = spec.layout
    sched = cfg.lr_scheduler
    if sched.min_lr_ratio and sched.decay == "constant":
        notes.append(f"lr_scheduler.min_lr_ratio={sched.min_lr_ratio} has no effect with lr_scheduler.decay=constant")
    if sched.warmup_steps >= max_steps:
        notes.append(f"lr_scheduler.warmup_steps={sched.warmup_steps} is not below the run's {max_steps} steps: the "
                     f"whole run warms up (the lr reaches optim.lr={cfg.optim.lr} at step {sched.warmup_steps}) and no "
                     f"decay follows")
    if not cfg.logger.wandb:
        for key in ("wandb_project", "wandb_mode"):
            if getattr(cfg.logger, key) != getattr(LoggerOptions(), key):
                notes.append(f"logger.{key}={getattr(cfg.logger, key)} has no effect without logger.wandb=true "
                             f"(logger=wandb)")
    if cfg.model.vision_activation_checkpointing and cfg.peft.method != "none" and not cfg.peft.vision:
        notes.append("model.vision_activation_checkpointing=true has no effect with peft=lora and peft.vision=false "
                     "(the frozen tower keeps nothing for the backward)")
    for key, size in (("vocab_parallel", "tp"), ("cp_balanced_attention", "cp")):
        if getattr(layout, size) == 1 and getattr(cfg.mesh, key) != getattr(MeshOptions(), key):
            notes.append(f"mesh.{key}={str(getattr(cfg.mesh, key)).lower()} has no effect with mesh.{size}=1")
    if not has_vision:
        moot = [f"model.{key}={str(getattr(cfg.model, key)).lower()}" for key in
                ("freeze_vision", "freeze_projector", "vision_activation_checkpointing")
                if getattr(cfg.model, key) != getattr(ModelOptions(), key)]
        if moot:
            notes.append(f"{', '.join(moot)} {'have' if len(moot) > 1 else 'has'} no effect on a text model (no "
                         f"vision tower)")
    if layout.pp == 1:
        moot = [f"pipeline.{key}={getattr(cfg.pipeline, key)}" for key in
                ("schedule", "virtual_stages", "layers_per_stage", "stage_layers")
                if getattr(cfg.pipeline, key) != getattr(PipelineOptions(), key)]
        if moot:
            notes.append(f"{', '.join(moot)} {'have' if len(moot) > 1 else 'has'} no effect with mesh.pp=1 (no "
                         f"pipeline)")
    if cfg.model.mtp == "keep" and cfg.model.mtp_loss_weight != ModelOptions().mtp_loss_weight:
        notes.append(f"model.mtp_loss_weight={cfg.model.mtp_loss_weight} has no effect with model.mtp=keep (no MTP "
                     f"head trains); set model.mtp=train")
    return notes
