#!/usr/bin/env bash
# One device-machine call that runs GPU steps in order, each under its own time limit, logging to
# $OUT/<step>.log and printing a short summary last (the reply carries the tail). Run from the repo
# root after scripts/gpu_install.sh (PYTHONPATH=/tmp/site:/tmp/site0):
#     bash scripts/gpu_session.sh env parity smoke
# Steps: env, graphed_optimizer, parity, smoke (SMOKE_ATTN, default tlx), bench, mlp_bench, mlp_gelu, mlp_gelu_parity, profile_mlp_gelu, attention_bench, profile_mlp, profile_attention, profile_cuda_graph, profile_attention_blocks, profile_deterministic, profile, profile_sharded, trace_reads, profile_eager, sharding_cuda, compare_start,
# compare_wait, sharded, quality_start, history_start, quality_wait, host_c_cache, parity_c_cache, profile_c_path,
# profile_eager_c_path, profile_vs_base.
# compare_start starts (or resumes) the comparison, longer than one call may run, in its own process
# session, which outlives the call while the machine stays warm; compare_wait, in later calls, waits
# for it (COMPARE_WAIT_S, default 570 s) and copies its report, or the runs so far, to $OUT.
# quality_start / quality_wait do the same for issue 23's tuning (benchmarks/quality.py tune) on MovieLens-1M,
# whose raw files come from scripts/pack_ml1m.sh's pack, carried into /tmp by a call of its own (see that script);
# history_start, waited for by quality_wait too, trains the time split's comparisons (scripts/time_split_compare.sh; no tuning).
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
# In-process inductor compiles: its compile subprocesses failed under fbtriton on torch 2.11 (first H200 run).
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:-}:$PWD" TORCHINDUCTOR_COMPILE_THREADS=1
# The comparison and the profile share one data cache and one inductor cache across their runs.
GPU_DATA=(--config configs/gpu.yaml --data.data_dir=/tmp/data_cache)
# The sharded path as the comparison's variant runs it: torchrec DMP, fbgemm's fused Adam on the tables.
SHARDED_CONFIGS=(--config configs/sharded.yaml --config configs/sharded_adam.yaml)
# benchmarks.profile_step as the profile steps run it: 131,072 training samples, 12 warmup steps, 6 timed, 6 profiled.
PROFILE_STEP=(python3 -m benchmarks.profile_step "${GPU_DATA[@]}" --data.num_train=131072 --data.num_val=2048 --warmup 12 --steps 6)
summary=()
# Result files are named for the card that made them (h100, h200): a session asking for an H200 may get an H100.
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -o -i 'h[0-9]00' | tr 'A-Z' 'a-z')
GPU=${GPU:-gpu}
ml1m_data() {  # unpacks the carried MovieLens-1M pack into the data cache once; fails when there is none
  mkdir -p /tmp/data_cache
  local pack; pack=$(ls /tmp/ml1m_raw.tar.xz .gpu-data/ml1m_raw.tar.xz 2>/dev/null | head -1)
  [[ -f /tmp/data_cache/raw/ml-1m/ml-1m.inter || -z $pack ]] || tar xJf "$pack" -C /tmp/data_cache
  [[ -f /tmp/data_cache/raw/ml-1m/ml-1m.inter ]]
}
c_path() {  # 0 or 1: the environment that turns fbtriton's C launch path off or on (train.py's C_LAUNCH_ENVIRONMENT)
  echo "TRITON_ENABLE_C_CACHE=$1 TRITON_USE_C_DISPATCHER=$1"
}
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
    # CUDAGraphAdamW's real graphs on the GPU (beside an eager model and one in torch.compile's CUDA graphs).
    graphed_optimizer) step graphed_optimizer 300 python3 -m pytest -m gpu -v -p no:cacheprovider tests/test_graphed_optimizer.py ;;
    parity) step parity 420 python3 -m pytest -m gpu -v -s -p no:cacheprovider tests/test_gpu_parity.py ${PARITY_K:+-k "$PARITY_K"} ;;
    smoke) step smoke_${SMOKE_ATTN:-tlx} 300 python3 train.py "${GPU_DATA[@]}" --attn=${SMOKE_ATTN:-tlx} --data.num_train=65536 --data.num_val=8192 --trainer.max_steps=30 --trainer.val_check_interval=30 --run_name=smoke --runs_dir=/tmp/runs ;;
    bench) step bench 590 python3 -m benchmarks.bench_attention --out "$OUT/attention_$GPU" --graph --impls fa2,triton,tlx --shapes full,jagged ;;
    # PROFILE_ATTN (default every backend but flex) and PROFILE_ARGS (profile_step's options, e.g. --trace, and
    # train.py's, which it passes on) as profile_vs_base takes them.
    # With --trace, each backend's timeline is read here too (profile_step idle), in case it is too large to come back.
    profile) step profile 530 "${PROFILE_STEP[@]}" --attn ${PROFILE_ATTN:-tlx triton fa2 reference} ${PROFILE_ARGS:-} \
      --out "$OUT/profile_step_$GPU"
      for trace in "$OUT"/profile_step_$GPU.*.trace.json.gz; do
        [[ -f $trace ]] && python3 -m benchmarks.profile_step idle "$trace" 3 > "${trace%.trace.json.gz}.idle.txt" 2>&1
      done ;;
    # The fused MLP sublayer against today's unfused one (eager and compiled), at the gpu config's token count.
    # (Variant rows were all slower than the defaults: the tiles plans, tile sizes and stages in
    # mlp_sublayer_h200.md, the GEMMs as persistent programs in mlp_sublayer_h100.md, the hidden-gradient GEMM
    # as a TLX warp-specialized kernel in mlp_tlx_hidden_grad_h{100,200}.md; pass --variant to add one.)
    mlp_bench) step mlp_bench 500 python3 -m benchmarks.bench_sublayer --sublayer mlp --out "$OUT/mlp_sublayer_$GPU" --profile ;;
    # The MLP sublayer with exact GELU, then its tanh form (model.net.mlp_gelu=tanh: the kernels' hardware tanh), every
    # row in both, back to back; mlp_gelu_parity: the tanh form's GPU parity, opcheck, and every TLX knob's parity in
    # both forms.
    mlp_gelu) for gelu in none tanh; do
        step mlp_gelu_$gelu 400 python3 -m benchmarks.bench_sublayer --sublayer mlp --mlp-gelu $gelu --profile \
          --out "$OUT/mlp_sublayer_gelu_${gelu}_$GPU"
      done ;;
    # The tlx step with exact GELU unfused, then the tanh form unfused and with the fused MLP, back to back.
    profile_mlp_gelu) for run in "none false" "tanh false" "tanh true"; do read -r gelu fused <<< "$run"
        step profile_mlp_gelu_${gelu}_fused_$fused 450 "${PROFILE_STEP[@]}" --attn tlx --model.net.mlp_gelu=$gelu \
          --model.net.fused_mlp=$fused --out "$OUT/profile_step_mlp_gelu_${gelu}_fused_mlp_${fused}_$GPU"
      done ;;
    mlp_gelu_parity) step mlp_gelu_parity 420 python3 -m pytest -m gpu -v -s -p no:cacheprovider tests/test_gpu_parity.py \
        -k "(test_mlp_parity and tanh) or mlp_custom_ops or mlp_parity_variants" ;;
    # The fused attention sublayer against today's unfused one (on the tlx attention kernel), at the gpu config's token count.
    # Variant rows: the per-block kernels ("blocks" plan), the Triton backend's and the tlx backend's, each
    # pass alone (beside the default plan's other pass) and both.
    attention_bench) step attention_bench 500 python3 -m benchmarks.bench_sublayer --sublayer attention --out "$OUT/attention_sublayer_$GPU" --profile \
        --variant triton_blocks triton '{"fwd": {"plan": "blocks"}, "bwd": {"plan": "blocks"}}' \
        --variant triton_blocks_fwd triton '{"fwd": {"plan": "blocks"}}' \
        --variant triton_blocks_bwd triton '{"bwd": {"plan": "blocks"}}' \
        --variant tlx_blocks tlx '{"fwd": {"plan": "blocks"}, "bwd": {"plan": "blocks"}}' \
        --variant tlx_blocks_fwd tlx '{"fwd": {"plan": "blocks"}}' \
        --variant tlx_blocks_bwd tlx '{"bwd": {"plan": "blocks"}}' ;;
    # Host cost of eager calls (issue 22): fbtriton's opt-in C launch path (TRITON_ENABLE_C_CACHE: the kernel lookup
    # in C, read when a kernel is defined; TRITON_USE_C_DISPATCHER: the launch in C) against Triton's Python one,
    # on both sublayers' eager and graph times, back to back; parity_c_cache: the parity tests under the C path.
    host_c_cache) for sublayer in attention mlp; do for c in 0 1; do
        step ${sublayer}_c_cache_$c 300 env $(c_path $c) python3 -m benchmarks.bench_sublayer \
          --sublayer $sublayer --impls unfused_compiled triton tlx --out "$OUT/${sublayer}_sublayer_c_cache_${c}_$GPU"
      done; done ;;
    parity_c_cache) step parity_c_cache 420 env $(c_path 1) python3 -m pytest -m gpu -q -p no:cacheprovider \
        tests/test_gpu_parity.py -k "${PARITY_K:-not blocks_plan}" ;;
    # The step with a switch on and off, back to back on one machine: one fused sublayer (model.net.fused_mlp,
    # model.net.fused_attention; PROFILE_ATTN default tlx triton), or the optimizer's CUDA graph
    # (model.optim.cuda_graph; default tlx). PROFILE_ARGS as the profile step takes them.
    profile_mlp|profile_attention|profile_cuda_graph)
      case $s in profile_cuda_graph) key=model.optim.cuda_graph attn=tlx ;; *) key=model.net.fused_${s#profile_} attn="tlx triton" ;; esac
      switch=${key##*.}
      for value in true false; do
        step profile_${switch}_$value 450 "${PROFILE_STEP[@]}" --attn ${PROFILE_ATTN:-$attn} --$key=$value ${PROFILE_ARGS:-} \
          --out "$OUT/profile_step_${switch}_${value}_$GPU"
      done ;;
    # The step with the fused attention sublayer's per-block plan (the triton and tlx backends'), beside profile_attention's runs.
    profile_attention_blocks) step profile_attention_blocks 450 "${PROFILE_STEP[@]}" --attn tlx triton --model.net.fused_attention=true \
        --model.net.attention_sublayer_plan=blocks --out "$OUT/profile_step_fused_attention_blocks_$GPU" ;;
    # What Lightning's deterministic switch (torch.use_deterministic_algorithms) costs the tlx step.
    profile_deterministic) step profile_deterministic 450 "${PROFILE_STEP[@]}" --attn tlx --trainer.deterministic=true --out "$OUT/profile_step_deterministic_$GPU" ;;
    # The sharded path (torchrec DMP on one GPU, fused Adam on the tables), for what it adds to the tlx
    # step: as configured (row_wise), and all table_wise (on one GPU it skips row_wise's bucketing);
    # each with the plain step and through torchrec's TrainPipelineSparseDist (sharding.pipeline).
    profile_sharded)
      for variant in "" _table_wise; do for pipeline in "" _pipeline; do
        name=profile_sharded$variant$pipeline
        step $name 300 "${PROFILE_STEP[@]}" "${SHARDED_CONFIGS[@]}" --attn tlx ${variant:+--sharding.sharding_type=table_wise} \
          ${pipeline:+--sharding.pipeline=true} --out "$OUT/profile_step_sharded$variant${pipeline}_$GPU"
      done; done ;;
    # Which Python lines read CUDA tensors back (each a host wait), unsharded and sharded tlx, 40 steps each.
    trace_reads) TRACE=(--data.num_train=131072 --data.num_val=2048 --attn=tlx --trainer.max_steps=40 --trainer.val_check_interval=100000 --trainer.limit_val_batches=0 --runs_dir=/tmp/trace_runs)
      step trace_reads 300 python3 -m benchmarks.trace_host_reads -- "${GPU_DATA[@]}" "${TRACE[@]}"
      step trace_reads_sharded 300 python3 -m benchmarks.trace_host_reads -- "${GPU_DATA[@]}" "${SHARDED_CONFIGS[@]}" "${TRACE[@]}" ;;
    # The step under fbtriton's C launch path (train.py's default) and Triton's Python launch, back to back: compiled
    # as configs/gpu.yaml runs it (profile_c_path) and eager (profile_eager_c_path), PROFILE_ATTN (default tlx).
    profile_c_path|profile_eager_c_path) eager=(); [[ $s == profile_eager_c_path ]] && eager=(--model.net.compile=false --model.net.pad_tokens_to=0)
      for c in 0 1; do
        step ${s}_$c 280 env $(c_path $c) "${PROFILE_STEP[@]}" "${eager[@]}" --attn ${PROFILE_ATTN:-tlx} \
          --out "$OUT/profile_step_${s#profile_}_${c}_$GPU"
      done ;;
    # The step of this tree against a base commit's, back to back on one machine (the ratio a change bought):
    # carry `git archive BASE | xz > .gpu/base_tree.tar.xz`; PROFILE_ATTN (default tlx), PROFILE_ARGS more
    # train.py arguments for both. Each tree runs from its own folder, so its modules come first on sys.path.
    profile_vs_base) rm -rf /tmp/base_tree && mkdir -p /tmp/base_tree && tar xJf .gpu/base_tree.tar.xz -C /tmp/base_tree
      for tree in base head; do
        dir=$PWD; [[ $tree == base ]] && dir=/tmp/base_tree
        step profile_$tree 300 bash -c "cd $dir && ${PROFILE_STEP[*]} --attn ${PROFILE_ATTN:-tlx} ${PROFILE_ARGS:-} \
          --out $OUT/profile_step_${tree}_$GPU"
      done ;;
    profile_eager) step profile_eager 400 python3 -m benchmarks.profile_step "${GPU_DATA[@]}" --data.num_train=131072 --data.num_val=2048 --warmup 15 --steps 8 --model.net.compile=false --model.net.pad_tokens_to=0 --attn tlx fa2 --out "$OUT/profile_step_eager_$GPU" ;;
    sharding_cuda) step sharding_cuda 300 python3 -m torch.distributed.run --standalone --nproc-per-node 1 tests/sharding_worker.py cuda /tmp "{\"backend\": \"nccl\", \"path\": \"/tmp/sharding_cuda_ckpt\"}" ;;
    compare_start)  # a comparison cut short in an earlier session: carry its compare_runs.tgz (from compare_wait) as
      # .gpu/compare_runs.tgz and the comparison reuses its finished runs, training only the rest
      [[ -f .gpu/compare_runs.tgz && ! -d /tmp/compare ]] && tar xzf .gpu/compare_runs.tgz -C /tmp
      # COMPARE_STEPS and COMPARE_SEEDS (default 1000 and 3) size each group.
      # COMPARE_VARIANTS: the variant groups (default tlx with the layers' MLP unfused, against configs/gpu.yaml's fused one);
      # 5 groups x 3 seeds took 21 minutes of an H100 (2026-12-07, flex the slowest, cold compiles included), so a
      # session's device time holds 5 groups, not 6, and only as its first calls. One validation, at the end.
      variants=${COMPARE_VARIANTS-"--variant tlx_unfused_mlp tlx model.net.fused_mlp=false"}
      setsid nohup python3 train.py compare --attn ${COMPARE_ATTN:-tlx triton fa2 flex} $variants \
        "${GPU_DATA[@]}" --steps ${COMPARE_STEPS:-1000} --seeds ${COMPARE_SEEDS:-3} --out /tmp/compare --data.num_val=16384 --trainer.val_check_interval=1000 > /tmp/compare.log 2>&1 < /dev/null &
      summary+=("compare_start: started, log /tmp/compare.log") ;;
    compare_wait) for _ in $(seq $(( ${COMPARE_WAIT_S:-570} / 5 ))); do pgrep -f "train.py compare" > /dev/null || break; sleep 5; done
      cp /tmp/compare.log "$OUT"/compare.log; cp /tmp/compare/compare.md /tmp/compare/compare.json /tmp/compare/loss_curves.png "$OUT"/ 2>/dev/null
      # The runs so far, without checkpoints: `python -m benchmarks.compare report` renders them here if the machine goes.
      tar czf "$OUT"/compare_runs.tgz --exclude='*.ckpt' --exclude=checkpoints -C /tmp compare 2>/dev/null
      summary+=("compare_wait: $(pgrep -f 'train.py compare' > /dev/null && echo still running || echo finished) :: $(grep -E '^\[' /tmp/compare.log | tail -2 | tr '\n' ' ')") ;;
    quality_start)  # QUALITY_PROTOCOLS (default recbole_ml1m_context; "time_split_history time_split_no_history" for
      # what the history adds) tuned one after another, QUALITY_JOBS runs at a time, QUALITY_ARGS more tune
      # arguments (e.g. --size candidates); a tuning cut short in an earlier session resumes from its
      # quality_runs.tgz carried as .gpu/quality_runs.tgz. Block attention on triton: the MovieLens configs train in
      # fp32, as the baselines do, and the TLX kernels take bf16/fp16 only.
      [[ -f .gpu/quality_runs.tgz && ! -d /tmp/quality ]] && tar xzf .gpu/quality_runs.tgz -C /tmp
      if ! ml1m_data; then
        summary+=("quality_start: no MovieLens-1M files: carry scripts/pack_ml1m.sh's pack to /tmp/ml1m_raw.tar.xz first")
      else
        # 1160 steps = 8 epochs of RecBole's protocol (batch 4096); two dataloader workers a run, as runs share the host.
        setsid nohup bash -c 'for protocol in ${QUALITY_PROTOCOLS:-recbole_ml1m_context}; do
            python3 -m benchmarks.quality tune --protocol $protocol --attn ${QUALITY_ATTN:-triton} --steps ${QUALITY_STEPS:-1160} \
              --seeds 3 --jobs ${QUALITY_JOBS:-6} --out /tmp/quality/$protocol --data.data_dir=/tmp/data_cache --data.num_workers=2 \
              ${QUALITY_ARGS:-}
          done' > /tmp/quality.log 2>&1 < /dev/null &
        summary+=("quality_start: started, log /tmp/quality.log")
      fi ;;
    history_start)  # issue 23's time split: scripts/time_split_compare.sh's comparisons HISTORY_RUNS (default
      # "with_history without_history"; history_order and history_mean too), one after another in the
      # background, waited for by quality_wait. Resumes from a carried .gpu/quality_runs.tgz as quality_start.
      [[ -f .gpu/quality_runs.tgz && ! -d /tmp/quality ]] && tar xzf .gpu/quality_runs.tgz -C /tmp
      if ! ml1m_data; then
        summary+=("history_start: no MovieLens-1M files: carry scripts/pack_ml1m.sh's pack to /tmp/ml1m_raw.tar.xz first")
      else
        # A log of its own: a tuning (quality_start) may run beside it.
        setsid nohup bash scripts/time_split_compare.sh ${HISTORY_RUNS:-with_history without_history} > /tmp/quality_history.log 2>&1 < /dev/null &
        summary+=("history_start: started ${HISTORY_RUNS:-with_history without_history}, log /tmp/quality_history.log")
      fi ;;
    quality_wait) for _ in $(seq $(( ${QUALITY_WAIT_S:-570} / 5 ))); do pgrep -f "benchmarks.quality tune|time_split_compare.sh|--out /tmp/quality/" > /dev/null || break; sleep 5; done
      cp /tmp/quality*.log "$OUT"/
      # Every tuning folder without checkpoints: `python -m benchmarks.quality --protocol NAME=FOLDER ...` reports from it
      # here, and a tuning cut short resumes from it (carried back as .gpu/quality_runs.tgz).
      tar czf "$OUT"/quality_runs.tgz --exclude='*.ckpt' --exclude=checkpoints -C /tmp quality 2>/dev/null
      summary+=("quality_wait: $(pgrep -f 'benchmarks.quality tune|time_split_compare.sh|--out /tmp/quality/' > /dev/null && echo still running || echo finished) :: $(grep -E 'ok in|FAILED|error' /tmp/quality*.log | tail -2 | tr '\n' ' ')") ;;
    sharded) step sharded 580 python3 -m torch.distributed.run --standalone --nproc-per-node 1 train.py "${GPU_DATA[@]}" --config configs/sharded.yaml --trainer.devices=1 --runs_dir=/tmp/runs ;;
    *) echo "unknown step $s"; exit 2 ;;
  esac
done
# The device tool brings back at most 8 files from $OUT (the rest are lost with the machine): past that, one archive.
if (( $(find "$OUT" -type f | wc -l) > 8 )); then
  tar czf /tmp/gpu_out.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/gpu_out.tgz "$OUT"/gpu_out.tgz
  summary+=("$OUT held more than 8 files: they come back as gpu_out.tgz")
fi
for line in "${summary[@]}"; do echo "$line"; done
