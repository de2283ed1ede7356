#!/usr/bin/env bash
# Issue 23's MovieLens-1M time split: one `train.py compare` per name given, one after another, each into
# /tmp/quality/<folder> (gpu_session.sh history_start starts this in the background; quality_wait waits):
#   with_history     every model with the history feature (folder time_split_history)
#   without_history  the same samples without it (time_split_no_history)
#   history_order    ours with its history as given (oldest first) and reversed, model.net.history_order (history_order)
#   history_mean     ours with each history as one token, the mean of its items, model.net.history_tokens=mean,
#                    and ours without the history feature beside it (history_mean; its item-token twin is
#                    history_order's first group)
#   no_attention     ours with history item tokens, and the same without attention layers (model.net.num_layers=0:
#                    the items then reach the readout only through its mean), so what attention over the history
#                    adds (no_attention)
#   target_attention ours with target attention over its history item tokens (model.net.target_attention_feature=item),
#                    with its attention layers and without them (target_attention)
#   with_history_target  every model with the history feature, as with_history, ours as target_attention found it
#                    best (target attention, no attention layers), so all of them in one run
#                    (time_split_history_target)
#   without_history_target  the same without the history feature, ours without attention layers as there, so the
#                    pair says what the history adds to each model (time_split_no_history_target)
# Every model trains at the point its RecBole ML-1M tuning chose (benchmarks/results/quality_ml1m.md; ours from
# quality_ml1m_retune.md, configs/movielens1m.yaml's), so each had the same budget, spent on the other protocol;
# 3 seeds x HISTORY_STEPS (default 1563: 8 epochs of the 800,164 training rows), 6 runs at a time. Block attention
# runs on QUALITY_ATTN (default triton): the MovieLens configs train in fp32, and the TLX kernels take bf16/fp16 only.
set -uo pipefail
attn=${QUALITY_ATTN:-triton}
common=(--attn "$attn" --config configs/movielens1m.yaml --data.protocol=time_split_history --data.data_dir=/tmp/data_cache
        --data.num_workers=2 --steps "${HISTORY_STEPS:-1563}" --seeds 3 --jobs 6)
baselines=(--variant lr "$attn" configs/lr.yaml model.optim.lr=0.005 model.optim.weight_decay=0.01
           --variant dlrm "$attn" configs/dlrm.yaml model.optim.lr=0.01 model.optim.weight_decay=0.1
           --variant dcnv2 "$attn" configs/dcnv2.yaml model.optim.lr=0.005 model.optim.weight_decay=0.01
           --variant deepfm "$attn" configs/deepfm.yaml model.optim.lr=0.01 model.optim.weight_decay=0.1)
status=0
for name in "$@"; do
  case $name in
    with_history) args=(--data.max_history_len=256 "${baselines[@]}" --out /tmp/quality/time_split_history) ;;
    without_history) args=(--data.max_history_len=0 "${baselines[@]}" --out /tmp/quality/time_split_no_history) ;;
    history_order) args=(--data.max_history_len=256 --variant reversed "$attn" model.net.history_order=reversed
                         --out /tmp/quality/history_order) ;;
    history_mean) args=(--data.max_history_len=256 --model.net.history_tokens=mean --variant no_history "$attn"
                        data.max_history_len=0 --out /tmp/quality/history_mean) ;;
    no_attention) args=(--data.max_history_len=256 --variant no_attention "$attn" model.net.num_layers=0
                        --out /tmp/quality/no_attention) ;;
    with_history_target) args=(--data.max_history_len=256 --model.net.target_attention_feature=item --model.net.num_layers=0
                               "${baselines[@]}" --out /tmp/quality/time_split_history_target) ;;
    without_history_target) args=(--data.max_history_len=0 --model.net.num_layers=0 "${baselines[@]}"
                                  --out /tmp/quality/time_split_no_history_target) ;;
    target_attention) args=(--data.max_history_len=256 --model.net.target_attention_feature=item
                            --variant target_no_layers "$attn" model.net.num_layers=0 --out /tmp/quality/target_attention) ;;
    *) echo "unknown comparison '$name': with_history, without_history, history_order, history_mean, no_attention, target_attention, with_history_target or without_history_target" >&2
       exit 2 ;;
  esac
  echo "== $name"
  python3 train.py compare "${common[@]}" "${args[@]}" || status=1
done
exit $status
