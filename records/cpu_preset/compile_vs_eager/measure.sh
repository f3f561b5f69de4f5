#!/bin/bash
# The cpu preset eager (--compile 0, the CPU default) and compiled (--compile 1, compile time counted: the
# preset has no warm-up), vanilla and CPLM, one after another on a quiet machine; wall clock and max RSS by
# GNU time. Run from the repository root: bash records/cpu_preset/compile_vs_eager/measure.sh TAG OUT_DIR
set -u
tag=$1; out=$2; shift 2
mkdir -p "$out"
for c in 0 1; do for m in 0 1; do
  id=${tag}_c${c}_m${m}
  /usr/bin/time -v python3 train_gpt_cplm.py --preset cpu --cplm $m --compile $c --run_id "$id" --log_dir "$out" "$@" \
      > /dev/null 2> "$out/$id.time"
  echo "$id rc=$?"
done; done
