#!/usr/bin/env bash
# One device-machine call that runs GPU steps in order, each under its own time limit, logging to
# $OUT/<step>.log and printing a short summary last (the reply carries the tail). Run from the repo
# root after scripts/gpu_install.sh (PYTHONPATH=/tmp/site:/tmp/site0):
#     bash scripts/gpu_session.sh env parity smoke
# Steps: env, parity, smoke, bench, profile, profile_eager, compare, sharded.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
# In-process inductor compiles: its compile subprocesses failed under fbtriton on torch 2.11 (first H200 run).
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:-}:$PWD" TORCHINDUCTOR_COMPILE_THREADS=1
# The comparison and the profile share one data cache and one inductor cache across their runs.
GPU_DATA=(--config configs/gpu.yaml --data.data_dir=/tmp/data_cache)
summary=()
step() {  # name, seconds, command...
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  summary+=("$name rc=$rc $((SECONDS - start))s :: $(grep -E 'passed|failed|PASS|FAIL|Error|error' "$OUT/$name.log" | tail -2 | tr '\n' ' ' | cut -c1-300)")
}
for s in "$@"; do
  case $s in
    env) step env 120 bash -c 'nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv; python3 -c "import torch, triton, sys; print(sys.version); print(torch.__version__, torch.version.cuda, triton.__version__, triton.__file__); import triton.language.extra.tlx; print(\"tlx ok\")"; python3 -c "import torchrec, datasets, lightning, jsonargparse, fbgemm_gpu; print(\"torchrec\", torchrec.__version__, \"datasets\", datasets.__version__, \"lightning\", lightning.__version__, \"fbgemm_gpu\", fbgemm_gpu.__file__)"' ;;
    parity) step parity 420 python3 -m pytest -m gpu -v -s -p no:cacheprovider tests/test_gpu_parity.py ;;
    smoke) step smoke 300 python3 train.py "${GPU_DATA[@]}" --data.num_train=65536 --data.num_val=8192 --trainer.max_steps=30 --trainer.val_check_interval=30 --run_name=smoke --runs_dir=/tmp/runs ;;
    bench) step bench 590 python3 -m benchmarks.bench_attention --out "$OUT/attention_h200" --graph --impls fa2,triton,tlx --shapes full,jagged ;;
    profile) step profile 580 python3 -m benchmarks.profile_step "${GPU_DATA[@]}" --data.num_train=131072 --data.num_val=2048 --warmup 15 --steps 8 --attn tlx triton fa2 reference --out "$OUT/profile_step_h200" ;;
    profile_eager) step profile_eager 400 python3 -m benchmarks.profile_step "${GPU_DATA[@]}" --data.num_train=131072 --data.num_val=2048 --warmup 15 --steps 8 --model.net.compile=false --model.net.pad_tokens_to=0 --attn tlx fa2 --out "$OUT/profile_step_eager_h200" ;;
    compare) step compare 590 bash -c 'python3 train.py compare --attn tlx triton fa2 reference "${@}" --steps 1000 --seeds 3 --out /tmp/compare_h200 --data.num_val=16384 --trainer.val_check_interval=500; cp /tmp/compare_h200/compare.md /tmp/compare_h200/compare.json /tmp/compare_h200/loss_curves.png "$OUT"/ 2>/dev/null; true' _ "${GPU_DATA[@]}" ;;
    sharded) step sharded 580 python3 -m torch.distributed.run --standalone --nproc-per-node 1 train.py "${GPU_DATA[@]}" --config configs/sharded.yaml --trainer.devices=1 --runs_dir=/tmp/runs ;;
    *) echo "unknown step $s"; exit 2 ;;
  esac
done
for line in "${summary[@]}"; do echo "$line"; done
