#!/bin/bash
# CPLM's CPU step against vanilla's at the cpu preset on English in GPT-2 tokens: 20-step training runs,
# vanilla and CPLM in turn, twice, one at a time on a quiet machine; each log is kept (its source at the top).
# Data: python3 gpu_check/prepare_gpu_data.py --out_dir data/prose_gpt2 --name prose_gpt2 --train_tokens 5000000
#       --val_tokens 400000 (from the prose corpus of data/build_prose_corpus.sh)
# Run from the repository root: bash records/cp_cost/step_time_2026-12-02/measure.sh
set -eu
out=records/cp_cost/step_time_2026-12-02
for run in 0 1; do for m in 0 1; do
  python3 train_gpt_cplm.py --preset cpu --cplm $m --num_iterations 20 --val_loss_every 0 --run_id "step_cplm${m}_run${run}" \
      --log_dir "$out" --train_files "data/prose_gpt2/prose_gpt2_train_*.bin" --val_files "data/prose_gpt2/prose_gpt2_val_*.bin" \
      > /dev/null
done; done
# the median over steps 5..20 of each run's per-step train_time difference
python3 - "$out" <<'PY'
import glob, re, statistics, sys
for path in sorted(glob.glob(f"{sys.argv[1]}/step_cplm*_run*.txt")):
    t = [int(x) for x in re.findall(r"^step:\d+/20 train_loss:\S+ train_time:(\d+)ms", open(path).read(), re.M)]
    print(path.rsplit("/", 1)[1], "median ms/step over steps 5-20:", statistics.median(b - a for a, b in zip(t[3:], t[4:])))
PY
