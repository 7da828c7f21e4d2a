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
    from qwenft.train.data_setup import build_data

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


def call_alone(fn, *args):
    """`fn(*args)` in this process, as train_alone runs a lone rank (a scripts/bench.py mode's `main` that trains
    in-process, or code that makes its own process group); its result."""
    with _alone():
        return fn(*args)


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


def train_job(overrides, prepare=None):
    """`qwenft train` with these overrides in this (rank's) process, through the runner's loop (runner.train, what
    runner.run calls), keeping what run() does not return: (job, RunResult); the job's model parts hold the
    trained parameters as each rank has them. prepare(job), if given, runs before the first step."""
    from qwenft.launch import signals
    from qwenft.train.build import build_job
    from qwenft.train.runner import train

    with signals.StopOnSignal() as stop:
        job = build_job(compose(overrides))
        if prepare is not None:
            prepare(job)
        return job, train(job, stop)


def train_recording_grads(overrides):
    """Train in this (rank's) process; (job, losses, [{trained name: full gradient} per step], {trained name: full
    value after training}). The gradients are read before the optimizer clears them: clipped with torch's AdamW,
    as computed with `LowPrecisionAdamW` (which takes the clip coefficient into its step)."""
    def full(t):
        return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()

    def trained(job):
        return [(n, p) for m in job.model_parts for n, p in m.named_parameters() if p.requires_grad]

    grads = []

    def record_grads(job):
        named, zero_grad = trained(job), job.optimizer.zero_grad

        def capture(set_to_none=True):
            grads.append({n: full(p.grad) for n, p in named})
            zero_grad(set_to_none=set_to_none)

        job.optimizer.zero_grad = capture

    job, result = train_job(overrides, prepare=record_grads)
    return job, result.losses, grads, {n: full(p) for n, p in trained(job)}


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


# ------------------------------------------------------------------ fp32 parity bounds

# fp32 end to end on CUDA, where model.dtype=auto computes in bf16 and the auto kernels (fla's GDN, the fused
# cross-entropy) run below fp32 precision; lr 2e-4 as tests/test_compile.py (AdamW turns fp32 rounding noise in
# GDN's ill-conditioned decay gradients into parameter differences that grow with the learning rate), and
# AdamW's eps at 1e-6 (the reason tests/test_expert_parallel.py gives for its MoE parity runs' 1e-5: with 1e-8 an
# update is ~lr x sign(m) even where a gradient sits at rounding level, so CUDA's and the CPU's last digits could
# move a parameter by lr).
CUDA_FP32 = ("model.dtype=float32", "model.kernels.gdn=torch", "model.kernels.ce=torch",
             "model.kernels.attention=sdpa", "optim.lr=2e-4", "optim.eps=1e-6")


EPS32 = torch.finfo(torch.float32).eps  # 1.19e-7
# AdamW's gain on a rounding gap, per step and unit of lr (see fp32_rtol); the tiny model's, from its worst case: tied
# LoRA at lr 5e-3, whose step-3 gradients sit 5.6x the step-1 scale from one process's (1 + 500 x 5e-3 x 2 = 6)
ADAMW_GAIN = 500.0
# a single tensor against the whole vector: one whose gradient sums with heavy cancellation (GDN's a_proj, A_log,
# dt_bias) carries more of the vector's absolute rounding noise for its own small norm (seen: 2.6x the scale)
PER_TENSOR = 10.0


def fp32_rtol(adamw_steps: int = 0, lr: float = 5e-4, terms: int = 512, margin: float = 4.0,
              per_tensor: bool = False) -> float:
    """The relative gap allowed between two fp32 runs that differ only in the order their sums are taken (mesh,
    microbatching, kernels, thread count, host), for a quantity computed after `adamw_steps` optimizer steps:

        margin * eps32 * sqrt(terms) * (1 + ADAMW_GAIN * lr * adamw_steps)  [* PER_TENSOR for one tensor]

    - eps32 * sqrt(terms): summed in another order, a sum's rounding errors add as a random walk over its terms;
      `terms` is the longest such sum, 512 in the tiny model's runs: the vocab's logsumexp, and a parity step's
      tokens, over which every weight's gradient sums (step 1 sat at 0.5x this scale at most).
    - 1 + ADAMW_GAIN * lr * adamw_steps: AdamW moves every element by about lr whatever its gradient's size, so an
      element whose gradient sits at rounding level moves by +-lr in either run; each step turns the rounding gap
      into a parameter gap of order lr, which the next step's loss and gradients see. This is why one fixed bound
      cannot hold on every host after a few steps at a large lr.
    - margin 4: the worst gap seen, across meshes, hosts and 1 or 2 threads a rank (QWENFT_TEST_THREADS), sits at a
      quarter of the bound or less.

    What it still catches: a missing or doubled reduction, a wrong shard or a rank's batch counted twice moves
    losses and gradients by 1e-2..1 relative; one token of a 512-token step dropped, by ~1e-3; a tensor left
    untrained for 3 steps at lr 5e-4 sits 3 lr over its rms value off, 1.5e-3 for a norm weight of 1. The parity
    runs' bounds (lr 5e-4): 1.1e-5 at step 1, 1.9e-5 after 3 steps, 10x that for one tensor.
    """
    tol = margin * EPS32 * terms**0.5 * (1 + ADAMW_GAIN * lr * adamw_steps)
    return tol * PER_TENSOR if per_tensor else tol


