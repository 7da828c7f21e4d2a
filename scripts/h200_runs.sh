#!/usr/bin/env bash
# The H200 runs behind docs/performance.md, in parts that each fit the device tool's 10-minute call on a 2-GPU
# box (with the GPU kit: source .gpu-kit/use-kit.sh first). Single-GPU runs go two at a time, one per GPU.
#
#   bash scripts/h200_runs.sh two_gpu|tp2|one_gpu|compile|profile|profile_fastest|fake_tp_profile|profile_pair|tp2_trace|side_by_side|defaults_side_by_side|graphs_side_by_side|moe_side_by_side|lean|lora|fake_tp|fake_tp_compile|fake_tp_graphs|fake_tp_sp_graphs|fake_tp_targets|fake_tp_ab|tp_weight_grad|gpu_tests_model|gpu_tests_kernels|multi_gpu_tests|cp|cp_balanced|cp_one_gpu|cp_profile|cp_tests|mtp|fp8|fp8_numerics|weight_grad [OUT_DIR]   # OUT_DIR (default /tmp/h200)
#
# side_by_side and moe_side_by_side run on one GPU and need NeMo Automodel's bundle too (scripts/automodel/build.sh
# makes .amodel/); lean and lora run right after side_by_side on the same (warm) machine, whose caches hold the
# compiled kernels.
#
# Each run is scripts/bench.py on the 27B shape cut to 8 layers (moe_side_by_side: the 35B-A3B shape cut to 4), seq
# 4096, global batch 8, micro batch 1, with --plan: the report holds `qwenft plan`'s peak next to the measured one.
# The first step of a layout the host has not run yet compiles fla/TileLang kernels (up to ~150 s; tp2's head-sharded
# shapes are a layout of their own), and model.compile=true adds inductor's compile: allow for it in the limits.
set -u
parts="two_gpu, tp2, one_gpu, compile, profile, profile_fastest, fake_tp_profile, profile_pair, tp2_trace, side_by_side, defaults_side_by_side, graphs_side_by_side, moe_side_by_side, lean, lora, fake_tp, fake_tp_compile, fake_tp_graphs, fake_tp_sp_graphs, fake_tp_targets, fake_tp_ab, tp_weight_grad, gpu_tests_model, gpu_tests_kernels, multi_gpu_tests, cp, cp_balanced, cp_one_gpu, cp_profile, cp_tests, mtp, fp8, fp8_numerics or weight_grad"
part=${1:?which part: $parts}
out=${2:-/tmp/h200}
mkdir -p "$out"
out=$(cd "$out" && pwd)  # absolute: fake_tp_ab runs the older tree's bench from its own directory
# eager unless a run says model.compile=true (the qwen3_5_27b model group itself compiles)
shape="model=qwen3_5_27b model.num_layers=8"  # the model group and its cut; moe_side_by_side sets its own
base="data.seq_len=4096 train.global_batch_size=8
      train.micro_batch_size=1 lr_scheduler.warmup_steps=0 optim.lr=1e-5 model.compile=false checkpoint.export_hf=false"
bf16="optim.master_dtype=bfloat16 optim.state_dtype=bfloat16"  # NeMo Automodel's numerics
memory_options="optim.state_dtype=bfloat16 optim.master_dtype=bfloat16 model.ce_chunk_tokens=1024
                pipeline.reduce_grad_per_microbatch=true"

# DEADLINE (epoch seconds), when set, cuts every run's limit to the time left before it
limit_by_deadline() { local l=$1; [ -n "${DEADLINE:-}" ] && [ $((DEADLINE - $(date +%s))) -lt "$l" ] && l=$((DEADLINE - $(date +%s))); echo $((l > 1 ? l : 1)); }

bench() {  # name limit_s nproc gpus bench-args overrides...
  local name=$1 limit nproc=$3 gpus=$4 bargs=$5
  limit=$(limit_by_deadline "$2")
  shift 5
  echo "=== $name $(date +%T)"
  # shellcheck disable=SC2086
  CUDA_VISIBLE_DEVICES=$gpus timeout -s KILL "$limit" torchrun --nproc-per-node "$nproc" \
    --master-port $((29500 + RANDOM % 1000)) scripts/bench.py $bargs --json "$out/$name.json" recipe=tiny $shape $base "$@" \
    run_dir="$out/runs/$name" > "$out/$name.log" 2>&1
  local rc=$?
  # a KILLed torchrun leaves its workers running: they would share the GPU with the next run
  pkill -9 -f "scripts/bench.py .*run_dir=$out/runs/$name\$" 2>/dev/null; sleep 1
  echo "=== $name rc=$rc $(date +%T)"
  [ -f "$out/$name.json" ] && cat "$out/$name.json"
}

