"""The CLI as a user types it: composition, overrides, errors, and real training runs."""

import dataclasses
import os
import re
import subprocess
import sys

import pytest
import torch

from helpers import REPO, compose, read_metrics, run_qwenft
from qwenft.cli import main
from qwenft.conf import list_recipes
from qwenft.conf.schema import CHOICES


def test_show_resolves_recipe_and_overrides():
    cfg = compose(["recipe=tiny", "train.max_steps=7", "mesh.dp=2", "optim.lr=0.5", "lr_scheduler=linear"])
    assert cfg.train.max_steps == 7 and cfg.mesh.dp == 2 and cfg.optim.lr == 0.5
    assert cfg.lr_scheduler.decay == "linear"
    assert cfg.data.seq_len == 256  # from recipes/tiny.yaml, over data/tiny_chat.yaml's value
    out = run_qwenft("show", "train.max_steps=7", "model.kernels.gdn=torch")
    assert out.returncode == 0, out.stderr
    assert "max_steps: 7" in out.stdout and "gdn: torch" in out.stdout


def test_docs_list_every_choice():
    """docs/cli.md's key table names every valid value of every key that takes a fixed set of them."""
    rows = [line for line in (REPO / "docs" / "cli.md").read_text().splitlines() if line.startswith("| `")]
    for key, valid in CHOICES.items():
        section, leaf = key.rsplit(".", 1)
        row = next((r for r in rows if f"`{key}`" in r.split("|")[1]
                    or f"`{section}." in r.split("|")[1] and f"`{leaf}`" in r.split("|")[1]), None)
        assert row is not None, f"docs/cli.md has no row for {key}"
        missing = [v for v in valid if not re.search(rf"(?<![\w.]){re.escape(v)}(?!\w)", row)]
        assert not missing, f"docs/cli.md's row for {key} does not name {missing}"


def test_reset_override_returns_schema_default():
    assert compose(["~optim.lr"]).optim.lr == 1e-5


