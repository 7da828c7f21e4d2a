"""What the test modules share: the tiny training run's overrides, rank functions that train it, the comparison
of two runs, small checkpoints, the run dir's metrics, and `python -m qwenft` as a user types it.

Test modules import from here (and from distributed.py), never from each other. The qwenft internals that the
tests reach into and that are moving (compose; the runner's private builders) are imported here only, so such
a move changes this file and not every test module.
"""

import json
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

from qwenft.conf import ConfigError, compose  # noqa: F401 (tests take them from here)

REPO = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------ the run's builders

def model_config(cfg):
    from qwenft.train.build import model_config

    return model_config(cfg)


def build_data(cfg, model_cfg, microbatch_size: int, dp_rank: int, dp_size: int):
    from qwenft.train.build import build_data

    return build_data(cfg, model_cfg, microbatch_size, dp_rank, dp_size)


# ------------------------------------------------------------------ the tiny training run

def tiny_overrides(run_dir, *extra) -> list[str]:
    """recipe=tiny with 128-token rows, the torch GatedDeltaNet kernel and no progress bar, writing to run_dir.
    `extra` comes last, and the last value of a key wins, so it may change any of these."""
    return ["recipe=tiny", "data.seq_len=128", "model.kernels.gdn=torch", "train.progress_bar=false",
            f"run_dir={run_dir}", *extra]


def parity_overrides(run_dir, *extra) -> list[str]:
    """The run every mesh and option is compared on: 3 steps at lr 5e-4 without warm-up, a global batch of 4 as
    4 microbatches of 1 (`extra` wins, as in tiny_overrides)."""
    return tiny_overrides(run_dir, "train.max_steps=3", "optim.lr=5e-4", "lr_scheduler.warmup_steps=0",
                          "train.global_batch_size=4", "train.micro_batch_size=1", *extra)


def train(rank, world_size, overrides):
    """A run_distributed fn: this rank of `qwenft train` with these overrides, in the forked process; its
    RunResult (losses, val_losses, skipped_steps, preempted)."""
    from qwenft.train.runner import run

    return run(compose(overrides))


def train_with_state(rank, world_size, overrides):
    """As train, with the trained parameters, gathered whole on every rank, in result.state_dict."""
    from qwenft.train.runner import run

    return run(compose(overrides), return_state=True)


# what qwenft.distributed.mesh.init_process_group sets for a lone process (a free port of its own)
_RENDEZVOUS_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def train_alone(overrides, return_state=False):
    """`qwenft train` with these overrides in this process, as a lone rank (no torchrun); its RunResult. The
    process group the run made is destroyed after it and the rendezvous variables put back, so a later run
    makes its own group on a fresh port. The GPU tier trains this way: a process forked after its parent
    initialised CUDA (run_distributed's ranks) cannot use CUDA."""
    from qwenft.train.runner import run

    with _alone():
        return run(compose(overrides), return_state=return_state)


def qwenft_alone(*args) -> int:
    """`qwenft ARGS` (qwenft.cli.main) in this process, as train_alone runs a lone rank; its exit code. What it
    prints goes to this process's stderr (capfd reads it)."""
    from qwenft.cli import main

    with _alone():
        return main(list(args))


@contextmanager
def _alone():
    """A process group made inside is destroyed after it and the rendezvous variables put back."""
    import torch.distributed as dist

    from qwenft.distributed.fake_pg import forget_meshes

    saved = {key: os.environ.get(key) for key in _RENDEZVOUS_ENV}
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        forget_meshes()  # no DTensor cache entry may point at the destroyed group
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def train_recording_grads(overrides):
    """Train in this (rank's) process; (job, losses, [{trained name: full gradient} per step], {trained name: full
    value after training}). The gradients are read before the optimizer clears them."""
    from qwenft.launch import signals
    from qwenft.train.build import build_job
    from qwenft.train.runner import train

    def full(t):
        return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()

    with signals.StopOnSignal() as stop:
        job = build_job(compose(overrides))
        named = [(n, p) for m in job.model_parts for n, p in m.named_parameters() if p.requires_grad]
        grads, zero_grad = [], job.optimizer.zero_grad

        def capture(set_to_none=True):
            grads.append({n: full(p.grad) for n, p in named})
            zero_grad(set_to_none=set_to_none)

        job.optimizer.zero_grad = capture
        result = train(job, stop)
        return job, result.losses, grads, {n: full(p) for n, p in named}


