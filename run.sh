#!/usr/bin/env bash
# The one command.
#   bash run.sh         GPUs: fetch the FineWeb shards that are missing, then torchrun the speedrun preset on every
#                       GPU (arguments pass through: bash run.sh --cplm 1). No GPU: the CPU race, vanilla then CPLM
#                       on the same offline corpus (the Python standard library's source in GPT-2 tokens) with the
#                       same seed, then tools/compare.py on the two logs (a table and a PNG).
#   bash run.sh test    the test suite, CPU only.
# Installs what is missing: torch only where none is installed (never replacing one: a GPU machine keeps its
# build), then numpy, tiktoken, huggingface_hub (and pytest for the tests).
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}

if [ "${1:-}" = -h ] || [ "${1:-}" = --help ]; then  # before anything is installed or run
    cat <<'HELP'
usage: bash run.sh [FLAGS...]      train: what, depends on the machine (FLAGS go to train_gpt_cplm.py)
       bash run.sh test [ARGS...]  the test suite, CPU only (ARGS go to pytest)
       bash run.sh -h | --help     this text

With GPUs: downloads the FineWeb shards that are missing (data/cached_fineweb10B.py 10), then one torchrun
  of train_gpt_cplm.py on every GPU with the speedrun preset: vanilla, the 2025-01-26 record. For CPLM:
  bash run.sh --cplm 1; then judge the two logs: python tools/compare.py 'logs/*.txt' --target 3.28
Without a GPU: the CPU race. Tokenizes the Python standard library's source (offline, GPT-2 tokens), trains
  the cpu preset (4 x 128, 200 steps) as vanilla, then as CPLM, same seed, and runs tools/compare.py on the
  two logs (a table and logs/cpu_race_<time>.png): about 12 minutes on 2 cores. It sets --preset, --cplm,
  --run_id, --log_dir, --save_checkpoint, --resume and --overwrite itself; other flags pass on.
First installs what is missing: torch only where none is installed (the CPU build without a GPU; TORCH_PIP
  chooses another), numpy, tiktoken, huggingface_hub, and matplotlib (the race) or pytest (the tests).
HELP
    exit 0
fi

has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

# the CPU race's own flags (it sets them itself; passed on, they overrode it: CPLM trained twice, compare found no
# logs after both runs, or one checkpoint was resumed into both runs' logs): refused before anything is installed
refuse_race_flags() {
    for arg in "$@"; do
        case "$arg" in
            --preset|--preset=*|--cplm|--cplm=*|--run_id|--run_id=*|--log_dir|--log_dir=*|--save_checkpoint\
            |--save_checkpoint=*|--resume|--resume=*|--overwrite|--overwrite=*)
                echo "run.sh: the CPU race sets ${arg%%=*} itself; to choose it, run train_gpt_cplm.py directly" >&2
                exit 2;;
        esac
    done
}
if [ "${1:-}" != test ] && ! has_gpu; then refuse_race_flags "$@"; fi

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
if [ "${1:-}" = test ]; then need+=(pytest); elif [ "$gpus" -eq 0 ]; then need+=(matplotlib); fi  # the race's plot
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
        test_gpu_kernels.py test_gpu_interpreter.py test_gpu_interleaved.py test_gpu_roofline.py "$@"
fi

if [ "$gpus" -gt 0 ]; then  # (a CPU build of torch on a GPU machine runs the race)
    "$PYTHON" data/cached_fineweb10B.py 10  # skips the shards already present
    exec "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node="$gpus" train_gpt_cplm.py "$@"
fi

# no GPU (or a CPU build of torch on a GPU machine): the race on CPU, which names, places and sets the mode of
# both runs itself and starts both afresh
refuse_race_flags "$@"
if ! ls data/pystdlib/pystdlib_train_*.bin >/dev/null 2>&1; then
    # GPT-2 tokens; tiktoken fetches its files once (or reads TIKTOKEN_CACHE_DIR)
    "$PYTHON" data/tokenize_corpus.py --stdlib --out_dir data/pystdlib --name pystdlib
fi
race=cpu_race_$(date +%Y%m%d_%H%M%S)_$$
echo "run.sh: the CPU race: vanilla, then CPLM (the cpu preset, seed 0; about 5 minutes each on 2 cores)"
echo "run.sh: logs: logs/${race}_vanilla.txt and logs/${race}_cplm.txt"
for mode in vanilla cplm; do
    echo "run.sh: training $mode"
    "$PYTHON" train_gpt_cplm.py --preset cpu --cplm "$([ $mode = cplm ] && echo 1 || echo 0)" \
        --run_id "${race}_$mode" --save_checkpoint 1 "$@"
done
for mode in vanilla cplm; do  # said once written: --num_iterations 0 trains nothing and saves none
    if ls "logs/${race}_$mode"/state_step*.pt >/dev/null 2>&1; then
        echo "run.sh: final checkpoint of $mode: $(ls "logs/${race}_$mode"/state_step*.pt | tail -1)"
    fi
done
echo
exec "$PYTHON" tools/compare.py "logs/${race}_vanilla.txt" "logs/${race}_cplm.txt" --target_from vanilla \
    --plot "logs/${race}.png"