automodel_defaults() {  # NeMo Automodel 0.7.0 on the benchmark, for the side-by-sides: AMODEL_STEPS (default 8, the first
  # 2 not timed) steps, in an OUT_DIR of its own, emptied first: a ratio never comes from another part's Automodel run
  echo "=== automodel $(date +%T)"
  rm -rf "$out/automodel_defaults"
  GBS=8 STEPS=${AMODEL_STEPS:-8} WARMUP=2 WALL=$(limit_by_deadline 280) OUT_DIR="$out/automodel_defaults" \
    bash .amodel/run.sh > "$out/automodel_defaults.log" 2>&1
  echo "=== automodel rc=$? $(date +%T)"; grep AMODEL_RESULT "$out/automodel_defaults.log"
}

against_automodel() {  # automodel_result.json bench.json...: each bench run's tokens/s against Automodel's, one line each
  python3 - "$@" <<'PY'
import json, sys
from pathlib import Path
am = json.loads(Path(sys.argv[1]).read_text())["tok_s_median"] if Path(sys.argv[1]).is_file() else None
for f in map(Path, sys.argv[2:]):
    qf = json.loads(f.read_text())["tokens_per_sec_per_gpu"] if f.is_file() else None
    ratio = f"{qf / am:.3f}x" if qf and am else "n/a"
    print(f"=== {f.stem}: {qf} tokens/s against Automodel's {am}: {ratio}")
PY
}

case $part in
two_gpu)  # the first run compiles the one-GPU shapes' kernels (dp2 runs them too), tp2 its own
bench dp2_knob_off 150 2 0,1 "--warmup 1 --plan" train.max_steps=4 mesh.dp=2 pipeline.reduce_grad_per_microbatch=false
bench dp2_knob_on 110 2 0,1 "--warmup 1 --plan" train.max_steps=4 mesh.dp=2 pipeline.reduce_grad_per_microbatch=true
bench dp2_knob_on_prefetch2 110 2 0,1 "--warmup 1 --plan" train.max_steps=4 mesh.dp=2 \
  pipeline.reduce_grad_per_microbatch=true mesh.fsdp_prefetch=2 ;;
tp2)
bench tp2_vocab_parallel 280 2 0,1 "--warmup 1 --plan" train.max_steps=4 mesh.tp=2 mesh.vocab_parallel=true
bench tp2_replicated_vocab 100 2 0,1 "--warmup 1 --plan" train.max_steps=4 mesh.tp=2 mesh.vocab_parallel=false ;;
one_gpu)  # one GPU each, two at a time
(bench ac_off 240 1 0 "--warmup 2 --plan" train.max_steps=6 model.activation_checkpointing=false
 bench compile 300 1 0 "--warmup 2 --plan" train.max_steps=6 model.compile=true) &
(bench memory_options 240 1 1 "--warmup 2 --plan" train.max_steps=6 $memory_options
 bench ac_selective 240 1 1 "--warmup 2 --plan" train.max_steps=6 model.activation_checkpointing=selective) &
wait ;;
profile)  # the kernel breakdown, AC on (GPU 0) and off (GPU 1); the profiler's post-processing takes about a minute
(bench profile 300 1 0 "--warmup 1 --profile $out/profile.txt" train.max_steps=3) &
(bench profile_ac_off 300 1 1 "--warmup 1 --profile $out/profile_ac_off.txt" train.max_steps=3 \
   model.activation_checkpointing=false) &
wait ;;
profile_fastest)  # the kernel breakdown of the side-by-side's fastest setting: bf16 numerics, AC off, compiled (steps 3-4)
bench profile_bf16_ac_off_compile 300 1 0 "--warmup 2 --profile $out/profile_bf16_ac_off_compile.txt" train.max_steps=4 \
  $bf16 model.activation_checkpointing=false model.compile=true ;;
fake_tp_profile)  # the kernel breakdown of rank 0 of a fake tp world (FAKE_TP, default 4) compiled with CUDA graphs,
# in_matmul weight gradients, bf16, AC off, with sequence parallelism unless FAKE_SP=false (steps 6-7: a graphed fake
# world's step settles after a few); FAKE_TRACE=1 also writes the profiled steps' timeline (for `bench.py idle`)
tp=${FAKE_TP:-4}; sp=${FAKE_SP:-true}; name=profile_fake_tp${tp}$([ "$sp" = true ] && echo _sp)_graphs
trace=$([ -n "${FAKE_TRACE:-}" ] && echo "--trace $out/${name}_trace")
bench "$name" 330 1 0 "--warmup 5 --fake-world $tp --profile $out/$name.txt $trace" train.max_steps=7 $bf16 \
  model.activation_checkpointing=false model.compile=true model.cuda_graphs=true mesh.tp=$tp \
  mesh.sequence_parallel=$sp train.on_nonfinite=skip ;;
profile_pair)  # profile_fastest (tp1), then fake_tp_profile (FAKE_TP, FAKE_SP, FAKE_TRACE as there) on the same machine,
# then `bench.py compare` of a 1/FAKE_TP share of tp1's kernels against the rank's (compare_tp1_tpN.txt and .json):
# what the rank spends beyond its share, kernel by kernel. Cold, the two compiles take most of a call
bash "$0" profile_fastest "$out"
tp=${FAKE_TP:-4}; sp=${FAKE_SP:-true}
bash "$0" fake_tp_profile "$out"
rank=$out/profile_fake_tp${tp}$([ "$sp" = true ] && echo _sp)_graphs.json
python scripts/bench.py compare "$out/profile_bf16_ac_off_compile.json" "$rank" --scale-a "$(python -c "print(1 / $tp)")" \
  --top 40 --json "$out/compare_tp1_tp$tp.json" > "$out/compare_tp1_tp$tp.txt" 2>&1