def train_with_grads(rank, world_size, overrides):
    """train_recording_grads as a run_distributed fn: a RunResult-like record of its losses, the trained parameters
    (state_dict) and the last step's gradients (grads), of every pipeline stage, on every rank."""
    import types

    import torch.distributed as dist

    job, losses, grads, values = train_recording_grads(overrides)
    state, last = {k: v.float().cpu() for k, v in values.items()}, {k: v.float().cpu() for k, v in grads[-1].items()}
    if job.spec.layout.pp > 1:
        parts = [None] * dist.get_world_size(job.pp_group)
        dist.all_gather_object(parts, (state, last), group=job.pp_group)
        state = {k: v for part, _ in parts for k, v in part.items()}
        last = {k: v for _, part in parts for k, v in part.items()}
    return types.SimpleNamespace(losses=losses, state_dict=state, grads=last, val_losses={})


def assert_same_grads(result, reference, rtol=1e-5, rtol_by_suffix=None):
    """The last step's gradients of two train_with_grads results: the same parameters, all of them together and
    each one within rtol (norm of the difference over the reference's norm); rtol_by_suffix as in
    assert_same_training."""
    assert result.grads.keys() == reference.grads.keys() and reference.grads
    diff = torch.stack([(result.grads[n] - g).norm() for n, g in reference.grads.items()]).norm()
    total = torch.stack([g.norm() for g in reference.grads.values()]).norm()
    assert (diff / total).item() < rtol, f"all gradients: rel err {(diff / total).item():.2e}"
    for name, ref in reference.grads.items():
        tol = next((t for suffix, t in (rtol_by_suffix or {}).items() if name.endswith(suffix)), rtol)
        err = ((result.grads[name] - ref).norm() / ref.norm().clamp(min=1e-12)).item()
        assert err < tol, f"{name}: gradient rel err {err:.2e}"


def assert_same_training(result, reference, rtol=1e-5, steps=3, rtol_by_suffix=None):
    """Two RunResults with state: both ran `steps` steps and the reference's loss moved (a vacuous comparison
    is caught); every step's loss, every validation loss of the reference and every parameter (norm of the
    difference over the reference's norm) within rtol of the reference's. rtol_by_suffix: {name suffix: rtol}
    for parameters that may sit further off."""
    losses, ref_losses = result.losses, reference.losses
    assert len(losses) == len(ref_losses) == steps and ref_losses[0] != ref_losses[-1], (losses, ref_losses)
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= rtol * abs(b), f"step {step + 1}: loss {a} vs reference {b}"
    for step, v in reference.val_losses.items():
        got = result.val_losses[step]
        assert abs(got - v) <= rtol * abs(v), f"val_loss at step {step}: {got} vs reference {v}"
    state, ref_state = result.state_dict, reference.state_dict
    assert state.keys() == ref_state.keys()
    for name, ref in ref_state.items():
        tol = next((t for suffix, t in (rtol_by_suffix or {}).items() if name.endswith(suffix)), rtol)
        err = ((state[name] - ref).norm() / ref.norm().clamp(min=1e-12)).item()
        assert err < tol, f"{name}: rel err {err:.2e}"


def raised_line(info) -> str:
    """The `ValueError: ...` line a rank raised (run_distributed wraps it with the rank's traceback)."""
    return next(line for line in str(info.value).splitlines() if line.startswith("ValueError: "))


# ------------------------------------------------------------------ the run dir

def read_metrics(run_dir) -> list[dict]:
    """metrics.jsonl's rows ([] before the run has written one)."""
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def logged_losses(run_dir) -> dict[int, float]:
    """step -> loss from metrics.jsonl; a step logged twice (before a stop and after the resume) keeps the later
    line."""
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


