#!/usr/bin/env bash
# The accelerator check's runs on a GPU, each under its own time limit, in one command:
#
#   bash experiments/accelerator_session.sh OUT_DIR [PART ...]
#
# PARTs, run in the order given (default: all four, 720 s at most; where a command may run 600 s,
# two commands: `full variants`, then `nucleus loops`):
#   full      the whole check (report full.md: the results table, s(tree 2+2+1+1) too), 350 s
#   variants  llama1b batch 1: step variants, the profiled T = 1 ceilings of the chain at k = 4 and
#             of a dynamic tree at EAGLE-2's sizes (60 nodes, width 10, k = 6), the optimized HLO
#             and traces (variants.md, dump.tgz), 170 s
#   nucleus   sampling's cost a call by setting (top-k by lax.top_k and by search, top-p), the
#             same ceiling at top-p 0.95, profiled (nucleus.md), 110 s
#   loops     the variants' figures with XLA's command buffers holding while loops and
#             conditionals (loops.md: the loop condition's copy to the host gone), 90 s
# Each part writes its report under OUT_DIR, a part cut by its limit what it had; the logs go
# into OUT_DIR/logs.tgz at the end (a few files in all). PRESETS (default llama1b), TREE (the
# variants' dynamic tree) and EXTRA (flags after every part's own, e.g. --small) serve a smoke run
# on a CPU.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: $0 OUT_DIR [full|variants|nucleus|loops ...]}
shift
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(full variants nucleus loops)
for part in "${parts[@]}"; do
  case $part in full|variants|nucleus|loops) ;;
    *) echo "unknown part: $part (full, variants, nucleus, loops)" >&2; exit 2 ;;
  esac
done
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
one="--exactness= --presets=${PRESETS:-llama1b} --batches=1 --trees="
extra=${EXTRA:-}

run() {  # run PART LIMIT_S ARGS...: one process, its report and log under $out
  local part=$1 limit=$2
  shift 2
  local start=$SECONDS
  timeout "$limit" "$py" experiments/accelerator_check.py "$@" $extra --out="$out/$part.md" \
      > "$out/$part.log" 2>&1
  echo "$part: exit $? after $((SECONDS - start)) s (limit $limit s)"
}

for part in "${parts[@]}"; do
  case $part in
    full) run full 350 --compile_threads=8 ;;
    variants)
      dump=$(mktemp -d)  # HLO and traces, many files: one archive comes back.
      run variants 170 $one --ks=1,4 --ceiling_ks=4 --ceiling_trees=${TREE:-60:10:6} --profile_ceilings \
          --variants=unpadded,stream,parallel_compile,no_autotune --dump_dir="$dump"
      tar czf "$out/dump.tgz" -C "$dump" . && rm -rf "$dump" ;;
    nucleus) run nucleus 110 $one --ks=1 --ceiling_ks=4 --ceiling_top_p=0.95 --profile_ceilings \
                 --sampling_costs ;;
    loops)
      graphed=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL
      XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=$graphed" \
          run loops 90 $one --ks=1,4 --ceiling_ks=4 ;;
  esac
done
(cd "$out" && ls *.log > /dev/null 2>&1 && tar czf logs.tgz *.log && rm -f *.log)