@pytest.mark.parametrize("override, message", [
    ("train.max_stepz=3", "unknown config key 'train.max_stepz'; did you mean 'train.max_steps'?"),
    ("+train.max_stepz=3", "unknown config key 'train.max_stepz'; did you mean 'train.max_steps'?"),
    ("recipe=nope", "recipe='nope' not found; available:"),
    ("data.packing=zip", "data.packing='zip' is not valid; choose one of pack, pad"),
    ("mesh=nope", "mesh='nope' is not a mesh option; choose one of default"),
    ("model=[nope]", "model=[nope]: model takes the name of one of its options: qwen3_5_0_8b,"),
    ("mesh=5", "mesh=5: mesh takes the name of one of its options: default"),
    ("optim={a:1}", "optim={a:1}: optim takes the name of one of its options: adamw"),
    ("model.kernels=5", "model.kernels=5 is not valid; expected a mapping, e.g. {a: 1}"),
    ("launcher.env=[a]", "launcher.env=[a] is not valid; expected a mapping, e.g. {a: 1} (or null)"),
    ("launcher.sbatch_extra={a:1}", "launcher.sbatch_extra={a:1} is not valid; expected a list, e.g. [a,b]"),
    ("launcher.env=${oc.env:HOME}", "is not valid; expected a mapping, e.g. {A: 1} (or null)"),
    ("optim=[5]", "optim=[5]: optim takes the name of one of its options: adamw"),
    ("model=[tiny,qwen3_5_2b]", "model=[tiny,qwen3_5_2b]: model takes the name of one of its options:"),
    ("mesh=default,default", "mesh=default,default: mesh takes the name of one of its options: default"),
    ("optim.betas=0.9,0.95", "optim.betas=0.9,0.95: a comma makes a sweep, which a training run does not do; write a "
                             "list as optim.betas=[0.9,0.95]"),
    ("optim.lr=[1,", "optim.lr=[1,: cannot be read as key=value ("),
    ("seed=${optim.lr}", "seed: While dereferencing interpolation '${optim.lr}'"),
    ("model.kernels={bad:1}", "unknown config key 'model.kernels.bad'; did you mean 'model.kernels.gdn'?"),
    ("~launcher.env", "~launcher.env: the recipe does not set launcher.env, so there is nothing to reset"),
    ("launcher.setup=module", "launcher.setup='module' is not valid; expected a list, e.g. [a,b]"),
    ("data.sources=[{path:a,weight:abc}]", "data.sources[0].weight='abc' is not valid; expected a number"),
    ("data.sources=[{path:a,weight:1},{path:b,weight:x}]",
     "data.sources[1].weight='x' is not valid; expected a number"),
    ("data.sources=[{path:a},{path:b,format:[x]}]",
     "data.sources[1].format=['x'] is not valid; expected a string (or null)"),
    ("data.sources=[{path:a},{path:b,wieght:1}]",
     "unknown config key 'data.sources[1].wieght'; a data.sources entry takes path, weight and format"),
    ("data.sources=[5]", "data.sources[0]=5 is not valid; expected a mapping, e.g. {path: a.jsonl, weight: 1.0}"),
    ("optim.lr=fast", "optim.lr='fast' is not valid; expected a number"),
    ("optim.betas=3", "optim.betas=3 is not valid; expected a list, e.g. [a,b]"),
    ("train.max_steps=1.5", "train.max_steps=1.5 is not valid; expected an integer (or null)"),
    ("model.compile=maybe", "model.compile='maybe' is not valid; expected true or false"),
    ("~optim.lrr", "unknown config key 'optim.lrr'; did you mean 'optim.lr'?"),
    ("+optim.lr=1", "+optim.lr=1: optim.lr is already in the config (+ adds a new key); set it with optim.lr=1"),
    ("=3", "override '=3' is not of the form key=value"),
    ("lr_scheduler.min_lr_ratio=-1", "lr_scheduler.min_lr_ratio=-1.0 must be in [0, 1]"),
    ("lr_scheduler.min_lr_ratio=2", "lr_scheduler.min_lr_ratio=2.0 must be in [0, 1]"),
    ("optim.max_grad_norm=-1", "optim.max_grad_norm=-1.0 must be >= 0 (0 = no clipping)"),
    ("mesh.tp=0", "mesh.tp=0 must be >= 1"),
    ("train.epochs=2", "train.epochs=2.0 has no effect while train.max_steps=150 is set; add train.max_steps=null"),
    ("mesh.cp=0", "mesh.cp=0; valid: a positive number of context-parallel ranks (1 = no split)"),
    ("model.fp8=fp4", "model.fp8='fp4' is not valid; choose one of off, rowwise, rowwise_with_gw_hp, tensorwise"),
    ("model.mtp=yes", "model.mtp='yes' is not valid; choose one of keep, train, head"),
    ("launcher.master_port=99999999", "launcher.master_port=99999999 must be a port, 1..65535 (or null: 20000 + the "
                                      "job id % 20000)"),
    ("launcher.cpus_per_task=0", "launcher.cpus_per_task=0 must be >= 1 (or null)"),
])
def test_bad_overrides_fail_with_one_line(override, message):
    with pytest.raises(ValueError) as e:  # ConfigError is a ValueError; schema checks raise ValueError
        compose([override])
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("overrides, message", [
    # a valid override given before the bad one is not blamed for it
    (["peft.target_modules=[q_proj]", "mesh=5"], "mesh=5: mesh takes the name of one of its options: default"),
    (["peft.target_modules=[q_proj]", "optim.lr=[1,"], "optim.lr=[1,: cannot be read as key=value"),
    (["launcher.setup=${launcher.sbatch_extra}", "model.kernels=5"], "model.kernels=5 is not valid"),
    # a top-level key named like a data.sources entry's is not taken for one
    (["data.sources=[{path:a,weight:2}]", "+weight=1"], "unknown config key 'weight'"),
])
def test_the_bad_override_among_several_is_the_one_named(overrides, message):
    with pytest.raises(ValueError) as e:
        compose(overrides)
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


def test_the_last_recipe_given_is_the_runs_name_and_contents():
    for first, last in (("tiny", "tiny_lora"), ("tiny_lora", "tiny")):
        cfg = compose([f"recipe={first}", f"recipe={last}"])
        assert cfg.recipe == last and cfg.peft.method == ("lora" if last == "tiny_lora" else "none")


