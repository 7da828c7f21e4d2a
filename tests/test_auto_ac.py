"""`model.activation_checkpointing=auto`: a run builds with the mode `qwenft plan` names as the cheapest that fits.

The reference is the planner run apart from the training run: every rank's plan on a fake process group in this
process (`plan.predict`), and `plan.cheapest_ac_mode` over them. The run plans each rank's share on its own mesh
and takes the highest peak per mode over the ranks with one all-reduce; both must name the same mode.
"""

import pytest

from distributed import run_distributed
from helpers import compose, model_config, qwenft_alone, tiny_overrides, train_alone
from qwenft.train import auto_ac, plan as plan_lib


def _limit_where_off_misses(plans) -> float:
    """A plan.gpu_memory_gib under which the highest rank's peak with checkpointing off just misses the 90% budget."""
    worst_off = max(p.ac_mode_peaks["false"] for p in plans)
    return (worst_off - 1) / (1 - plan_lib.AC_MARGIN) / plan_lib.GIB


def test_a_run_uses_the_plans_choice_and_keeps_auto_in_its_config(tmp_path):
    """One process: off misses the budget, so the run builds with the cheapest mode that fits (selective on
    the tiny model), says so in its log, and config.yaml keeps `auto` (a resume chooses again)."""
    base = tiny_overrides(tmp_path / "run", "train.max_steps=1", "checkpoint.export_hf=false",
                          "model.activation_checkpointing=auto")
    plans = plan_lib.predict(auto_ac.with_mode(compose(base, missing_ok=True), "false"))
    limit = _limit_where_off_misses(plans)
    expected, _ = plan_lib.cheapest_ac_mode(plans, limit)
    assert expected not in (None, "false")
    train_alone([*base, f"plan.gpu_memory_gib={limit!r}"])
    log = (tmp_path / "run" / "train.log").read_text()
    assert f"model.activation_checkpointing=auto chose {expected}, the cheapest mode under" in log
    assert "activation_checkpointing: auto" in (tmp_path / "run" / "config.yaml").read_text()


def _choose(rank, world_size, overrides):
    from qwenft.conf.layout import resolve_layout
    from qwenft.distributed.mesh import build_mesh

    import torch

    cfg = compose(overrides, missing_ok=True)
    layout = resolve_layout(cfg.mesh.tp, cfg.mesh.pp, cfg.mesh.dp, world_size, ep=cfg.mesh.ep, cp=cfg.mesh.cp)
    mesh = build_mesh(layout, device="cpu")
    own = auto_ac.rank_mode_peaks(cfg, model_config(cfg), layout, mesh)
    chosen = auto_ac.resolve(cfg, model_config(cfg), layout, mesh, torch.device("cpu"))
    return own, chosen.model.activation_checkpointing


@pytest.mark.slow
def test_pipeline_ranks_agree_on_the_highest_ranks_choice(tmp_path):
    """pp2: the stages plan different peaks. Under a limit where the lighter stage alone would train with
    checkpointing off and the heavier one could not, both ranks choose the mode the whole plan names; each
    rank's own numbers equal its fake-process-group plan."""
    overrides = tiny_overrides(tmp_path, "recipe=tiny_pp2", "model.activation_checkpointing=auto")
    plans = plan_lib.predict(auto_ac.with_mode(compose(overrides, missing_ok=True), "false"))
    assert len(plans) == 2
    limit = _limit_where_off_misses(plans)
    budget = (1 - plan_lib.AC_MARGIN) * limit * plan_lib.GIB
    assert min(p.ac_mode_peaks["false"] for p in plans) <= budget  # one rank alone would choose off
    expected, _ = plan_lib.cheapest_ac_mode(plans, limit)
    assert expected not in (None, "false")
    results = run_distributed(_choose, 2, [*overrides, f"plan.gpu_memory_gib={limit!r}"])
    assert [own for own, _ in results] == [p.ac_mode_peaks for p in plans]
    assert [mode for _, mode in results] == [expected, expected]


def test_choice_rules():
    """Cheapest first; under CUDA graphs only off; none fitting leaves the least memory."""
    gib = plan_lib.GIB
    worst = {"false": 100 * gib, "selective": 60 * gib, "full_attention": 90 * gib, "linear_attention": 50 * gib,
             "true": 40 * gib}
    assert auto_ac.choose(worst, 120, cuda_graphs=False) == "false"      # 100 <= 108
    assert auto_ac.choose(worst, 100, cuda_graphs=False) == "selective"  # 60 <= 90 < 100
    assert auto_ac.choose(worst, 50, cuda_graphs=False) == "true"
    assert auto_ac.choose(worst, 40, cuda_graphs=False) is None
    assert auto_ac.choose(worst, 100, cuda_graphs=True) is None
    assert auto_ac.fallback(compose(["model.cuda_graphs=false"])) == "true"


def test_plan_under_cuda_graphs_offers_off_alone(capfd):
    """Under model.cuda_graphs=true (which refuses every other mode) `qwenft plan` names no mode that fits where off
    does not, though a cheaper one would, in its table's last line, its auto note and its JSON alike."""
    import json

    args = ["recipe=tiny", "data.seq_len=128", "model.compile=true", "model.cuda_graphs=true",
            "optim.master_dtype=bfloat16", "optim.state_dtype=bfloat16"]
    plans = plan_lib.predict(compose([*args, "model.activation_checkpointing=false"], missing_ok=True))
    limit = _limit_where_off_misses(plans)
    assert plan_lib.cheapest_ac_mode(plans, limit)[0] not in (None, "false")
    assert plan_lib.cheapest_ac_mode(plans, limit, cuda_graphs=True)[0] is None
    assert qwenft_alone("plan", *args, "model.activation_checkpointing=auto", f"plan.gpu_memory_gib={limit!r}") == 0
    last_two = capfd.readouterr().out.rstrip().splitlines()[-2:]
    assert last_two[0].startswith("activation checkpointing: false, the only mode model.cuda_graphs=true takes, "
                                  "does not fit under"), last_two
    assert last_two[1] == ("model.activation_checkpointing=auto: false, the only mode model.cuda_graphs=true takes, "
                           "does not fit; a run would warn and use false")
    assert qwenft_alone("plan", *args, "model.activation_checkpointing=false", f"plan.gpu_memory_gib={limit!r}",
                        "--json") == 0
    assert json.loads(capfd.readouterr().out)["cheapest_ac_mode"] is None


def test_plan_command_says_what_a_run_chooses(tmp_path, capfd):
    """`qwenft plan` with auto prints the plan of the chosen mode, as if it had been set, and names it."""
    args = ["recipe=tiny", "data.seq_len=128"]
    plans = plan_lib.predict(compose([*args, "model.activation_checkpointing=false"], missing_ok=True))
    limit = _limit_where_off_misses(plans)
    expected, _ = plan_lib.cheapest_ac_mode(plans, limit)
    assert qwenft_alone("plan", *args, "model.activation_checkpointing=auto", f"plan.gpu_memory_gib={limit!r}") == 0
    out = capfd.readouterr().out
    assert out.rstrip().endswith(f"model.activation_checkpointing=auto: a run chooses {expected}")
    assert qwenft_alone("plan", *args, f"model.activation_checkpointing={expected}",
                        f"plan.gpu_memory_gib={limit!r}") == 0
    explicit = capfd.readouterr().out
    assert out.splitlines()[2:-1] == explicit.splitlines()[2:]  # the same table and notes below the header
