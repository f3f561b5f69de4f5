#!/usr/bin/env bash
# Builds the GPU check's corpus where tiktoken's GPT-2 files are at hand (the GPU machine has no internet):
# the Python standard library plus torch's own Python sources, ~24M GPT-2 tokens (~48 MB) in .gpu_data/
# (git-ignored), which the device call carries along. Run from the repository root.
set -euo pipefail
torch_src=$(python3 -c "import os, torch; print(os.path.dirname(torch.__file__))")
python3 data/tokenize_corpus.py --stdlib "$torch_src" --glob "*.py" --max_tokens 24000000 \
    --out_dir .gpu_data --name gpucorpus