@pytest.mark.parametrize("value", ["true", "false"])
def test_unquoted_true_false_is_the_string_choice(value, capsys, tmp_path, monkeypatch):
    """Hydra reads an unquoted optim.fused=true (and YAML `fused: true`) as a bool; a key whose valid values
    are the strings 'true'/'false' takes it as that string."""
    assert main(["show", "recipe=tiny", f"optim.fused={value}"]) == 0
    assert f"  fused: {value}\n" in capsys.readouterr().out
    assert compose(["recipe=tiny", f"optim.fused={value}"]).optim.fused == value
    (tmp_path / "mine.yaml").write_text(f"# @package _global_\noptim:\n  fused: {value}\n")
    monkeypatch.setenv("QWENFT_RECIPES_DIR", str(tmp_path))
    assert compose(["recipe=mine"]).optim.fused == value
    assert main(["show", "recipe=tiny", "optim.fused=yes"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "optim.fused='yes' is not valid; choose one of auto, true, false" in err, err


def test_show_prints_booleans_as_yaml_booleans(capsys, tmp_path, monkeypatch):
    """`show` prints a true/false choice (a str key whose valid values include 'true' and 'false') as YAML's
    boolean, as a recipe writes it; saved as a recipe, the printed config composes to the same config."""
    import yaml

    overrides = ["recipe=tiny", "model.activation_checkpointing=false", "checkpoint.export_hf=true", "optim.fused=false"]
    assert main(["show", *overrides]) == 0
    out = capsys.readouterr().out
    assert "'true'" not in out and "'false'" not in out, out
    printed = yaml.safe_load(out)
    assert printed["model"]["activation_checkpointing"] is False and printed["optim"]["fused"] is False
    assert printed["checkpoint"]["export_hf"] is True and printed["train"]["progress_bar"] is True
    assert printed["checkpoint"]["export_dtype"] == "bfloat16"  # other choices stay strings
    (tmp_path / "shown.yaml").write_text(out.replace("recipe: tiny\n", ""))
    monkeypatch.setenv("QWENFT_RECIPES_DIR", str(tmp_path))
    assert compose(["recipe=shown"]) == dataclasses.replace(compose(overrides), recipe="shown")


def test_cli_error_is_one_line_and_exit_code_2(capsys):
    assert main(["show", "train.max_stepz=3"]) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "did you mean 'train.max_steps'" in err


def test_recipes_lists_each_with_description(capsys):
    assert main(["recipes"]) == 0
    out = capsys.readouterr().out
    for name in list_recipes():
        assert name in out
    assert "tiny" in out and "no download" in out


def test_help_lists_groups_and_recipes(capsys):
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    assert "mesh=" in out and "lr_scheduler={constant,cosine,linear}" in out and "tiny" in out


def test_user_recipe_dir(tmp_path, monkeypatch):
    (tmp_path / "mine.yaml").write_text("# @package _global_\ndescription: my recipe\ntrain:\n  max_steps: 3\n")
    monkeypatch.setenv("QWENFT_RECIPES_DIR", str(tmp_path))
    assert list_recipes()["mine"] == "my recipe"
    assert compose(["recipe=mine"]).train.max_steps == 3


def test_a_user_recipe_shadows_the_built_in_one_of_its_name(tmp_path, monkeypatch, capsys):
    (tmp_path / "tiny_lora.yaml").write_text("description: my lora\ntrain:\n  max_steps: 3\n")
    monkeypatch.setenv("QWENFT_RECIPES_DIR", str(tmp_path))
    cfg = compose(["recipe=tiny_lora"])
    assert (cfg.description, cfg.train.max_steps, cfg.peft.method) == ("my lora", 3, "none")
    assert main(["recipes"]) == 0 and "my lora" in capsys.readouterr().out
    monkeypatch.delenv("QWENFT_RECIPES_DIR")
    assert compose(["recipe=tiny_lora"]).peft.method == "lora"


def test_user_recipes_interpolate_include_shared_files_and_leave_no_temp_dir(tmp_path, monkeypatch):
    """A user recipe may interpolate another file's key, and include a shared file of a sub-dir (or a built-in
    recipe); each compose's mirror of the config dir is gone after it."""
    import tempfile

    recipes, scratch = tmp_path / "recipes", tmp_path / "tmp"
    (recipes / "common").mkdir(parents=True)
    scratch.mkdir()
    (recipes / "common" / "base.yaml").write_text("train:\n  max_steps: 7\n")
    (recipes / "mine.yaml").write_text("defaults:\n  - common/base@_here_\n  - _self_\nrun_dir: out/${model.name}\n")
    (recipes / "on_pp2.yaml").write_text("defaults:\n  - tiny_pp2@_here_\n  - _self_\ndescription: mine\n")
    monkeypatch.setenv("QWENFT_RECIPES_DIR", str(recipes))
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    cfg = compose(["recipe=mine"])
    assert (cfg.train.max_steps, cfg.run_dir) == (7, "out/tiny")
    assert compose(["recipe=on_pp2"]).mesh.pp == 2
    assert list(scratch.iterdir()) == []


def test_a_required_entry_of_a_recipes_list_is_required_until_the_list_is_replaced(tmp_path, monkeypatch, capsys):
    (tmp_path / "srcs.yaml").write_text("data:\n  sources:\n    - path: ???\n      weight: 1.0\n")
    monkeypatch.setenv("QWENFT_RECIPES_DIR", str(tmp_path))
    with pytest.raises(ValueError, match=r"required key.s. not set: data.sources\[0\].path"):
        compose(["recipe=srcs"])
    assert main(["show", "recipe=srcs"]) == 0
    assert "    weight: 1.0" in capsys.readouterr().out
    assert compose(["recipe=srcs", "data.sources=[{path: a.jsonl}]"]).data.sources[0].path == "a.jsonl"
    assert compose(["recipe=srcs", "data.sources=[]", "data.path=/d.jsonl"]).data.sources == []
    # a config group's choice sets none of the recipe's required keys under it; a required mapping entry shows
    (tmp_path / "needs.yaml").write_text("model:\n  path: ???\nlauncher:\n  env:\n    MY_VAR: ???\n")
    with pytest.raises(ValueError, match="required key.s. not set: launcher.env.MY_VAR, model.path"):
        compose(["recipe=needs", "model=qwen3_5_0_8b"])
    capsys.readouterr()
    assert main(["show", "recipe=needs"]) == 0
    assert "required before train: launcher.env.MY_VAR, model.path" in capsys.readouterr().err


def test_a_big_recipe_shown_and_saved_as_a_recipe_composes_to_the_same_config(tmp_path, monkeypatch, capsys):
    """Its required data.path stays required: the default data group's `path: tiny` does not fill it in."""
    import yaml

    assert main(["show", "recipe=qwen3_5_27b_tp4pp4"]) == 0
    shown = capsys.readouterr().out
    (tmp_path / "saved.yaml").write_text(shown)
    monkeypatch.setenv("QWENFT_RECIPES_DIR", str(tmp_path))
    assert main(["show", "recipe=saved"]) == 0
    again = capsys.readouterr()
    assert {**yaml.safe_load(again.out), "recipe": "x"} == {**yaml.safe_load(shown), "recipe": "x"}
    assert "required before train: data.path" in again.err
    with pytest.raises(ValueError, match="required key.s. not set: data.path"):
        compose(["recipe=saved"])
    assert compose(["recipe=saved", "data.path=/d.jsonl"]).data.path == "/d.jsonl"


def test_a_run_config_with_a_key_this_qwenft_lacks_is_one_line(tmp_path):
    """A run dir's config.yaml written by another version (or edited): resume and export say so in one line."""
    from qwenft.conf import load_run_config

    (tmp_path / "config.yaml").write_text("recipe: tiny\nold_key: 1\n")
    with pytest.raises(ValueError) as e:
        load_run_config(tmp_path)
    assert str(e.value).startswith(f"{tmp_path / 'config.yaml'}: old_key: ") and "\n" not in str(e.value)


def test_an_unknown_model_name_names_its_key():
    from qwenft.models.qwen3_5.configs import named_config

    with pytest.raises(ValueError, match=r"^model.name='bogus' is not a named size; valid: 0\.8b, 122b_a10b, "):
        named_config("bogus")


def test_user_recipe_without_package_header_sets_its_keys(tmp_path, monkeypatch):
    """A recipe file without `# @package _global_` sets top-level keys as one with it does."""
    (tmp_path / "plain.yaml").write_text("description: no header\ntrain:\n  max_steps: 2\ndata:\n  seq_len: 64\n"
                                         "defaults:\n  - override /lr_scheduler: linear\n")
    (tmp_path / "headed.yaml").write_text("# @package _global_\n" + (tmp_path / "plain.yaml").read_text())
    monkeypatch.setenv("QWENFT_RECIPES_DIR", str(tmp_path))
    plain, headed = compose(["recipe=plain"]), compose(["recipe=headed"])
    assert (plain.train.max_steps, plain.data.seq_len, plain.lr_scheduler.decay, plain.description) == \
        (2, 64, "linear", "no header")
    assert dataclasses.replace(plain, recipe="headed") == headed
    assert compose(["recipe=plain", "train.max_steps=5"]).train.max_steps == 5  # the command line still wins


@pytest.mark.parametrize("text, where, what", [
    ("train:\n  max_steps: [1, 2\n", "line 3, column 1",
     "expected ',' or ']', but got '<stream end>' (while parsing a flow sequence that began at line 2, column 14)"),
    ("train:\n  max_steps: 2\n   global_batch_size: 4\n", "line 3, column 21", "mapping values are not allowed here"),
    ("train:\n\tmax_steps: 2\n", "line 2, column 1", "found character '\\t' that cannot start any token"),
], ids=["unclosed_list", "bad_indent", "tab"])
def test_user_recipe_yaml_error_is_one_line(tmp_path, monkeypatch, capsys, text, where, what):
    (tmp_path / "broken.yaml").write_text(text)
    monkeypatch.setenv("QWENFT_RECIPES_DIR", str(tmp_path))
    assert main(["show", "recipe=broken"]) == 2
    err = capsys.readouterr().err
    assert err == f"qwenft: error: {tmp_path / 'broken.yaml'}, {where}: YAML syntax error: {what}\n", err


def test_unresolvable_interpolation_is_one_line(capsys, monkeypatch):
    monkeypatch.delenv("QWENFT_TEST_UNSET", raising=False)
    assert main(["show", "logger.wandb_project=${oc.env:QWENFT_TEST_UNSET}"]) == 2
    assert capsys.readouterr().err == ("qwenft: error: logger.wandb_project=${oc.env:QWENFT_TEST_UNSET} cannot be "
                                       "resolved: \"Environment variable 'QWENFT_TEST_UNSET' not found\"\n")


def test_impossible_mesh_fails_before_building(tmp_path):
    out = run_qwenft("train", "mesh.tp=2", "mesh.dp=2", f"run_dir={tmp_path / 'run'}")
    assert out.returncode == 2
    assert "mesh.tp=2 x mesh.pp=1 = 2 does not divide the world size 1" in out.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_train_tiny_end_to_end(tmp_path):
    """The tiny recipe as shipped: its loss falls by a third within 20 steps (measured: the mean of the last 5
    steps is 0.61 of the first 5's), and the run exports."""
    run_dir = tmp_path / "run"
    out = run_qwenft("train", "recipe=tiny", "train.max_steps=20", f"run_dir={run_dir}", "train.progress_bar=false")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 21))
    for key in ("loss", "lr", "grad_norm", "tokens_per_sec", "peak_memory_gib"):
        assert all(isinstance(r[key], float) for r in rows), key
    first, last = sum(r["loss"] for r in rows[:5]) / 5, sum(r["loss"] for r in rows[-5:]) / 5
    assert last < 0.8 * first, (first, last)
    assert (run_dir / "config.yaml").read_text().count("max_steps: 20") == 1
    assert (run_dir / "train.log").exists() and (run_dir / "hf" / "config.json").exists()


