"""scripts/bench.py on the CPU: the training step's report and kernel breakdown, the mode dispatch, the host
time, activation and media (video against image batches) modes."""

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType

from bench_modes import train as bench_train
from distributed import free_port, run_distributed
from helpers import REPO, build_data, call_alone, compose, model_config

BENCH = str(REPO / "scripts" / "bench.py")


def _event(key, ms, device=DeviceType.CUDA, annotation=False, count=1):
    return SimpleNamespace(key=key, self_device_time_total=ms * 1e3, device_type=device, is_user_annotation=annotation,
                           count=count)


def test_kernel_breakdown_counts_kernels_not_the_ranges_around_them():
    """The profiler also reports record_function ranges as CUDA events spanning kernels already counted
    (FSDP's post_backward_accumulate, Optimizer.step#AdamW.step): counting them would inflate 'other' and
    'optimizer'."""
    events = [_event("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT", 100.0),
              _event("void multi_tensor_apply_kernel<FusedAdamMathFunctor<float>>", 20.0),
              _event("Optimizer.step#AdamW.step", 60.0, annotation=True),
              _event("FSDP::post_backward_accumulate (embed_tokens)", 30.0, annotation=True),
              _event("void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add<float>>", 10.0),
              _event("chunk_gated_delta_rule_fwd_kernel_h_blockdim64", 8.0),
              _event("kernel_kernel", 3.0), _event("_conv_bwd_kernel", 1.0),  # fla's TileLang kernel, qwenft's conv
              _event("Buffer Flush", 23.0), _event("Activity Buffer Request", 23.0),  # CUPTI's own
              _event("aten::mm", 100.0, device=DeviceType.CPU)]
    assert bench_train.kernel_breakdown(events, steps=2) == {
        "matmul": 50.0, "optimizer": 10.0, "gdn": 6.0, "other (elementwise, CE, copies)": 5.0}


def test_compare_sets_two_profiles_kernels_side_by_side(tmp_path, capsys):
    """`bench.py compare`: two `train --profile` reports' kernels (`kernel_times`: every kernel and copy, time
    and calls per step, no ranges) matched by name, A's times scaled first (a quarter of tp1's against a tp4
    rank; the calls kept), each kind's totals and the kernels by the largest difference; a kernel of one run
    only against zero. A report without the kernels is refused with what makes one."""
    from bench_modes import compare

    def report(path, events, steps):
        path.write_text(json.dumps({"gpu_kernels_per_step": bench_train.kernel_times(events, steps)}))
        return str(path)

    tp1 = [_event("nvjet_tst_TNT", 400.0, count=8), _event("chunk_gated_delta_rule_fwd_kernel_h", 40.0, count=8),
           _event("Optimizer.step#AdamW.step", 60.0, annotation=True), _event("aten::mm", 9.0, device=DeviceType.CPU)]
    tp4 = [_event("nvjet_tst_TNT", 100.0, count=8), _event("chunk_gated_delta_rule_fwd_kernel_h", 16.0, count=8),
           _event("memcpy128", 6.0, count=24)]
    assert [(r["kind"], r["name"], r["ms"], r["calls"]) for r in bench_train.kernel_times(tp4, steps=2)] == [
        ("matmul", "nvjet_tst_TNT", 50.0, 4.0), ("gdn", "chunk_gated_delta_rule_fwd_kernel_h", 8.0, 4.0),
        ("other (elementwise, CE, copies)", "memcpy128", 3.0, 12.0)]
    a, b = report(tmp_path / "tp1.json", tp1, 2), report(tmp_path / "tp4.json", tp4, 2)
    compare.main([a, b, "--scale-a", "0.25", "--json", str(tmp_path / "out.json")])
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["total"] == {"a_ms": 55.0, "b_ms": 61.0, "diff_ms": 6.0}
    assert {k: v["diff_ms"] for k, v in out["kinds"].items()} == {
        "gdn": 3.0, "other (elementwise, CE, copies)": 3.0, "matmul": 0.0}
    assert [(r["name"], r["a_ms"], r["b_ms"], r["a_calls"], r["b_calls"]) for r in out["kernels"]][1:] == [
        ("memcpy128", 0.0, 3.0, 0.0, 12.0), ("nvjet_tst_TNT", 50.0, 50.0, 4.0, 4.0)]
    assert "B - A +6.0" in capsys.readouterr().out
    (tmp_path / "old.json").write_text(json.dumps({"step_time_s": 1.0}))
    with pytest.raises(SystemExit, match="old.json has no gpu_kernels_per_step: run bench.py train with --profile"):
        compare.main([str(tmp_path / "old.json"), b])


