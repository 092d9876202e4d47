#!/bin/sh
# Issue 10's quality grid on the default pair: HumanEval (all 164 problems, executed) and
# GSM (N = 200), AR / SpS / Cactus / TAS / Interp and the int8 verifier, decoded MAX_BATCH
# items at a time. It runs in stages of growing N, alternating the tasks, so a run stopped
# at any point holds both tasks on their first items; every stage resumes where the last
# one stopped (results.jsonl is appended item by item). Rerun the script to go on. The
# tables of docs/RESULTS.md: cactus-spec bench quality-table OUT/quality-humaneval OUT/quality-gsm
#
#   sh benchmarks/quality.sh              # about 10 hours on a 2-core CPU, in sittings
#   MAX_BATCH=4 STAGES="32 64" sh benchmarks/quality.sh
set -e
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-out}
STAGES=${STAGES:-"32 64 112 164 200"}
BENCH=".venv/bin/cactus-spec bench --max-new-tokens 512 --max-batch ${MAX_BATCH:-8} --no-progress"
for n in $STAGES; do
    he=$(( n < 164 ? n : 164 ))
    $BENCH --task humaneval --n "$he" --grid benchmarks/grids/quality.toml \
        --out "$OUT/quality-humaneval" > /dev/null
    $BENCH --task gsm --n "$n" --grid benchmarks/grids/quality.toml \
        --out "$OUT/quality-gsm" > /dev/null
    echo "stage N = $n done: $OUT/quality-humaneval/summary.md, $OUT/quality-gsm/summary.md"
done
echo "tables: .venv/bin/cactus-spec bench quality-table $OUT/quality-humaneval $OUT/quality-gsm"
