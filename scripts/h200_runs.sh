#!/usr/bin/env bash
# The H200 measurements docs/performance.md and docs/performance-log.md still lack, in one go on a 2-GPU box
# (with the GPU kit: source .gpu-kit/use-kit.sh first). Single-GPU runs go two at a time, one per GPU.
#
#   bash scripts/h200_runs.sh two_gpu|one_gpu|profile [OUT_DIR]   # OUT_DIR (default /tmp/h200): JSON + logs
#
# Each run is scripts/bench.py on the 27B shape cut to 8 layers (seq 4096, global batch 8, micro batch 1).
# Planned peaks for the same overrides come from `qwenft plan` on any CPU. The first step of a new layout
# compiles fla/TileLang kernels (up to ~150 s), hence the generous limits; each part stays under 10 minutes.
set -u
part=${1:?which part: two_gpu, one_gpu or profile}
out=${2:-/tmp/h200}
mkdir -p "$out"
base="recipe=tiny model=qwen3_5_27b model.num_layers=8 data.seq_len=4096 train.global_batch_size=8
      train.micro_batch_size=1 lr_scheduler.warmup_steps=0 optim.lr=1e-5"

bench() {  # name limit_s nproc gpus bench-args overrides...
  local name=$1 limit=$2 nproc=$3 gpus=$4 bargs=$5
  shift 5
  echo "=== $name $(date +%T)"
  # shellcheck disable=SC2086
  CUDA_VISIBLE_DEVICES=$gpus timeout "$limit" torchrun --nproc-per-node "$nproc" \
    --master-port $((29500 + RANDOM % 1000)) scripts/bench.py $bargs --json "$out/$name.json" $base "$@" \
    run_dir="$out/runs/$name" > "$out/$name.log" 2>&1
  echo "=== $name rc=$? $(date +%T)"
  [ -f "$out/$name.json" ] && cat "$out/$name.json"
}

case $part in
two_gpu)
bench dp2_knob_off 270 2 0,1 "--warmup 1" train.max_steps=4 mesh.dp=2 pipeline.reduce_grad_per_microbatch=false
bench tp2_vocab_parallel 270 2 0,1 "--warmup 1" train.max_steps=4 mesh.tp=2 ;;
one_gpu)  # one GPU each, two at a time
(bench ac_off 240 1 0 "--warmup 2" train.max_steps=6 model.activation_checkpointing=false
 bench compile 300 1 0 "--warmup 2" train.max_steps=6 model.compile=true) &
(bench memory_options 240 1 1 "--warmup 2" train.max_steps=6 optim.state_dtype=bfloat16 \
   optim.master_dtype=bfloat16 model.ce_chunk_tokens=1024 pipeline.reduce_grad_per_microbatch=true
 bench ac_selective 240 1 1 "--warmup 2" train.max_steps=6 model.activation_checkpointing=selective) &
wait ;;
profile)  # the kernel breakdown of the current code (the profiler's post-processing alone took over 45 s)
bench profile 420 1 0 "--warmup 1 --profile $out/profile.txt" train.max_steps=3 ;;
*) echo "unknown part $part: two_gpu, one_gpu or profile" >&2; exit 2 ;;
esac

