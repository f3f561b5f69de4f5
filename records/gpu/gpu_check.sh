#!/usr/bin/env bash
# GPU validation of both modes on one GPU, under 8 minutes: versions, the CUDA CP loss against the dense
# path, then the speedrun preset (12 x 768, 64Ki tokens a row, 8 accumulation steps on 1 GPU) for STEPS
# steps in vanilla and in CPLM mode, and a report whose last line is the CPLM / vanilla step-time ratio.
# Run from the repository root with .gpu_data/ (records/gpu/prepare_gpu_data.sh) present; OUT = results.
set -uo pipefail
OUT=${OUT:-records/gpu/out}
STEPS=${STEPS:-100}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
{
python3 -c "import torch, platform; print('python', platform.python_version(), 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv
} 2>&1 | tee "$OUT/versions.txt"
timeout 150 python3 records/gpu/cuda_cp_check.py 2>&1 | tee "$OUT/cuda_cp_check.txt"
for mode in 0 1; do
    TORCH_LOGS=recompiles timeout 200 python3 -m torch.distributed.run --standalone --nproc_per_node=1 \
        train_gpt_cplm.py --preset speedrun --cplm $mode --num_iterations "$STEPS" --val_loss_every 50 \
        --train_files ".gpu_data/gpucorpus_train_*.bin" --val_files ".gpu_data/gpucorpus_val_*.bin" \
        --val_tokens 524288 --run_id "gpu_cplm$mode" --log_dir "$OUT" > "$OUT/stdout_cplm$mode.txt" 2>&1
    echo "cplm=$mode exit $?"; tail -n 4 "$OUT/stdout_cplm$mode.txt"
done
python3 records/gpu/gpu_report.py "$OUT" 2>&1 | tee "$OUT/report.txt"
