"""Runner features a user relies on: pretrained start, wandb offline, repo-root launch, packaged recipes."""

import os
import subprocess
import sys
import zipfile

import pytest
import torch

from distributed import run_distributed
from helpers import REPO, save_random_checkpoint, tiny_overrides, train, train_job, train_with_state
from qwenft.conf import list_recipes


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny random Qwen3.5 saved in HF layout with the tiny tokenizer beside it."""
    from qwenft.models.qwen3_5.configs import named_config

    return save_random_checkpoint(named_config("tiny"), tmp_path_factory.mktemp("ckpt"), seed=7, tokenizer="tiny")


@pytest.mark.distributed
@pytest.mark.slow
def test_pretrained_start_matches_transformers(tmp_path, checkpoint):
    """model.path takes config, weights and tokenizer from the dir: step 1's loss equals transformers'
    loss on the same batch with the same checkpoint."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qwenft.data.loader import build_sft_data
    from qwenft.data.tiny_chat import TRAIN_PATH
    from qwenft.models.loss import token_ce_sum

    (result,) = run_distributed(train, 1, [
        f"model.path={checkpoint}", "train.max_steps=1", "train.global_batch_size=2", "train.micro_batch_size=2",
        "data.packing=pad", "data.seq_len=64", "model.kernels.gdn=torch", "train.progress_bar=false",
        f"run_dir={tmp_path / 'run'}"])
    loss = result.losses[0]

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    batch = next(iter(build_sft_data(TRAIN_PATH, tokenizer, seq_len=64, micro_batch_size=2, packing="pad")))
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    with torch.no_grad():  # one document per row, right-padded: the padding can't reach earlier tokens
        logits = hf(input_ids=batch["input_ids"]).logits
    reference = token_ce_sum(logits, batch["labels"]) / (batch["labels"] != -100).sum()
    assert abs(loss - reference.item()) < 1e-5 * reference.item(), (loss, reference.item())