echo "=== compare rc=$?"; head -12 "$out/compare_tp1_tp$tp.txt" ;;
compile)  # compile against no compile on one commit, compile with AC off, chunked CE alone
(bench ac_on 240 1 0 "--warmup 2 --plan" train.max_steps=6
 bench ac_on_compile 300 1 0 "--warmup 2 --plan" train.max_steps=6 model.compile=true) &
(bench ce_chunk 240 1 1 "--warmup 2 --plan" train.max_steps=6 model.ce_chunk_tokens=1024
 bench ac_off_compile 300 1 1 "--warmup 2 --plan" train.max_steps=6 model.activation_checkpointing=false \
   model.compile=true) &
wait ;;
tp2_trace)  # tp2's profile (steps 2-3) plus both ranks' timelines (which rank the all-reduces wait for)
bench tp2_profile 420 2 0,1 "--warmup 1 --profile $out/tp2.txt --trace $out/tp2_trace" train.max_steps=3 mesh.tp=2 ;;
side_by_side)  # NeMo Automodel 0.7.0 and qwenft at Automodel's numerics, one after the other on this GPU: qwenft's
# memory-lean setting first (it pays fla's kernel compile, which Automodel's run then finds cached), then
# Automodel, then qwenft's fastest setting in what is left of the device tool's 600 s
start=$(date +%s)
bench bf16_ac_on_compile 280 1 0 "--warmup 2 --plan" train.max_steps=6 $bf16 model.compile=true
echo "=== automodel $(date +%T)"
# Automodel gets what is left but 70 s for the last run (at most 330 s): on a machine whose caches lack its
# kernels, its setup and kernel compilation take minutes before its first step
wall=$((515 - $(date +%s) + start)); [ $wall -gt 330 ] && wall=330
GBS=8 STEPS=8 WARMUP=2 WALL=$wall OUT_DIR="$out/automodel" bash .amodel/run.sh > "$out/automodel.log" 2>&1
echo "=== automodel rc=$? $(date +%T)"; grep AMODEL_RESULT "$out/automodel.log"
bench bf16_ac_off_compile_cuda_graphs $((585 - $(date +%s) + start)) 1 0 "--warmup 2 --plan" train.max_steps=6 $bf16 \
  model.activation_checkpointing=false model.compile=true model.cuda_graphs=true ;;
defaults_side_by_side)  # the model group's defaults (bf16 numerics, compile, model.activation_checkpointing=auto: the
# plan picks; model.kernels.weight_grad=auto: in_matmul), then NeMo Automodel 0.7.0, then model.fp8=tensorwise (AC off,
# compiled; torchao on PYTHONPATH as for fp8); the last lines are each run's tokens/s against Automodel's. The limits
# allow a cold machine's compiles (the first run's, then Automodel's own: fla's kernels for its unpacked rows); with
# DEADLINE set (the call's start + 590 s), the fp8 run gets what is left ($base turns compile off for the eager runs;
# the model group compiles, so the defaults run turns it back on)
bench defaults_vs_automodel 250 1 0 "--warmup 2 --plan" train.max_steps=6 model.compile=true
automodel_defaults
bench fp8_tensorwise_ac_off_compile 140 1 0 "--warmup 2" train.max_steps=6 $bf16 model.activation_checkpointing=false \
  model.compile=true model.fp8=tensorwise
against_automodel "$out/automodel_defaults/result.json" "$out/defaults_vs_automodel.json" \
  "$out/fp8_tensorwise_ac_off_compile.json"
;;
graphs_side_by_side)  # the model group's defaults as in defaults_side_by_side, then NeMo Automodel 0.7.0, then the defaults
# with model.cuda_graphs=true (the compiled graphs replayed as CUDA graphs, AC off: a one-GPU step's launch gaps go);
# the last lines are each run's tokens/s against Automodel's; DEADLINE as in defaults_side_by_side; AMODEL_STEPS: more
# Automodel steps on a warm machine, whose compiles are cached
bench defaults_vs_automodel 250 1 0 "--warmup 2 --plan" train.max_steps=6 model.compile=true
automodel_defaults
bench defaults_graphs 150 1 0 "--warmup 2" train.max_steps=6 model.compile=true model.cuda_graphs=true
against_automodel "$out/automodel_defaults/result.json" "$out/defaults_vs_automodel.json" "$out/defaults_graphs.json"
;;
moe_side_by_side)  # NeMo Automodel 0.7.0's native Qwen3.5-MoE (torch._grouped_mm experts) and qwenft on the 35B-A3B
# shape cut to 4 layers, Automodel's numerics, AC off, one after the other on this GPU: qwenft eager (the MoE groups'
# default) first (it pays fla's kernel compile for these head counts, which Automodel's run then finds cached), then
# Automodel with what is left but 70 s (at most 330 s: it writes an 8.8 GB checkpoint first), then qwenft compiled in
# the rest of the device tool's 600 s. The last line is each run's tokens/s against Automodel's.
start=$(date +%s)
shape="model=qwen3_5_35b_a3b model.num_layers=4"
bench moe_bf16_ac_off 240 1 0 "--warmup 2 --plan" train.max_steps=8 $bf16 model.activation_checkpointing=false
echo "=== automodel_moe $(date +%T)"
wall=$((515 - $(date +%s) + start)); [ $wall -gt 330 ] && wall=330
MODEL=moe GBS=8 STEPS=8 WARMUP=2 WALL=$wall OUT_DIR="$out/automodel_moe" bash .amodel/run.sh > "$out/automodel_moe.log" 2>&1
echo "=== automodel_moe rc=$? $(date +%T)"; grep AMODEL_RESULT "$out/automodel_moe.log"
bench moe_bf16_ac_off_compile $((585 - $(date +%s) + start)) 1 0 "--warmup 2 --plan" train.max_steps=8 $bf16 \
  model.activation_checkpointing=false model.compile=true