def assert_within(what: str, err: float, tol: float) -> None:
    """Assert err < tol for one parity comparison. With QWENFT_TEST_TOLERANCE_LOG=path, first append the test, what,
    err and tol to path as a JSON line: one run of the parity tests on a new host then shows every margin."""
    log = os.environ.get("QWENFT_TEST_TOLERANCE_LOG")
    if log:
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
        with open(log, "a") as f:
            f.write(json.dumps({"test": test, "what": what, "err": err, "tol": tol}) + "\n")
    assert err < tol, f"{what}: rel err {err:.2e}, bound {tol:.2e}"


def _rel(a, b) -> float:
    return ((a - b).norm() / b.norm().clamp(min=1e-12)).item()


def assert_same_tensors(got: dict, ref: dict, tol: float, what: str, each: float | None = None) -> None:
    """Two {name: tensor} of the same names: all of them as one vector within tol (norm of the difference over the
    reference's norm), each one within `each` (default PER_TENSOR x tol)."""
    assert got.keys() == ref.keys() and ref
    diff = torch.stack([(got[n].double() - r.double()).norm() for n, r in ref.items()]).norm()
    total = torch.stack([r.double().norm() for r in ref.values()]).norm()
    assert_within(what, (diff / total).item(), tol)
    each = PER_TENSOR * tol if each is None else each
    for name, r in ref.items():
        assert_within(f"{what}: {name}", _rel(got[name].double(), r.double()), each)


def assert_same_grads(result, reference, lr=5e-4):
    """The last step's gradients of two train_with_grads results: the same parameters, all of them together and
    each one within fp32_rtol for the AdamW steps before it (norm of the difference over the reference's norm)."""
    tol = fp32_rtol(len(reference.losses) - 1, lr)
    assert_same_tensors(result.grads, reference.grads, tol, "last step's gradients")


def assert_same_training(result, reference, steps=3, lr=5e-4, margin=4.0, rtol=None):
    """Two RunResults with state: both ran `steps` steps and the reference's loss moved (a vacuous comparison
    is caught); every step's loss, every validation loss of the reference and every parameter within fp32_rtol of
    the reference's, for the AdamW steps before each (at the parity runs' lr unless given). rtol: one fixed bound
    for all of them instead, for the GPU tier, whose CUDA kernels sum in orders fp32_rtol was not measured on."""
    def bound(adamw_steps):
        return fp32_rtol(adamw_steps, lr, margin=margin) if rtol is None else rtol

    losses, ref_losses = result.losses, reference.losses
    assert len(losses) == len(ref_losses) == steps and ref_losses[0] != ref_losses[-1], (losses, ref_losses)
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        assert_within(f"step {step + 1}'s loss", abs(a - b) / abs(b), bound(step))
    for step, v in reference.val_losses.items():
        got = result.val_losses[step]
        assert_within(f"val_loss at step {step}", abs(got - v) / abs(v), bound(step))
    assert_same_tensors(result.state_dict, reference.state_dict, bound(steps), f"parameters after {steps} steps",
                        each=rtol)


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


def assert_near_reference(got, ref, exact, name: str) -> None:
    """`got`, the native model's fp32 result (logits or a gradient), against `ref`, transformers' in fp32, within a
    bound scaled by the fp32 noise the test measures: 1e-5 plus 8x the lesser of `got`'s and `ref`'s distances
    from `exact`, the native model's result in fp64, that noise counted up to 1e-4.

    Both models round differently in fp32, each about as far from the fp64 answer as the other (transformers keeps
    its norms and delta rule in fp32 even as an fp64 model, so fp64 cannot tighten this comparison): 1e-7 to 3e-6
    on the tiny models' logits, up to 3e-4 on their gradients, the most on GatedDeltaNet's decay (A_log, dt_bias,
    in_proj_a), whose gradients sum every token's terms with heavy cancellation; how far depends on the CPU's
    kernels. Their difference is at most the sum of the two distances, so 8x allows the larger to be 7x the lesser
    (the worst seen is under a quarter of the bound). The lesser of the two keeps a fault out of its own bound: a
    wrong term in the native model moves `got` and `exact` away from `ref` alike, one in its fp32 path alone moves
    `got` away from both. Where both fp32 results share their rounding (the VLM's tower is the same code in both)
    they can stray from `exact` together while agreeing with each other, so the noise counts up to 1e-4: no fault
    over 8.1e-4 passes. An fp64 result far from both fp32 ones (over 2e-3, ten times the most seen) is a fault of
    its own. With QWENFT_TEST_TOLERANCE_LOG set, both comparisons are logged as `assert_within`'s."""
    err = rel_err(got, ref)
    noise = min(rel_err(got, exact), rel_err(ref, exact))
    assert_within(f"{name}: the fp64 result's distance from the fp32 ones", noise, 2e-3)
    assert_within(f"{name}: native against transformers", err, 1e-5 + 8 * min(noise, 1e-4))


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
