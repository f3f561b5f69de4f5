#!/usr/bin/env bash
# The one command. With GPUs: fetch the FineWeb shards that are missing, then train on every GPU with
# torchrun. Without: build a real corpus offline (the Python standard library's own source, GPT-2 tokens)
# and train the `cpu` preset. Arguments pass through to train_gpt_cplm.py, e.g. `bash run.sh --cplm 1`.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}

# never install or replace torch here: a GPU machine's own CUDA build must stay
if ! "$PYTHON" -c "import torch" 2>/dev/null; then
    echo "run.sh: torch is not installed for $PYTHON; install the build for this machine (pytorch.org/get-started; e.g. pip install 'torch>=2.9'), then rerun" >&2
    exit 1
fi
if ! "$PYTHON" -c "import numpy, tiktoken, huggingface_hub" 2>/dev/null; then
    echo "run.sh: installing numpy, tiktoken, huggingface_hub"
    "$PYTHON" -m pip install -q numpy tiktoken huggingface_hub
fi

gpus=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -gt 0 ]; then
    "$PYTHON" data/cached_fineweb10B.py 10  # skips the shards already present
    exec "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node="$gpus" train_gpt_cplm.py "$@"
fi

if ! ls data/pystdlib/pystdlib_train_*.bin >/dev/null 2>&1; then
    # GPT-2 tokens; tiktoken fetches its files once (or reads TIKTOKEN_CACHE_DIR)
    "$PYTHON" data/tokenize_corpus.py --stdlib --out_dir data/pystdlib --name pystdlib
fi
exec "$PYTHON" train_gpt_cplm.py --preset cpu "$@"