against_automodel "$out/automodel_moe/result.json" "$out/moe_bf16_ac_off.json" "$out/moe_bf16_ac_off_compile.json"
;;
lora)  # after side_by_side, warm: LoRA rank 16 on every linear against full finetuning, eager, AC off, both
# profiled (the frozen base's backward has no weight-gradient matmuls: about 2/3 of full finetuning's matmul time)
bench full_ft_profile 300 1 0 "--warmup 2 --plan --profile $out/full_ft.txt" train.max_steps=5 $bf16 \
  model.activation_checkpointing=false
bench lora_r16_profile 200 1 0 "--warmup 2 --plan --profile $out/lora_r16.txt" train.max_steps=5 \
  model.activation_checkpointing=false peft=lora peft.rank=16 peft.alpha=32 optim.master_dtype=float32 \
  optim.state_dtype=float32 ;;  # adapters in fp32 (the LoRA recipes' setting), the base in bf16
fake_tp)  # rank 0 of a fake tp2 and tp4 world against one GPU, eager, AC off: a tensor parallel rank's ceiling. With
# sequence parallelism torch's fake backend left reduce-scatter outputs unwritten (NaN losses on torch 2.11);
# qwenft's fake world (fake_pg.LocalCopyGroup) fills every output, finite on the CPU. train.on_nonfinite=skip stays
# until a run on the GPU image shows it there (a skipped step skips the optimizer: 1-2% of a step here)
bench tp1 220 1 0 "--warmup 2" train.max_steps=5 $bf16 model.activation_checkpointing=false
for tp in 2 4; do
  bench fake_tp$tp 180 1 0 "--warmup 2 --fake-world $tp" train.max_steps=5 $bf16 model.activation_checkpointing=false \
    mesh.tp=$tp
  bench fake_tp${tp}_sp 60 1 0 "--warmup 2 --fake-world $tp" train.max_steps=5 $bf16 model.activation_checkpointing=false \
    mesh.tp=$tp mesh.sequence_parallel=true train.on_nonfinite=skip
done ;;
lean)  # after side_by_side, warm: selective checkpointing, and the model group's defaults
bench bf16_selective_compile 200 1 0 "--warmup 2 --plan" train.max_steps=6 $bf16 model.compile=true \
  model.activation_checkpointing=selective
bench defaults 120 1 0 "--warmup 2 --plan" train.max_steps=5 model.compile=true ;;  # the model group's defaults
fake_tp_compile)  # the same with model.compile=true (inductor's compile per layout on top of fla's: allow for it)
bench tp1_compile 260 1 0 "--warmup 2" train.max_steps=5 $bf16 model.activation_checkpointing=false model.compile=true
for tp in 2 4; do
  bench fake_tp${tp}_compile 240 1 0 "--warmup 2 --fake-world $tp" train.max_steps=5 $bf16 \
    model.activation_checkpointing=false model.compile=true mesh.tp=$tp
done ;;
fake_tp_graphs)  # tensor parallel's target: one GPU compiled, then rank 0 of fake tp2 and tp4 worlds compiled with
# CUDA graphs (fla's GatedDeltaNet kernels graphed too at tp > 1), bf16, AC off; per GPU = tokens/s against tp1's
bench tp1_compile 260 1 0 "--warmup 2" train.max_steps=6 $bf16 model.activation_checkpointing=false model.compile=true
for tp in 2 4; do
  bench fake_tp${tp}_graphs 200 1 0 "--warmup 3 --fake-world $tp" train.max_steps=7 $bf16 \
    model.activation_checkpointing=false model.compile=true model.cuda_graphs=true mesh.tp=$tp
