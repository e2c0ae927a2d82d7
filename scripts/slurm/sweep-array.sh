#!/usr/bin/env bash
# One shard of a sweep per Slurm array task, then a merge job.
#
#   CONFIG=configs/first-2x2.toml OUT=results/first-2x2 SHARDS=8 \
#     SQUAD=/data/squad sbatch --array=0-7 scripts/slurm/sweep-array.sh
#   # after the array finishes (or chained with --dependency=afterok:<jobid>):
#   CONFIG=configs/first-2x2.toml OUT=results/first-2x2 MERGE=1 sbatch scripts/slurm/sweep-array.sh
#
# Every task writes its finished cells into the shared $OUT/items as they
# complete (atomically), so a task that is killed or preempted resumes when
# resubmitted; the merge step writes summary.parquet and the report once
# every cell is present. Build once beforehand (`cargo build --release -p xtask`)
# so the tasks do not compile.
#SBATCH --job-name=tolerable-sweep
#SBATCH --cpus-per-task=8
#SBATCH --mem=24G
#SBATCH --time=04:00:00
#SBATCH --output=slurm-%x-%A_%a.out
set -euo pipefail

: "${CONFIG:?set CONFIG to a sweep config}"
: "${OUT:?set OUT to the run folder (shared storage)}"
SHARDS="${SHARDS:-${SLURM_ARRAY_TASK_COUNT:-1}}"
XTASK="${XTASK:-target/release/xtask}"
DATA_ARGS=()
if [[ -n "${SQUAD:-}" ]]; then
  DATA_ARGS=(--data "squad_dev=$SQUAD")
fi
export RAYON_NUM_THREADS="${SLURM_CPUS_PER_TASK:-8}"

if [[ -n "${MERGE:-}" ]]; then
  exec "$XTASK" sweep --config "$CONFIG" --out "$OUT" --merge "${DATA_ARGS[@]}"
fi

: "${SLURM_ARRAY_TASK_ID:?run as an array job (sbatch --array=0-N) or set MERGE=1}"
exec "$XTASK" sweep --config "$CONFIG" --out "$OUT" \
  --shard "${SLURM_ARRAY_TASK_ID}/${SHARDS}" "${DATA_ARGS[@]}"
