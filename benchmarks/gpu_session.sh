#!/usr/bin/env bash
# One device-machine call that runs the GPU checks and benchmarks in order, each under its own
# time limit, logging to $OUT/<step>.log and printing a short summary last (the reply carries the
# tail). Steps: env, kernels, triton, tlx, tlx_parity, host, sweep_tlx, sweep_triton, bench, bench_quick,
# compare.
# Run from the repo root after benchmarks/gpu_install.sh (PYTHONPATH=/tmp/site:/tmp/site0).
#     bash benchmarks/gpu_session.sh env kernels triton tlx bench_quick
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
# In-process inductor compiles: its compile subprocesses failed under fbtriton on torch 2.11 (first H200 run).
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:-}:$PWD" TORCHINDUCTOR_COMPILE_THREADS=1
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
    env) step env 120 bash -c 'nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv; python3 -c "import torch, triton, sys; print(sys.version); print(torch.__version__, torch.version.cuda, triton.__version__, triton.__file__); import triton.language.extra.tlx; print(\"tlx ok\")"; python3 -c "import torchrec, datasets, lightning, jsonargparse; print(\"torchrec\", torchrec.__version__, \"datasets\", datasets.__version__, \"lightning\", lightning.__version__)"' ;;
    kernels) step kernels 300 python3 -m pytest -q -x tests/test_kernels.py -p no:cacheprovider ;;
    triton) step triton 420 python3 benchmarks/gpu_check_triton.py --out "$OUT/parity_triton.json" ;;
    tlx) step tlx 420 python3 benchmarks/gpu_check_tlx.py ;;
    tlx_parity) step tlx_parity 420 python3 benchmarks/gpu_check_triton.py --backend tlx --out "$OUT/parity_tlx.json" ;;
    host) step host 300 python3 benchmarks/host_profile.py --out "$OUT/host_profile.json" ;;
    sweep_tlx) step sweep_tlx 420 python3 benchmarks/sweep_tlx.py --out "$OUT/sweep_tlx.json" ${SWEEP_VARIANTS:+--variants "$SWEEP_VARIANTS"} ;;
    sweep_triton) step sweep_triton 420 python3 benchmarks/gpu_check_triton.py --sweep --out "$OUT/sweep_triton.json" ;;
    compare) step compare 580 bash -c 'python3 train.py compare --attn tlx triton fa2 reference --config configs/gpu.yaml --steps 200 --seeds 2 --out /tmp/compare_h200 --data.num_train=409600 --data.num_val=32768 --trainer.val_check_interval=100 && cp /tmp/compare_h200/compare.md /tmp/compare_h200/compare.json /tmp/compare_h200/loss_curves.png "$OUT"/' ;;
    bench_quick) step bench_quick 480 python3 -m benchmarks.bench_attention --quick --out "$OUT/attention_quick" ;;
    bench) step bench 590 python3 -m benchmarks.bench_attention --out "$OUT/attention_h200" --graph --impls fa2,cudnn,mem_efficient,triton,tlx,tlx+separate_rotary --shapes full,jagged ;;
    *) echo "unknown step $s"; exit 2 ;;
  esac
done
for line in "${summary[@]}"; do echo "$line"; done