done ;;
fake_tp_sp_graphs)  # tensor parallel's ceiling with sequence parallelism: one GPU compiled, then rank 0 of fake tp2 and tp4 worlds compiled
# with CUDA graphs, each with mesh.sequence_parallel=true (the norms and residual adds on 1/tp of the tokens); the fake
# world fills every collective's output from the rank's own data (fake_pg.LocalCopyGroup), so the losses are finite
# but not a real run's, and can grow past bf16's range through the layers: train.on_nonfinite=skip keeps such a step
# timed (its optimizer step skipped, 1-2% of a step; the log's "step N skipped" lines say which); per GPU = tokens/s
# against tp1's. FAKE_TPS (default "2 4") picks the worlds, FAKE_SP (default "true") sequence parallelism on or off
# for each (FAKE_SP="true false": both, named fake_tpN_sp_graphs and fake_tpN_graphs); the limits allow a cold
# machine's compiles. Ten steps, the last five timed: a graphed fake world's step can keep getting faster for several
# steps after the first. FAKE_TP1=false leaves out the tp1 run (one this call made already)
[ "${FAKE_TP1:-true}" = true ] && bench tp1_compile 250 1 0 "--warmup 2" train.max_steps=6 $bf16 \
  model.activation_checkpointing=false model.compile=true
for tp in ${FAKE_TPS:-2 4}; do
  for sp in ${FAKE_SP:-true}; do
    bench fake_tp${tp}$([ "$sp" = true ] && echo _sp)_graphs 250 1 0 "--warmup 5 --fake-world $tp" train.max_steps=10 \
      $bf16 model.activation_checkpointing=false model.compile=true model.cuda_graphs=true mesh.tp=$tp \
      mesh.sequence_parallel=$sp train.on_nonfinite=skip
  done
done ;;
fake_tp_targets)  # tensor parallel's two targets in one call, each layout at its fastest setting: tp1 compiled, then
# rank 0 of a fake tp2 world compiled without CUDA graphs or sequence parallelism (graphs cost there: the graphs'
# input copies and fla's fixed layouts outweigh the host time they save on a tp2 shard), then rank 0 of a fake tp4
# world compiled with CUDA graphs and sequence parallelism (its shard is host-bound without the graphs); bf16, AC off,
# ten steps, the last five timed; prints each rank's tokens/s per GPU against tp1's. The limits allow a cold machine
bench tp1_compile 250 1 0 "--warmup 2" train.max_steps=6 $bf16 model.activation_checkpointing=false model.compile=true
bench fake_tp2_compiled 200 1 0 "--warmup 5 --fake-world 2" train.max_steps=10 $bf16 \
  model.activation_checkpointing=false model.compile=true mesh.tp=2 train.on_nonfinite=skip
bench fake_tp4_sp_graphs 250 1 0 "--warmup 5 --fake-world 4" train.max_steps=10 $bf16 \
  model.activation_checkpointing=false model.compile=true model.cuda_graphs=true mesh.tp=4 \
  mesh.sequence_parallel=true train.on_nonfinite=skip
python - "$out" <<'PY'
import json, pathlib, sys
runs = {p.stem: json.loads(p.read_text()) for p in pathlib.Path(sys.argv[1]).glob("*.json")}
one = runs["tp1_compile"]["tokens_per_sec_per_gpu"]
for name, target in (("fake_tp2_compiled", 95), ("fake_tp4_sp_graphs", 90)):
    if name in runs:
        share = 100 * runs[name]["tokens_per_sec_per_gpu"] / one
        print(f"{name}: {runs[name]['step_time_s']:.4f} s/step, {share:.2f}% of tp1 per GPU (target {target}%)")
PY
;;
fake_tp_ab)  # a change's effect on one tp rank: rank 0 of a fake tp4 world (FAKE_TP), compiled with CUDA graphs
# (FAKE_GRAPHS=false: without, tp2's fastest), bf16, AC off, without sequence parallelism (FAKE_SP=true: with), on
# this tree and on FAKE_OLD (a tree of the older commit: `git archive COMMIT qwenft scripts recipes | tar -x -C DIR`)
# in turn: this tree, the older, this tree again, after tp1 (this tree) for the per-GPU ratios. The first run
# compiles; the two of this tree bracket the older one's machine state
tp=${FAKE_TP:-4}; sp=${FAKE_SP:-false}; graphs=${FAKE_GRAPHS:-true}
: "${FAKE_OLD:?FAKE_OLD: a tree of the older commit (git archive COMMIT qwenft scripts recipes | tar -x -C DIR)}"
old=$(cd "$FAKE_OLD" && pwd) || exit 1
[ "${FAKE_TP1:-true}" = true ] && bench tp1_compile 250 1 0 "--warmup 2" train.max_steps=6 $bf16 \
  model.activation_checkpointing=false model.compile=true  # FAKE_TP1=false: a tp1 run this call made already
for run in new old new_again; do
  (cd "$([ $run = old ] && echo "$old" || pwd)" && bench fake_tp${tp}_$run 250 1 0 "--warmup 5 --fake-world $tp" \
    train.max_steps=10 $bf16 model.activation_checkpointing=false model.compile=true model.cuda_graphs=$graphs \
    mesh.tp=$tp mesh.sequence_parallel=$sp train.on_nonfinite=skip)