# One 64-token row per rank and step: the profiler's cost on CPU grows with the ops recorded (recipe=tiny's
# batch of 8 took 13 s a profiled step on two ranks); what these tests check does not depend on the batch.
SMALL_BATCH = ("data.seq_len=64", "train.global_batch_size=2", "train.micro_batch_size=1")


def _profile_steps(rank, world_size, tmp_path):
    cfg = compose(["recipe=tiny", "train.max_steps=3", *SMALL_BATCH, "train.progress_bar=false",
                   "checkpoint.export_hf=false", f"run_dir={tmp_path / 'run'}"])
    result, averages, profiled = bench_train.profiled_run(cfg, warmup=1)
    return profiled, [e.count for e in averages if e.key.startswith("ProfilerStep")], len(result.losses)


@pytest.mark.distributed
@pytest.mark.slow
def test_profile_writes_each_ranks_trace(tmp_path):
    """--profile --trace on two CPU ranks (dp2): a gzipped Chrome trace per rank holding the recorded step."""
    import gzip

    trace = tmp_path / "trace"
    subprocess.run(["torchrun", "--nproc-per-node", "2", "--master-port", str(free_port()),
                    BENCH, "--warmup", "1", "--profile", str(tmp_path / "profile.txt"),
                    "--trace", str(trace), "recipe=tiny", "train.max_steps=2", *SMALL_BATCH, "mesh.dp=2",
                    f"run_dir={tmp_path / 'run'}"],
                   check=True, capture_output=True, cwd=tmp_path, timeout=300)
    for rank in range(2):
        events = json.loads(gzip.decompress((trace / f"rank{rank}.json.gz").read_bytes()))["traceEvents"]
        assert [e["name"] for e in events if e["name"].startswith("ProfilerStep")] == ["ProfilerStep#1"]
    bad = subprocess.run([sys.executable, BENCH, "--trace", str(trace), "recipe=tiny"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert bad.returncode == 2 and "--trace" in bad.stderr and "needs --profile" in bad.stderr


@pytest.mark.distributed
@pytest.mark.slow
def test_profile_records_the_steps_after_the_warmup(tmp_path):
    """3 steps, warm-up 1: the profiler's averages hold steps 2 and 3 only (a schedule that repeats would
    have started an empty cycle after them and reported nothing)."""
    [(profiled, step_counts, steps_run)] = run_distributed(_profile_steps, 1, tmp_path)
    assert (profiled, step_counts, steps_run) == (2, [2], 3)


@pytest.mark.slow
def test_bench_reports_a_cpu_run(tmp_path):
    """Twice into one run_dir: the second report times its own steps only; the first run's rows are kept aside in
    metrics.1.jsonl (a run starting at step 1 over an earlier run's metrics.jsonl)."""
    for run in range(2):
        out = tmp_path / f"bench{run}.json"
        subprocess.run([sys.executable, BENCH, "--warmup", "1", "--json", str(out),
                        "--plan", "recipe=tiny", "train.max_steps=2", "data.seq_len=64", "train.progress_bar=false",
                        f"run_dir={tmp_path / 'run'}"], check=True, capture_output=True, cwd=tmp_path, timeout=300)
        report = json.loads(out.read_text())
        assert report["world_size"] == 1 and report["steps_timed"] == 1, report
        assert report["tokens_per_sec_per_gpu"] > 0 and report["step_time_s"] > 0
        assert len(report["planned_peak_gib_per_rank"]) == 1
    for name in ("metrics.jsonl", "metrics.1.jsonl"):
        assert [json.loads(line)["step"] for line in (tmp_path / "run" / name).read_text().splitlines()] == [1, 2]


def _bench_json(tmp_path, *args) -> dict:
    """`python scripts/bench.py ARGS`'s report: all it prints, one JSON object."""
    out = subprocess.run([sys.executable, BENCH, *args], check=True, capture_output=True, text=True, cwd=tmp_path,
                         timeout=300)
    return json.loads(out.stdout)


def test_host_mode_runs_tensor_parallel(tmp_path):
    """`bench.py host`: tp2 on a fake process group, the tiny model on the CPU, activation checkpointing, the weight
    gradients added in their matmuls; the time per layer is the microbatch's over the tiny model's 4 decoder
    layers."""
    report = _bench_json(tmp_path, "host", "--repeat", "1", "recipe=tiny", "data.seq_len=64", "mesh.tp=2",
                         "model.activation_checkpointing=true", "model.kernels.weight_grad=in_matmul")
    assert report["host_ms_per_microbatch"] > 0
    assert report["host_ms_per_layer"] == pytest.approx(report["host_ms_per_microbatch"] / 4, abs=0.01)


def test_activations_mode_measures_each_layer_kind(tmp_path):
    """`bench.py activations` on the CPU: both layer kinds of the tiny model, what autograd saved per token (no
    allocator figure off CUDA) beside the plan's estimate for the same layer."""
    from qwenft.models.qwen3_5.configs import named_config
    from qwenft.train.activations import layer_activation_bytes

    report = _bench_json(tmp_path, "activations", "--docs", "4", "recipe=tiny", "data.seq_len=128")
    t = named_config("tiny").text
    assert (report["tokens"], report["docs"], report["device"]) == (128, 4, "cpu")
    for kind in ("linear_attention", "full_attention"):
        layer = report["layers"][kind]
        assert layer["saved_per_token"] > 0 and layer["allocated_per_token"] is None
        assert layer["planned_per_token"] == layer_activation_bytes(t, kind, 1, 2)  # bf16, the compute dtype


def test_unknown_mode_names_the_modes(tmp_path):
    """A first argument that is neither a mode, an option nor an override: exit 2 with the modes listed (not a
    training run that fails on a malformed override)."""
    out = subprocess.run([sys.executable, BENCH, "kernel"], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip() == ("bench.py: unknown mode 'kernel': the first argument is one of train, kernels, "
                                  "layers, fused, moe, host, activations, data_workers, media, attention, idle, compare, an option or a "
                                  "KEY=VALUE override (a training step)")


def test_moe_flops_per_token_count_the_active_parameters():
    """MFU and TFLOP/s of an MoE model (metrics.jsonl, bench.py) count 6 FLOPs per active matmul parameter: per
    layer the router, the top_k experts a token is routed to and the shared expert with its gate, counted here
    from the built 35B-A3B model's parameters (a layer's MLP less the experts a token skips); the MLP's share
    of the FLOPs is what replacing it by nothing removes. The whole model: ~3B active matmul parameters (A3B)."""
    import dataclasses

    from qwenft.models.loader import build_model
    from qwenft.models.qwen3_5.configs import named_config
    from qwenft.train.metrics import flops_per_token, matmul_params

    cfg = named_config("35b_a3b")
    t = cfg.text
    mlp = build_model(cfg, device="meta").layers["0"].mlp
    experts = sum(p.numel() for p in mlp.experts.parameters())
    skipped = experts * (t.num_experts - t.num_experts_per_tok) // t.num_experts
    active = sum(p.numel() for p in mlp.parameters()) - skipped
    without_mlp = dataclasses.replace(t, num_experts=0, intermediate_size=0)
    assert flops_per_token(t, 4096) - flops_per_token(without_mlp, 4096) == 6 * t.num_hidden_layers * active
    params = matmul_params(t)
    assert 2.8e9 < sum(params[kind] for kind in t.layer_types) + params["lm_head"] < 3.2e9


def test_fake_world_refuses_a_pipeline(capsys):
    """--fake-world with mesh.pp=2: exit 2 naming the key, before any process group or model exists (a stage alone
    would wait on shapes no other stage sends)."""
    import torch.distributed as dist

    with pytest.raises(SystemExit) as exit_info:
        bench_train.main(["--fake-world", "2", "recipe=tiny", "mesh.pp=2"])
    assert exit_info.value.code == 2 and not dist.is_initialized()
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "bench.py [train]: error: --fake-world plays one rank alone, and a pipeline stage waits for what the other "
        "stages send: mesh.pp=2 cannot run there (mesh.pp=1 can)")


def _media_batch(ids: list[int], padding: int) -> dict:
    return {"input_ids": torch.tensor([ids + [0] * padding]),
            "padding_mask": torch.tensor([[False] * len(ids) + [True] * padding])}


def test_media_check_refuses_batches_of_different_token_counts():
    """`bench.py media` compares batches only where the image and the video micro batch hold as many vision tokens
    and as many tokens outside padding; a difference in either stops it, naming the micro batch."""
    from bench_modes.media import check_same_tokens

    token_ids = {"image": 5, "video": 6}
    image = [_media_batch([1, 5, 5, 2], 4), _media_batch([1, 5, 5, 2, 7], 3)]
    with pytest.raises(ValueError, match=r"^micro batch 1: the image batch holds 2 image tokens of 5 tokens, the "
                                         r"video batch 2 video tokens of 4;"):
        check_same_tokens({"image": image, "video": [_media_batch([1, 6, 6, 2], 4)] * 2}, token_ids)
    with pytest.raises(ValueError, match=r"^micro batch 0: .* 2 image tokens of 4 tokens, the video batch 3 video "
                                         r"tokens of 4;"):
        check_same_tokens({"image": image, "video": [_media_batch([6, 6, 6, 2], 4)]}, token_ids)
    video = [_media_batch([1, 6, 6, 2], 4), _media_batch([6, 1, 2, 6, 7], 3)]  # the vision tokens anywhere
    assert check_same_tokens({"image": image, "video": video}, token_ids) == [(2, 4), (2, 5)]
    with pytest.raises(ValueError, match=r"^micro batch 0: .* 0 image tokens of 3 tokens, .* equal and above 0"):
        check_same_tokens({"image": [_media_batch([1, 2, 7], 5)], "video": [_media_batch([1, 2, 7], 5)]}, token_ids)


@pytest.mark.slow
def test_media_mode_measures_video_and_image_batches_of_one_token_count(tmp_path, monkeypatch, capsys):
    """`bench.py media` end to end on the CPU at tiny sizes, in-process: videos of 4 frames of 32x64 px against rows
    of 2 such pictures. A frame pair or a picture is 2x4 patches of 16 px, merged 2x2: 2 tokens; 2 of them a row, and
    both rows of each kind packed into every 256-token micro batch. The report holds both runs' numbers, and tokens/s
    is the step's 256 tokens over its time (--profile: test_media_profile_names_the_vision_towers_forward)."""
    from bench_modes import media
    from qwenft.models.qwen3_5 import configs

    monkeypatch.setattr(configs, "_tiny_vlm", configs._tiny_vlm)  # media's model for the run, restored after it
    out = tmp_path / "media.json"
    call_alone(media.main, ["--rows", "2", "--frames", "4", "--size", "32", "64", "--text", "tiny", "--vision-depth",
                            "1", "--repeat", "1", "--json", str(out), "data.seq_len=256", "train.max_steps=3",
                            "train.global_batch_size=1"])
    report = json.loads(out.read_text())
    assert report["vision_tokens_by_micro_batch"] == [2 * 2 * 2] * 3  # 3 steps of 1 micro batch
    tokens = report["tokens_by_micro_batch"]
    assert len(set(tokens)) == 1 and 8 < tokens[0] < 256
    for kind in ("image", "video"):
        run = report[kind]
        assert run["steps_timed"] == 1 and run["micro_batches_per_step"] == 1
        assert run["tokens_per_sec"] == pytest.approx(256 / run["step_time_s"])
        assert run["vision_tower_fwd_bwd_s_per_step"] > 0
        assert run["vision_tower_share_of_step"] == pytest.approx(
            run["vision_tower_fwd_bwd_s_per_step"] / run["step_time_s"])
    assert report["video_over_image_tokens_per_sec"] == pytest.approx(
        report["video"]["tokens_per_sec"] / report["image"]["tokens_per_sec"])
    printed = capsys.readouterr().out.splitlines()
    assert [line.split("|")[0].strip() for line in printed if "|" in line] == ["kind", "image", "video"]


def test_media_profile_names_the_vision_towers_forward():
    """`bench.py media --profile`'s tables show the vision tower's forward as one range a call, around the
    tower's ops and no others."""
    from torch.profiler import profile

    from bench_modes.media import label_forward

    tower, head = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    label_forward(tower, "vision tower forward")
    with profile() as prof:
        for _ in range(3):
            head(tower(torch.ones(2, 8)).relu())
    ranges = [e for e in prof.events() if e.name == "vision tower forward"]
    assert len(ranges) == 3
    for r in ranges:  # the tower's matmul inside, the relu after it outside
        assert [c.name for c in r.cpu_children] == ["aten::linear"]


def _tower_under_fsdp():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from bench_modes.media import tower_seconds
    from qwenft.distributed.fsdp import apply_fsdp
    from qwenft.distributed.mesh import init_process_group
    from qwenft.models.loader import build_model

    init_process_group("gloo")
    cfg = compose(["recipe=tiny_vlm", "data.seq_len=128", "data.num_workers=0"])
    model_cfg = model_config(cfg)
    _, data, _ = build_data(cfg, model_cfg, 1, 0, 1)
    mb = next(b for b in data if len(b["video_grid_thw"]) and not len(b["image_grid_thw"]))  # one merger call a pass
    data.close()
    model = build_model(model_cfg, device="cpu")
    apply_fsdp(model, init_device_mesh("cpu", (1,)), torch.bfloat16)  # fp32 weights computing in bf16
    calls = []
    model.visual.merger.register_forward_hook(lambda module, args, out: calls.append(("forward", out.dtype)))
    model.visual.merger.register_full_backward_hook(lambda *_: calls.append(("backward", None)))
    seconds = tower_seconds(model, [mb], torch.device("cpu"), repeat=2)
    sharded = all(isinstance(p, DTensor) and p.grad is None for p in model.parameters())
    return seconds, calls, sharded


def test_media_times_the_tower_of_an_fsdp_model():
    """A GPU run keeps fp32 weights computing in bf16, so FSDP wraps the model and the tower's weights are the
    root unit's, sharded outside the model's forward: `bench.py media` gathers them for its rounds (one untimed
    and 2 timed: 3 forwards, in bf16, and 3 backwards) and leaves the model sharded, without gradients."""
    seconds, calls, sharded = call_alone(_tower_under_fsdp)
    assert seconds > 0 and calls == [("forward", torch.bfloat16), ("backward", None)] * 3 and sharded


def test_idle_mode_sums_the_gaps_and_names_who_launched_late(tmp_path):
    """A timeline of one step: kernels at 0-100 and 100-150 us (back to back on two streams), then a 60 us gap whose
    next kernel was launched after it began from inside `aten::copy_` under `Optimizer.step` (host late), then a
    30 us gap whose kernel was launched long before (the GPU waited), then a 5 us gap (under the threshold). The
    host was in the runner's `qwenft.optimizer_step` range when the first gap began and out of it at the second (a
    range on another thread, such as autograd's, is not the loop's)."""
    from bench_modes import idle

    def x(cat, name, ts, dur, tid=1, corr=None):
        e = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 0}
        if corr is not None:
            e["args"] = {"correlation": corr}
        return e

    events = [
        x("user_annotation", "ProfilerStep#3", 0, 400),
        x("gpu_user_annotation", "ProfilerStep#3", 0, 300, tid=7),  # the step's range on the GPU: not a second step
        x("user_annotation", "qwenft.optimizer_step", 145, 104),
        x("user_annotation", "qwenft.elsewhere", 240, 50, tid=2),
        x("cpu_op", "Optimizer.step#AdamW.step", 150, 99),
        x("cpu_op", "aten::copy_", 200, 20),
        x("cuda_runtime", "cudaLaunchKernel", 205, 5, corr=7),
        x("cuda_runtime", "cudaLaunchKernel", 20, 5, corr=8),
        x("kernel", "gemm_a", 0, 100, tid=7),
        x("kernel", "gemm_b", 90, 60, tid=8),
        x("kernel", "adam_kernel", 210, 40, tid=7, corr=7),  # gap 150 -> 210: 60 us, launched at 205 > 150
        x("gpu_memcpy", "Memcpy HtoD", 280, 10, tid=7, corr=8),  # gap 250 -> 280: 30 us, launched at 20
        x("kernel", "tail", 295, 5, tid=7),  # gap 5 us: left out
    ]
    trace = tmp_path / "rank0.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    report = idle.summarize(str(trace), min_us=20)
    assert report["per_step"] == [{"step": "ProfilerStep#3", "wall_ms": 0.4, "idle_ms": 0.1, "host_late_ms": 0.1}]
    late, waited = report["largest_gaps"]
    assert late == {"us": 60, "next": "adam_kernel", "host_late": True, "host_phase": "qwenft.optimizer_step",
                    "launched_in": "ProfilerStep#3 > qwenft.optimizer_step > Optimizer.step#AdamW.step > aten::copy_"}
    assert waited["us"] == 30 and not waited["host_late"] and waited["launched_in"] == "ProfilerStep#3"
    assert waited["host_phase"] == "between phases"
    assert report["idle_ms_per_step_by_host_phase"] == [
        {"phase": "qwenft.optimizer_step", "ms_per_step": 0.06, "gaps_per_step": 1.0},
        {"phase": "between phases", "ms_per_step": 0.03, "gaps_per_step": 1.0}]
    assert [(r["op"], r["host_late"]) for r in report["idle_ms_per_step_by_launching_op"]] == [
        ("aten::copy_", True), ("ProfilerStep#3", False)]
