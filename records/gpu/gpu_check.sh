#!/usr/bin/env bash
# GPU check of both modes of the speedrun preset on one GPU, in one call of at most 6 minutes:
#   1. versions; 2. the CUDA CP loss against the dense reference (cuda_cp_check.py, training settings);
#   3. per mode, the speedrun preset as one of the record's 8 GPUs runs it (one 48Ki-token row a step, FP8
#      head, compiled): 3 untimed warm-up steps and one warm-up validation row, then 40 timed steps with
#      validation on one 256Ki-token row at steps 0, 20 and 40, with TORCH_LOGS=recompiles;
#   4. gpu_report.py: step times, tokens/s, MFU, peak memory, recompiles after warm-up, val loss at equal
#      steps; its last line is `cplm/vanilla step time ratio: X.XXX`.
# If the flex CP path fails in step 2, CPLM is timed with --cp_backend dense (the chunked dense CP sums on the
# GPU) and the report says so. Run from the repository root with .gpu_data/ (prepare_gpu_data.sh) present.
set -uo pipefail
OUT=${OUT:-records/gpu/out}
STEPS=${STEPS:-40}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
{
python3 -c "import torch, platform; print('python', platform.python_version(), 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv
} 2>&1 | tee "$OUT/versions.txt"
timeout 100 python3 records/gpu/cuda_cp_check.py > "$OUT/cuda_cp_check.txt" 2>&1
cp_status=$?
tail -n 9 "$OUT/cuda_cp_check.txt"
cp_backend=auto
if [ "$cp_status" -ne 0 ] && [ "$cp_status" -ne 1 ]; then
    cp_backend=dense
    echo "flex CP path unusable (exit $cp_status): CPLM runs with --cp_backend dense" | tee -a "$OUT/cuda_cp_check.txt"
fi
for mode in 0 1; do
    TORCH_LOGS=recompiles timeout 125 python3 -m torch.distributed.run --standalone --nproc_per_node=1 \
        train_gpt_cplm.py --preset speedrun --cplm $mode --cp_backend $cp_backend \
        --batch_size 49152 --num_iterations "$STEPS" --warmup_steps 3 --val_loss_every 20 \
        --val_tokens 262144 --train_files ".gpu_data/gpucorpus_train_*.bin" --val_files ".gpu_data/gpucorpus_val_*.bin" \
        --run_id "gpu_cplm$mode" --log_dir "$OUT" > "$OUT/stdout_cplm$mode.txt" 2>&1
    echo "cplm=$mode exit $?"; tail -n 3 "$OUT/stdout_cplm$mode.txt"
done
python3 records/gpu/gpu_report.py "$OUT" 2>&1 | tee "$OUT/report.txt"
