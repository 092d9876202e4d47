#!/bin/sh
# Issue 42's grid on the default pair (benchmarks/grids/budget.toml): HumanEval's and GSM's
# first 50 items, 256 new tokens, the paper's sampling, MAX_BATCH items at a time. It runs
# in stages of growing N, alternating the tasks, so a run stopped at any point holds both
# tasks on their first items; every stage resumes where the last one stopped
# (results.jsonl is appended item by item). Rerun the script to go on.
#
#   sh benchmarks/budget.sh                 # about 4 hours on a 2-core CPU, in sittings
#   STAGES="8 16" sh benchmarks/budget.sh
set -e
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-out}
STAGES=${STAGES:-"8 16 32 50"}
BENCH=".venv/bin/cactus-spec bench --max-new-tokens 256 --max-batch ${MAX_BATCH:-8} --no-progress"
for n in $STAGES; do
    for task in humaneval gsm; do
        $BENCH --task "$task" --n "$n" --grid benchmarks/grids/budget.toml \
            --out "$OUT/budget-$task" > /dev/null
    done
    echo "stage N = $n done: $OUT/budget-humaneval/summary.md, $OUT/budget-gsm/summary.md"
done