@pytest.mark.distributed
def test_num_layers_keeps_the_first_layers_of_a_checkpoint(tmp_path, checkpoint):
    """model.num_layers=2 with model.path trains the checkpoint's first 2 layers: step-1 loss equals
    transformers' model truncated to those layers on the same batch."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from qwenft.data.loader import build_sft_data
    from qwenft.data.tiny_chat import TRAIN_PATH

    (result,) = run_distributed(train, 1, [
        f"model.path={checkpoint}", "model.num_layers=2", "train.max_steps=1", "train.global_batch_size=2",
        "train.micro_batch_size=2", "data.packing=pad", "data.seq_len=64", "model.kernels.gdn=torch",
        "train.progress_bar=false", f"run_dir={tmp_path / 'run'}"])
    loss = result.losses[0]
    config = AutoConfig.from_pretrained(checkpoint)
    config.num_hidden_layers, config.layer_types = 2, config.layer_types[:2]
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, config=config, dtype=torch.float32)
    batch = next(iter(build_sft_data(TRAIN_PATH, AutoTokenizer.from_pretrained(checkpoint), seq_len=64,
                                     micro_batch_size=2, packing="pad")))
    with torch.no_grad():
        logits = hf(input_ids=batch["input_ids"], use_cache=False).logits  # 2 GDN layers: no attention cache
    mask = batch["labels"] != -100
    reference = torch.nn.functional.cross_entropy(logits[mask], batch["labels"][mask])
    assert abs(loss - reference.item()) < 1e-5 * reference.item(), (loss, reference.item())


@pytest.mark.distributed
@pytest.mark.slow
def test_epochs_set_the_number_of_steps(tmp_path):
    # the tiny set packs into 54 rows of 256 tokens: half an epoch of 8-row steps is ceil(27 / 8) = 4 steps
    (result,) = run_distributed(train, 1, ["train.max_steps=null", "train.epochs=0.5", "train.progress_bar=false",
                                           f"run_dir={tmp_path / 'run'}"])
    assert len(result.losses) == 4


@pytest.mark.distributed
def test_model_path_without_tokenizer_fails_naming_the_key(tmp_path, checkpoint):
    weights_only = tmp_path / "weights"
    weights_only.mkdir()
    for f in checkpoint.iterdir():
        if f.name.startswith("model") or f.name == "config.json":
            (weights_only / f.name).symlink_to(f)
    with pytest.raises(RuntimeError, match="has no tokenizer files .* set data.tokenizer"):
        run_distributed(train, 1, [f"model.path={weights_only}", "train.max_steps=1", f"run_dir={tmp_path / 'run'}"])


@pytest.mark.distributed
def test_wandb_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    common = ["logger=wandb", "data.seq_len=64", "train.progress_bar=false", "checkpoint.every_steps=2",
              "checkpoint.export_hf=false", f"run_dir={run_dir}"]
    run_distributed(train, 1, common + ["train.max_steps=2"])
    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb")), list((run_dir / "wandb").iterdir())
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    assert runs[0].name.endswith(f"-{run_id}")
    run_distributed(train, 1, common + ["train.max_steps=3"])  # resumed: logs on into the same W&B run
    assert {r.name.rsplit("-", 1)[1] for r in (run_dir / "wandb").glob("offline-run-*")} == {run_id}


def _train_without_wandb(rank, world_size, overrides):
    """helpers.train in a forked rank where wandb does not import."""
    import importlib.util

    find_spec = importlib.util.find_spec
    importlib.util.find_spec = lambda name, *a: None if name == "wandb" else find_spec(name, *a)
    return train(rank, world_size, overrides)


@pytest.mark.distributed
def test_wandb_missing_fails_at_start_naming_the_key(tmp_path):
    """wandb is an optional extra: logger.wandb=true without it stops before config.yaml is written."""
    run_dir = tmp_path / "run"
    with pytest.raises(RuntimeError, match=r"ValueError: logger.wandb=true but wandb is not installed; "
                                           r"pip install 'qwenft\[wandb\]' or set logger.wandb=false"):
        run_distributed(_train_without_wandb, 1, ["logger=wandb", "train.max_steps=1", f"run_dir={run_dir}"])
    assert not (run_dir / "config.yaml").exists()


def test_repo_root_directory_runs_as_script():
    """`torchrun qwenft train ...` from the repository root executes the qwenft/ directory as a script."""
    out = subprocess.run([sys.executable, "qwenft", "show", "train.max_steps=5"], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "max_steps: 5" in out.stdout


def test_wheel_ships_every_recipe(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(REPO),
                    "-w", str(tmp_path)], check=True, capture_output=True, timeout=300,
                   env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    (wheel,) = tmp_path.glob("qwenft-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for recipe in list_recipes():
        assert f"qwenft/conf/recipe/{recipe}.yaml" in names, recipe
    assert "qwenft/data/assets/tiny_chat.jsonl" in names


@pytest.mark.distributed
@pytest.mark.slow
def test_train_tiny_vlm_with_frozen_vision_tower(tmp_path):
    """recipe=tiny_vlm end to end through the runner: images reach the model, the loss falls (14 steps: the mean of
    the last 3 measured 0.64 of the first 3's, the bound is 0.8), and a frozen vision tower leaves training
    bit-identical to its initial weights."""
    from qwenft.models.loader import build_model, init_random_weights
    from qwenft.models.qwen3_5.configs import named_config

    (result,) = run_distributed(train_with_state, 1, [
        "recipe=tiny_vlm", "train.max_steps=14", "model.freeze_vision=true", "model.freeze_projector=true",
        "train.progress_bar=false", f"run_dir={tmp_path / 'run'}"])
    losses, state = result.losses, result.state_dict
    assert sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3, losses
    cfg = named_config("tiny_vlm")
    cfg.text.vocab_size = state["embed_tokens.weight"].shape[0]
    init = build_model(cfg, kernels="torch", device="meta")
    init_random_weights(init, seed=0, device="cpu", dtype=torch.float32)
    vision = {n: p for n, p in init.named_parameters() if n.startswith("visual.")}
    assert vision and all(torch.equal(state[n], p.detach()) for n, p in vision.items())
    assert not torch.equal(state["layers.0.mlp.up_proj.weight"], init.layers["0"].mlp.up_proj.weight.detach())
    # the exported VLM loads in transformers with every key (vision tower included)
    from transformers import Qwen3_5ForConditionalGeneration

    hf, info = Qwen3_5ForConditionalGeneration.from_pretrained(tmp_path / "run" / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info


@pytest.mark.distributed
def test_export_from_pp2_run_loads_in_transformers(tmp_path):
    """checkpoint.export_hf from a 2-stage pipeline run: transformers loads <run_dir>/hf (every stage's keys,
    tokenizer included) and gives the logits of the trained parameters the runner returns."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qwenft.models.loader import build_model
    from qwenft.models.qwen3_5.configs import named_config

    run_dir = tmp_path / "run"
    state = run_distributed(train_with_state, 2, [
        "mesh.pp=2", "train.max_steps=2", "data.seq_len=64", "checkpoint.export_dtype=float32",
        "model.kernels.gdn=torch", "train.progress_bar=false", f"run_dir={run_dir}"])[0].state_dict
    hf = AutoModelForCausalLM.from_pretrained(run_dir / "hf", dtype=torch.float32)
    assert AutoTokenizer.from_pretrained(run_dir / "hf").chat_template
    cfg = named_config("tiny")
    cfg.text.vocab_size = state["embed_tokens.weight"].shape[0]
    native = build_model(cfg, kernels="torch", device="cpu")
    native.load_state_dict(state)
    ids = torch.randint(0, cfg.text.vocab_size, (2, 40))
    with torch.no_grad():
        ref, got = native(input_ids=ids), hf(input_ids=ids).logits
    assert ((got - ref).norm() / ref.norm()).item() < 1e-5


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("bar", ["false", "true"])
def test_train_log_has_a_line_every_log_every_steps(tmp_path, bar):
    """train.log gets the step lines whether or not the progress bar shows them on the console."""
    overrides = tiny_overrides(tmp_path, "train.max_steps=5", "train.log_every=2", f"train.progress_bar={bar}",
                               "checkpoint.export_hf=false")
    (result,) = run_distributed(train, 1, overrides)
    lines = [line for line in (tmp_path / "train.log").read_text().splitlines() if " | loss " in line]
    assert [line.split("step ")[1].split(" ")[0] for line in lines] == ["2/5", "4/5", "5/5"], lines
    assert f"loss {result.losses[-1]:.4f}" in lines[-1]


def _step_and_read_order(rank, world_size, overrides):
    """The order of the optimizer's step and the read of the step's numbers over a run's steps."""
    from qwenft.train import runner

    events = []
    queue_read = runner.read_later

    def read_later(tensors):
        wait = queue_read(tensors)
        return lambda: events.append("read") or wait()

    def prepare(job):
        step = job.optimizer.step
        job.optimizer.step = lambda *a, **kw: events.append("step") or step(*a, **kw)

    runner.read_later = read_later
    try:
        train_job(overrides, prepare)
    finally:
        runner.read_later = queue_read
    return events


@pytest.mark.distributed
@pytest.mark.parametrize("state_dtype, order", [("bfloat16", ["step", "read"]), ("float32", ["read", "step"])])
def test_the_optimizer_is_queued_before_the_read_where_the_gpu_can_skip_it(tmp_path, state_dtype, order):
    """LowPrecisionAdamW (bf16 moments) steps before the host reads the step's loss and norms, so its kernels run
    while the host waits and prepares the next step (skipped on the device if a value is not finite); torch's
    AdamW (fp32) steps after the read, as it cannot."""
    events, = run_distributed(_step_and_read_order, 1, tiny_overrides(
        tmp_path / "run", "train.max_steps=2", f"optim.state_dtype={state_dtype}", "checkpoint.every_steps=0",
        "checkpoint.export_hf=false"))
    assert events == order * 2
