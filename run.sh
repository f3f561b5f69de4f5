#!/usr/bin/env bash
# The one command.
#   bash run.sh         GPUs: fetch the FineWeb shards that are missing, then torchrun the speedrun preset on every
#                       GPU (arguments pass through: bash run.sh --cplm 1). No GPU: the race (tools/run_race.py) on this
#                       CPU: vanilla, CPLM and the pointer sentinel on 3 seeds each, judged by tools/compare.py.
#   bash run.sh race    the race on one GPU (the gpu1 preset; FineWeb's first shard fetched if missing) or a CPU
#   bash run.sh test    the test suite, CPU only.
# Installs what is missing: torch only where none is installed (never replacing one: a GPU machine keeps its
# build), then numpy, tiktoken, huggingface_hub (and pytest and scipy for the tests, scipy and matplotlib for the race).
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}

if [ "${1:-}" = -h ] || [ "${1:-}" = --help ]; then  # before anything is installed or run
    cat <<'HELP'
usage: bash run.sh [FLAGS...]          train: what, depends on the machine (FLAGS go to train_gpt_cplm.py)
       bash run.sh race [ARGS...]      the race on one GPU or this CPU (ARGS go to tools/run_race.py)
       bash run.sh test [ARGS...]      the test suite, CPU only (ARGS go to pytest)
       bash run.sh -h | --help         this text

With GPUs: downloads the FineWeb shards that are missing (data/cached_fineweb10B.py 10), then one torchrun
  of train_gpt_cplm.py on every GPU with the speedrun preset: vanilla, the 2025-01-26 record. For CPLM:
  bash run.sh --cplm 1; then judge the two logs: python tools/compare.py 'logs/*.txt' --target 3.28
Without a GPU: the CPU race, as bash run.sh race. FLAGS go to every run (after tools/run_race.py's --); the race
  sets --preset, --cplm, --copy_gate, --seed, --data_seed, --run_id, --log_dir, --resume, --overwrite and
  the checkpoint flags itself.
The race (tools/run_race.py): vanilla at N steps, CPLM and the pointer sentinel at shorter schedules fixed in
  advance, 3 seeds each, then the step time ratio measured in one process, then tools/compare.py's answer:
  steps and time to vanilla's final loss per mode, Welch's test, a plot. One GPU: the gpu1 preset (4 x 768,
  500 steps of 32Ki tokens) on FineWeb's first shard, within 570 s on an 80 GB H100 or an H200. No GPU: the
  cpu preset at 100 steps of 1024 tokens on the Python standard library's source, about 20 minutes on 2
  cores. Its folder: logs/race_<time>/ (report.txt, logs/, race.png).
First installs what is missing: torch only where none is installed (the CPU build without a GPU; TORCH_PIP
  chooses another), numpy, tiktoken, huggingface_hub, and scipy with matplotlib (the race) or pytest (the tests).
HELP
    exit 0
fi

has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

# the flags the race sets itself (tools/run_race.py's RACE_OWNS), refused before anything is installed
refuse_race_flags() {
    for arg in "$@"; do
        case "$arg" in
            --preset|--preset=*|--cplm|--cplm=*|--copy_gate|--copy_gate=*|--seed|--seed=*|--data_seed|--data_seed=*\
            |--run_id|--run_id=*|--log_dir|--log_dir=*|--resume|--resume=*|--overwrite|--overwrite=*\
            |--save_checkpoint|--save_checkpoint=*|--checkpoint_every|--checkpoint_every=*)
                echo "run.sh: the race sets ${arg%%=*} itself; to choose it, run train_gpt_cplm.py directly" >&2
                exit 2;;
        esac
    done
}
if [ "${1:-}" != test ] && [ "${1:-}" != race ] && ! has_gpu; then refuse_race_flags "$@"; fi

if ! "$PYTHON" -c "import torch" 2>/dev/null; then
    if [ -n "${TORCH_PIP:-}" ]; then
        echo "run.sh: torch is not installed: pip install $TORCH_PIP (from TORCH_PIP)"
        # shellcheck disable=SC2086
        "$PYTHON" -m pip install $TORCH_PIP
    elif has_gpu; then
        echo "run.sh: torch is not installed and a GPU is present: installing the default CUDA build (pip install torch," \
             "about 3 GB). For another build: TORCH_PIP='torch --index-url https://download.pytorch.org/whl/cu126' bash run.sh"
        "$PYTHON" -m pip install torch
    else
        echo "run.sh: torch is not installed and there is no GPU: installing the CPU build (about 200 MB, from" \
             "download.pytorch.org/whl/cpu). For the default CUDA build instead (3 GB, also runs on a CPU): TORCH_PIP=torch bash run.sh"
        if ! "$PYTHON" -m pip install torch --index-url https://download.pytorch.org/whl/cpu; then
            echo "run.sh: the CPU index could not be reached: installing the default build (pip install torch)"
            "$PYTHON" -m pip install torch
        fi
    fi
fi
gpus=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())")  # GPUs this torch can use
need=(numpy tiktoken huggingface_hub)
# the tests and the race need the judge's scipy; the race its plot's matplotlib
if [ "${1:-}" = test ]; then need+=(pytest scipy); elif [ "$gpus" -eq 0 ] || [ "${1:-}" = race ]; then need+=(scipy matplotlib); fi
missing=()
for module in "${need[@]}"; do "$PYTHON" -c "import $module" 2>/dev/null || missing+=("$module"); done
if [ ${#missing[@]} -gt 0 ]; then
    echo "run.sh: installing ${missing[*]}"
    "$PYTHON" -m pip install -q "${missing[@]}"
fi

if [ "${1:-}" = test ]; then  # -rs: each skipped test says why, and what enables it
    shift
    exec "$PYTHON" -m pytest -q -rs test_cplm.py test_cli.py test_run_files.py test_data.py test_experiments.py \
        test_compare.py test_inference.py test_mechanism.py test_baselines.py test_test_slice.py test_gpu_preflight.py \
        test_gpu_kernels.py test_gpu_interpreter.py test_gpu_interleaved.py test_gpu_roofline.py test_race.py \
        test_cp_kernel.py test_imports.py "$@"
fi

race=race_$(date +%Y%m%d_%H%M%S)_$$
if [ "${1:-}" = race ]; then  # on any machine: tools/run_race.py's own arguments
    shift
    if [ "$gpus" -gt 0 ] && ! ls data/fineweb10B/fineweb_train_000001.bin data/fineweb10B/fineweb_val_000000.bin \
            >/dev/null 2>&1; then
        "$PYTHON" data/cached_fineweb10B.py 1 || echo "run.sh: FineWeb could not be fetched; the race takes the" \
            "offline stand-in data/prose_gpt2/ if it is there"
    fi
    exec "$PYTHON" tools/run_race.py --out "logs/$race" "$@"
fi

if [ "$gpus" -gt 0 ]; then  # GPUs torch can use (a CPU build of torch sees none: the CPU race below)
    "$PYTHON" data/cached_fineweb10B.py 10  # skips the shards already present
    exec "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node="$gpus" train_gpt_cplm.py "$@"
fi

# no GPU (or a CPU build of torch on a GPU machine): the race on this CPU, the flags given to every run
refuse_race_flags "$@"
echo "run.sh: the race on this CPU: vanilla, CPLM and the pointer sentinel, 3 seeds each (about 20 minutes on 2" \
     "cores), then the judge: logs/$race/"
exec "$PYTHON" tools/run_race.py --out "logs/$race" -- "$@"