done ;;
tp_weight_grad)  # a tp rank's weight gradients added inside its shards' matmuls (model.kernels.weight_grad=in_matmul,
# auto's choice) against autograd's adds, rank 0 of a fake tp2 world with sequence parallelism, compiled, bf16, AC
# off; then the same layout with CUDA graphs and autograd's adds (fake_tp_sp_graphs runs auto's in_matmul), then
# autograd's adds without CUDA graphs (the first that DEADLINE cuts), and tp1 compiled first for the per-GPU ratio.
# The limits allow a cold machine's compiles in the first two runs
bench tp1_compile 250 1 0 "--warmup 2" train.max_steps=6 $bf16 model.activation_checkpointing=false model.compile=true
bench fake_tp2_sp_in_matmul 250 1 0 "--warmup 5 --fake-world 2" train.max_steps=10 $bf16 \
  model.activation_checkpointing=false model.compile=true mesh.tp=2 mesh.sequence_parallel=true \
  model.kernels.weight_grad=in_matmul train.on_nonfinite=skip
bench fake_tp2_sp_graphs_autograd 200 1 0 "--warmup 5 --fake-world 2" train.max_steps=10 $bf16 \
  model.activation_checkpointing=false model.compile=true model.cuda_graphs=true mesh.tp=2 mesh.sequence_parallel=true \
  model.kernels.weight_grad=autograd train.on_nonfinite=skip
bench fake_tp2_sp_autograd 150 1 0 "--warmup 5 --fake-world 2" train.max_steps=10 $bf16 \
  model.activation_checkpointing=false model.compile=true mesh.tp=2 mesh.sequence_parallel=true \
  model.kernels.weight_grad=autograd train.on_nonfinite=skip ;;
gpu_tests_model)  # the GPU tier in three parts (this, gpu_tests_kernels, cp_tests), each one call from a cold start:
# every test has a limit of its own (tests/gpu/conftest.py), so a slow compile fails that test and the rest run; the
# KILL limit is the last resort (SIGTERM would make a training test checkpoint and stop, and loses the log's tail).
# A cold machine spends most of the call compiling fla's, TileLang's and inductor's kernels, each process alone on
# one CPU core: the tests run in 4 worker processes (pytest-xdist), so their compiles overlap. This part: the tiny
# model on CUDA, qwenft's Triton kernels and cuDNN's attention by document piece
PYTHONUNBUFFERED=1 timeout -s KILL 540 python -m pytest -v -rA -p no:cacheprovider -n 4 --dist load \
  tests/gpu/test_cuda_model.py tests/gpu/test_kernels.py tests/gpu/test_cudnn_pieces.py \
  > "$out/test_cuda_model.log" 2>&1
echo "=== test_cuda_model rc=$? $(date +%T)"; grep -E "PASSED|FAILED|SKIPPED|ERROR|Timeout" "$out/test_cuda_model.log" | tail -40 ;;
gpu_tests_kernels)  # fla and varlen attention on packed rows, a worker process per test (fla's fp32 and bf16
# kernels compile side by side; the fp32 graph replay compiles for four layouts)
PYTHONUNBUFFERED=1 timeout -s KILL 560 python -m pytest -v -rA -p no:cacheprovider -n 5 --dist load \
  tests/gpu/test_packed_kernels.py > "$out/test_packed_kernels.log" 2>&1
echo "=== test_packed_kernels rc=$? $(date +%T)"; grep -E "PASSED|FAILED|SKIPPED|ERROR|Timeout" "$out/test_packed_kernels.log" | tail -20 ;;
multi_gpu_tests)  # on 2 GPUs: every layout over NCCL against one GPU, 20 steps each, and tp ranks' replicated
# parameters bit-identical (tests/gpu/test_multi_gpu.py: each run a torchrun of its own, 11 in all); each loss gap
# against its bound goes to multi_gpu_tolerances.jsonl
QWENFT_TEST_TOLERANCE_LOG="$out/multi_gpu_tolerances.jsonl" PYTHONUNBUFFERED=1 timeout -s KILL 560 python -m pytest -v \
  -rA -p no:cacheprovider tests/gpu/test_multi_gpu.py > "$out/test_multi_gpu.log" 2>&1
echo "=== test_multi_gpu rc=$? $(date +%T)"
# a KILLed pytest leaves its torchrun's workers running (each in a session of its own), holding the GPUs
pkill -9 -f "tests/gpu/multi_gpu_rank.py" 2>/dev/null
grep -E "PASSED|FAILED|SKIPPED|ERROR|Timeout|rank\(s\)|worst loss gap|differ" "$out/test_multi_gpu.log" | tail -60 ;;
cp)  # context parallel's ceiling, then the cp kernels' tests: one GPU at 32,768 tokens a row against fake cp4 worlds at
# 131,072 (the same 32,768 tokens a rank), played as the first span (rank 0) and as the last (the heaviest
# attention), AC on, bf16, eager, each row one document (long_rows.py: the worst case for contiguous spans'
# attention). A fresh machine compiles fla's kernels, the cp ones too, in the first run's first step (about 4 min).
python scripts/long_rows.py "$out/long.jsonl" --rows 4 --words 180000
long="data.path=$out/long.jsonl train.global_batch_size=1 data.cache_dir=$out/cache $bf16 model.activation_checkpointing=true"
bench fake_cp4_128k 300 1 0 "--warmup 1 --fake-world 4" train.max_steps=4 $long data.seq_len=131072 mesh.cp=4 \
  mesh.cp_balanced_attention=false