# ------------------------------------------------------------------ small models and checkpoints

def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _perturbed(cls, cfg, seed):
    """transformers' `cls` for `cfg` in fp32 with every weight perturbed (its init leaves norms at 0/1, which
    hides bugs)."""
    from qwenft.models.qwen3_5.configs import to_hf_config

    torch.manual_seed(seed)
    hf = cls(to_hf_config(cfg)).float()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return hf


def make_hf_model(cfg, seed=0):
    """A transformers Qwen3_5ForCausalLM with every weight perturbed."""
    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM

    return _perturbed(Qwen3_5ForCausalLM, cfg, seed)


def make_hf_moe_model(cfg, seed=0):
    """A transformers Qwen3.5-MoE model with every weight perturbed: `Qwen3_5MoeForCausalLM`, or
    `Qwen3_5MoeForConditionalGeneration` when `cfg.vision` is set. Its experts run transformers' eager loop (its
    default is its own torch._grouped_mm path), the plain reference."""
    from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeForConditionalGeneration

    hf = _perturbed(Qwen3_5MoeForCausalLM if cfg.vision is None else Qwen3_5MoeForConditionalGeneration, cfg, seed)
    hf.set_experts_implementation("eager")
    return hf


def save_random_checkpoint(cfg, path, seed=0, perturb_norms=False, tokenizer=None):
    """The native model, randomly initialised (fp32), saved in Hugging Face layout at path. perturb_norms: add
    seeded noise (0.1) to the norm weights, which zero / one init would leave blind to a sharded-norm mistake;
    tokenizer: a built-in tokenizer name to save beside the weights."""
    from qwenft.data.tokenizer import load_tokenizer
    from qwenft.checkpoint.hf_export import save_hf
    from qwenft.models.loader import build_model, init_random_weights

    model = build_model(cfg, kernels="torch", device="meta")
    init_random_weights(model, seed=seed, device="cpu", dtype=torch.float32)
    if perturb_norms:
        with torch.no_grad():
            gen = torch.Generator().manual_seed(3)
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.add_(0.1 * torch.randn(p.shape, generator=gen))
    save_hf(model, cfg, path)
    if tokenizer is not None:
        load_tokenizer(tokenizer).save_pretrained(path)
    return path


# The tiny VLM's special token ids and its image patches as the model takes them
IMAGE, VIDEO, START, END = 500, 501, 502, 503
MERGE = 2
PATCH_DIM = 3 * 2 * 16 * 16  # channels x temporal_patch_size x patch_size^2


def tiny_vlm():
    """The tiny text model with a small vision tower (qwenft.models.qwen3_5.vision.tiny_vision_config)."""
    from qwenft.models.qwen3_5.configs import ModelConfig, named_config
    from qwenft.models.qwen3_5.vision import tiny_vision_config

    text = named_config("tiny").text
    return ModelConfig(text=text, vision=tiny_vision_config(text.hidden_size), image_token_id=IMAGE,
                       video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)


def vlm_row(parts, length=None):
    """A row of ids: an int n = n text tokens, a (t, h, w) grid = one image's placeholders; right-padded."""
    ids = []
    for p in parts:
        if isinstance(p, int):
            for _ in range(p):
                ids.append((7 * len(ids) + 11) % 400 + 1)
        else:
            ids += [START] + [IMAGE] * (p[0] * p[1] * p[2] // MERGE**2) + [END]
    length = len(ids) if length is None else length
    assert len(ids) <= length
    return ids + [0] * (length - len(ids))


# ------------------------------------------------------------------ the CLI in a fresh interpreter

def run_qwenft(*args, env=None, cwd=REPO, timeout=600) -> subprocess.CompletedProcess:
    """`python -m qwenft ARGS` as a user types it; env is added to this process's environment."""
    return subprocess.run([sys.executable, "-m", "qwenft", *args], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=timeout)
