#!/usr/bin/env bash
# Builds the GPU check's corpus where tiktoken's GPT-2 files are at hand (the GPU machine has no internet):
# the Python standard library's source, 4M GPT-2 tokens (~8 MB) in .gpu_data/ (git-ignored), which the
# device call carries. The check trains 43 steps of one 48Ki-token row (2.1M tokens) and validates on one
# 256Ki-token row; val_fraction 0.15 leaves ~600k val tokens. Run from the repository root.
set -euo pipefail
python3 data/tokenize_corpus.py --stdlib --max_tokens 4000000 --val_fraction 0.15 --out_dir .gpu_data --name gpucorpus