bench fake_cp4_128k_last_span 90 1 0 "--warmup 1 --fake-world 4 --fake-cp-rank 3" train.max_steps=4 $long \
  data.seq_len=131072 mesh.cp=4 mesh.cp_balanced_attention=false
# attention by halves (mesh.cp_balanced_attention): every span's rank computes one early and one late half, the same
# work whichever span it plays
bench fake_cp4_128k_balanced 90 1 0 "--warmup 1 --fake-world 4 --fake-cp-rank 3" train.max_steps=4 $long \
  data.seq_len=131072 mesh.cp=4 mesh.cp_balanced_attention=true
bench one_gpu_32k 90 1 0 "--warmup 1" train.max_steps=4 $long data.seq_len=32768 ;;
cp_balanced)  # attention by halves at 131,072 tokens a row (fake cp4, the last span's rank: a balanced rank does the
# same work whichever span it plays) against one GPU at 32,768, each with auto's attention kernel (cuDNN by document
# piece for these one-document rows) and with the varlen flash kernel (FlashAttention 2); the first run compiles
# fla's kernels on a fresh machine, the one-GPU runs the unsplit ones. BUDGET_S caps the whole part.
start=$(date +%s)
python scripts/long_rows.py "$out/long.jsonl" --rows 4 --words 180000
long="data.path=$out/long.jsonl train.global_batch_size=1 data.cache_dir=$out/cache $bf16 model.activation_checkpointing=true"
bench fake_cp4_128k_balanced 270 1 0 "--warmup 1 --fake-world 4 --fake-cp-rank 3" train.max_steps=4 $long \
  data.seq_len=131072 mesh.cp=4 mesh.cp_balanced_attention=true
bench one_gpu_32k 150 1 0 "--warmup 1" train.max_steps=4 $long data.seq_len=32768
bench fake_cp4_128k_balanced_flash 80 1 0 "--warmup 1 --fake-world 4 --fake-cp-rank 3" train.max_steps=4 $long \
  data.seq_len=131072 mesh.cp=4 mesh.cp_balanced_attention=true model.kernels.attention=flash_varlen
bench one_gpu_32k_flash $((${BUDGET_S:-590} - $(date +%s) + start)) 1 0 "--warmup 1" train.max_steps=4 $long \
  data.seq_len=32768 model.kernels.attention=flash_varlen ;;
cp_profile)  # where the balanced cp4 rank's step goes against one GPU's at 32,768 (both cuDNN by piece, AC on), then
# both with selective checkpointing (which keeps attention's outputs instead of running its forward again); the
# profiler's post-processing takes about a minute a run; on a fresh machine the first two runs compile fla's cp and
# unsplit kernels (about 4 and 2.5 min): set DEADLINE, and run the selective pair again in the next (warm) call
python scripts/long_rows.py "$out/long.jsonl" --rows 4 --words 180000
long="data.path=$out/long.jsonl train.global_batch_size=1 data.cache_dir=$out/cache $bf16"
bench cp4_balanced_profile 330 1 0 "--warmup 1 --fake-world 4 --fake-cp-rank 3 --profile $out/cp4_balanced.txt" \
  train.max_steps=3 $long data.seq_len=131072 mesh.cp=4 model.activation_checkpointing=true
bench one_gpu_32k_profile 200 1 0 "--warmup 1 --profile $out/one_gpu_32k.txt" train.max_steps=3 $long \
  data.seq_len=32768 model.activation_checkpointing=true
bench cp4_balanced_selective 60 1 0 "--warmup 1 --fake-world 4 --fake-cp-rank 3" train.max_steps=4 $long \
  data.seq_len=131072 mesh.cp=4 model.activation_checkpointing=selective
bench one_gpu_32k_selective 60 1 0 "--warmup 1" train.max_steps=4 $long data.seq_len=32768 \
  model.activation_checkpointing=selective ;;
cp_one_gpu)  # cp_balanced's one-GPU runs alone: 32,768 tokens a row, auto's kernel (cuDNN) and the varlen flash kernel
python scripts/long_rows.py "$out/long.jsonl" --rows 4 --words 180000
long="data.path=$out/long.jsonl train.global_batch_size=1 data.cache_dir=$out/cache $bf16 model.activation_checkpointing=true"
bench one_gpu_32k 170 1 0 "--warmup 1" train.max_steps=4 $long data.seq_len=32768
bench one_gpu_32k_flash 80 1 0 "--warmup 1" train.max_steps=4 $long data.seq_len=32768 model.kernels.attention=flash_varlen ;;
fp8)  # float8 matmuls (torchao, which the GPU kit lacks: unzip its wheel into a directory on PYTHONPATH first) against bf16, AC off,
# compiled, bf16 numerics; the first run compiles fla's and inductor's kernels. FP8_RECIPES picks the recipes.
bench bf16_ac_off_compile 200 1 0 "--warmup 2" train.max_steps=6 $bf16 model.activation_checkpointing=false \
  model.compile=true