@pytest.mark.distributed
@pytest.mark.slow
def test_torchrun_two_processes(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "qwenft",
           "train", "recipe=tiny", "train.max_steps=3", f"run_dir={run_dir}", "train.progress_bar=false",
           "checkpoint.export_hf=false"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    rows = read_metrics(run_dir)
    assert len(rows) == 3 and all(r["loss"] > 0 for r in rows)
    assert "dp 2" in (run_dir / "train.log").read_text()


@pytest.mark.distributed
@pytest.mark.slow
def test_self_launch_local_workers(tmp_path):
    """Plain `qwenft train launcher.nproc_per_node=2` starts two workers itself (torch.distributed.run)."""
    run_dir = tmp_path / "run"
    out = run_qwenft("train", "recipe=tiny", "launcher.nproc_per_node=2", "train.max_steps=2", f"run_dir={run_dir}",
                     "train.progress_bar=false", "checkpoint.export_hf=false", env={"OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(read_metrics(run_dir)) == 2
    assert "world 2 = pp 1 x dp 2 x tp 1" in (run_dir / "train.log").read_text()


def test_unwritable_kernel_cache_dir_is_one_line_and_leaves_no_run_dir(tmp_path, capfd):
    """model.kernels.cache_dir under a file: refused before the run dir exists, naming the key and the path."""
    from helpers import qwenft_alone, tiny_overrides

    (tmp_path / "a_file").write_text("")
    run_dir = tmp_path / "run"
    assert qwenft_alone("train", *tiny_overrides(run_dir, f"model.kernels.cache_dir={tmp_path / 'a_file' / 'k'}")) == 2
    err = capfd.readouterr().err.strip().splitlines()[-1]
    assert f"model.kernels.cache_dir={tmp_path / 'a_file' / 'k'}: cannot make" in err and "writable" in err
    assert not run_dir.exists()


def _moot(overrides, max_steps=150):
    from qwenft.train.build import model_config
    from qwenft.train.moot import moot_settings
    from qwenft.train.plan import resolve_plan_layout
    from qwenft.train.spec import resolve_spec

    cfg = compose(overrides)
    model_cfg = model_config(cfg)
    spec = resolve_spec(cfg, resolve_plan_layout(cfg), model_cfg, "cpu")
    return cfg, moot_settings(cfg, max_steps, spec, model_cfg.vision is not None)


def test_settings_that_do_nothing_are_named_at_the_start():
    assert _moot(["recipe=tiny"])[1] == []
    cfg, notes = _moot(["recipe=tiny", "lr_scheduler=constant", "lr_scheduler.warmup_steps=10",
                        "logger.wandb_project=mine", "model.mtp_loss_weight=0.3", "pipeline.schedule=gpipe",
                        "pipeline.virtual_stages=2", "pipeline.stage_layers=[[0,1],[2,3]]", "mesh.vocab_parallel=false",
                        "mesh.cp_balanced_attention=false", "model.freeze_vision=true",
                        "model.vision_activation_checkpointing=true"], max_steps=5)
    assert notes == [
        "lr_scheduler.min_lr_ratio=0.1 has no effect with lr_scheduler.decay=constant",
        f"lr_scheduler.warmup_steps=10 is not below the run's 5 steps: the whole run warms up (the lr reaches "
        f"optim.lr={cfg.optim.lr} at step 10) and no decay follows",
        "logger.wandb_project=mine has no effect without logger.wandb=true (logger=wandb)",
        "mesh.vocab_parallel=false has no effect with mesh.tp=1",
        "mesh.cp_balanced_attention=false has no effect with mesh.cp=1",
        "model.freeze_vision=true, model.vision_activation_checkpointing=true have no effect on a text model (no "
        "vision tower)",
        "pipeline.schedule=gpipe, pipeline.virtual_stages=2, pipeline.stage_layers=[[0, 1], [2, 3]] have no effect "
        "with mesh.pp=1 (no pipeline)",
        "model.mtp_loss_weight=0.3 has no effect with model.mtp=keep (no MTP head trains); set model.mtp=train"]
    assert _moot(["recipe=tiny_pp2"])[1] == []
    assert _moot(["recipe=tiny_vlm", "model.freeze_vision=true"])[1] == []
    for recipe in list_recipes():  # a recipe's own settings are never moot
        assert _moot([f"recipe={recipe}", "data.path=x.jsonl"])[1] == [], recipe


def test_a_recipes_pipeline_keys_do_not_stop_a_run_without_a_pipeline():
    """A pipeline recipe's schedule and virtual stages meeting mesh.pp=1 on the command line are named as settings
    that do nothing (above), not refused."""
    from helpers import qwenft_alone

    assert qwenft_alone("plan", "recipe=qwen3_5_122b_a10b", "mesh.pp=1", "model.num_layers=4") == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_nccl_without_cuda_is_one_line(tmp_path, capfd):
    from helpers import qwenft_alone, tiny_overrides

    assert qwenft_alone("train", *tiny_overrides(tmp_path / "run", "mesh.backend=nccl")) == 2
    assert capfd.readouterr().err.strip().splitlines()[-1] == (
        "qwenft: error: mesh.backend=nccl needs CUDA GPUs, and this machine has none; use mesh.backend=auto or gloo")
    assert not (tmp_path / "run").exists()


def test_plan_names_an_expert_count_that_mesh_ep_does_not_divide(capfd):
    """`qwenft plan` sets dp from mesh.ep: the expert count is the error, not the batch split over that dp."""
    from helpers import qwenft_alone

    assert qwenft_alone("plan", "recipe=tiny_moe", "mesh.ep=3") == 2
    assert capfd.readouterr().err.strip() == ("qwenft: error: mesh.ep=3 does not divide num_experts=8; valid mesh.ep: "
                                              "[1, 2, 4, 8] (that also divide mesh.dp)")


def test_local_workers_that_cannot_fill_the_mesh_are_refused_before_they_start(tmp_path, capsys, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert main(["train", "recipe=tiny", "launcher.nproc_per_node=2", "mesh.tp=4", f"run_dir={tmp_path / 'run'}"]) == 2
    assert capsys.readouterr().err.strip() == ("qwenft: error: launcher.nproc_per_node=2 starts 2 ranks, but "
                                               "mesh.tp=4 x mesh.pp=1 = 4 does not divide 2")
    assert not (tmp_path / "run").exists()