for recipe in ${FP8_RECIPES:-tensorwise rowwise rowwise_with_gw_hp}; do
  bench "fp8_${recipe}_ac_off_compile" 130 1 0 "--warmup 2" train.max_steps=6 $bf16 \
    model.activation_checkpointing=false model.compile=true model.fp8=$recipe
done ;;
weight_grad)  # the weight gradients added inside the matmuls that form them (model.kernels.weight_grad=in_matmul, the
# one-GPU default) against autograd's adds after them, bf16 numerics, AC off, compiled; then both with
# model.fp8=tensorwise (torchao on PYTHONPATH as for fp8). The first run pays a cold machine's compiles; the part
# stops if it fails. Last, qwenft's kernel tests that in_matmul's rounding is as close to fp32 as autograd's
bench bf16_in_matmul 270 1 0 "--warmup 2" train.max_steps=6 $bf16 model.activation_checkpointing=false \
  model.compile=true model.kernels.weight_grad=in_matmul
[ -f "$out/bf16_in_matmul.json" ] || { tail -30 "$out/bf16_in_matmul.log"; exit 1; }
bench bf16_autograd 100 1 0 "--warmup 2" train.max_steps=6 $bf16 model.activation_checkpointing=false \
  model.compile=true model.kernels.weight_grad=autograd
for mode in in_matmul autograd; do
  bench fp8_tensorwise_$mode 110 1 0 "--warmup 2" train.max_steps=6 $bf16 model.activation_checkpointing=false \
    model.compile=true model.fp8=tensorwise model.kernels.weight_grad=$mode
done
PYTHONUNBUFFERED=1 timeout -s KILL 240 python -m pytest -q -rA -p no:cacheprovider \
  tests/gpu/test_kernels.py -k "scale_add or weight_grad" > "$out/test_weight_grad.log" 2>&1
echo "=== weight_grad tests rc=$? $(date +%T)"; grep -E "PASSED|FAILED|passed|failed" "$out/test_weight_grad.log" | tail -5 ;;
fp8_numerics)  # 300 steps of the 0.8B shape from one init on one data order: bf16 against each float8 recipe, AC
# off, compiled; the loss curves go to $out/<run>.metrics.jsonl (FP8_RECIPES picks the recipes, off = bf16). The
# data is a Markov chain of 8 successors a word (long_rows.py): its loss has a floor of about ln 8 a word, where the
# tiny chat set's falls to zero within 300 steps, too low for a comparison in percent. The runs share the GPU, all at
# once: their losses, not their times, are what this part measures (each run alone: about 70 s of compile on a warm
# machine, then about 50 s for the 300 steps)
python scripts/long_rows.py "$out/markov.jsonl" --rows 3000 --words 1100 --successors 8
limit=$(limit_by_deadline 330)
for recipe in ${FP8_RECIPES:-off tensorwise rowwise rowwise_with_gw_hp}; do
  name="numerics_0_8b_fp8_$recipe"
  (echo "=== $name $(date +%T)"
   timeout -s KILL "$limit" python -m qwenft train recipe=tiny model=qwen3_5_0_8b data.path="$out/markov.jsonl" \
     data.cache_dir="$out/cache_$recipe" train.progress_bar=false data.seq_len=1024 train.global_batch_size=8 \
     train.micro_batch_size=8 train.max_steps=300 optim.lr=3e-4 lr_scheduler.warmup_steps=20 \
     model.activation_checkpointing=false model.compile=true model.fp8=$recipe checkpoint.export_hf=false \
     run_dir="$out/runs/$name" > "$out/$name.log" 2>&1
   echo "=== $name rc=$? $(date +%T)"; tail -2 "$out/$name.log"
   cp "$out/runs/$name/metrics.jsonl" "$out/$name.metrics.jsonl" 2>/dev/null) &
done
wait ;;
cp_tests)  # fla's cp kernels against the unsplit ones: each spawned rank compiles fla's kernels on a fresh machine,
# so the tests run in worker processes of their own (pytest-xdist), cp2's and cp4's compiles side by side
PYTHONUNBUFFERED=1 timeout -s KILL 540 python -m pytest -v -rA -p no:cacheprovider -n 4 --dist load tests/gpu/test_cp_kernels.py \
  > "$out/test_cp_kernels.log" 2>&1
echo "=== test_cp_kernels rc=$? $(date +%T)"; grep -E "PASSED|FAILED|SKIPPED|Error|assert" "$out/test_cp_kernels.log" | tail -20 ;;
mtp)  # the MTP head's cost: the benchmark without (keep) and with a trained head (train), bf16 numerics, AC on; the
# first run compiles fla's kernels on a fresh machine
bench mtp_keep 230 1 0 "--warmup 1" train.max_steps=4 $bf16 model.mtp=keep
bench mtp_train 90 1 0 "--warmup 1" train.max_steps=4 $bf16 model.mtp=train ;;
*) echo "unknown part $part: $parts" >&2
   exit 2 ;;
esac
