#!/usr/bin/env bash
# Submit a recipe (or any training config) to SLURM through launch/train.sbatch.
#
#   launch/submit.sh qwen3-32b-dapo                       # launch/recipes/qwen3-32b-dapo.yaml
#   launch/submit.sh path/to/config.yaml --set run.steps=100
#   launch/submit.sh qwen3-8b-grpo --dry-run              # print the sbatch command only
#   SBATCH_PARTITION=gpu SBATCH_ACCOUNT=proj launch/submit.sh qwen3-14b-grpo
#
# The sbatch options come from the recipe's '# sbatch:' header line (nodes, GPUs per node,
# time), then from CALIBCLIP_SBATCH_ARGS (extra options, e.g. "--qos=high --reservation=x");
# sbatch's own SBATCH_* environment variables (partition, account, ...) apply as usual.
# The job writes to $CALIBCLIP_OUTPUT_DIR/<run name>/ (default ./runs/<recipe name>/):
# logs/slurm-<job>.out (every attempt appended), logs/attempts.tsv, metrics.jsonl,
# checkpoints/. Everything after the config is passed to `calibclip train` (--set ...).
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
if [[ $# -lt 1 || $1 == -h || $1 == --help ]]; then
    sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
CONFIG=$1
shift
if [[ ! -f $CONFIG && -f "$HERE/recipes/$CONFIG.yaml" ]]; then
    CONFIG="$HERE/recipes/$CONFIG.yaml"
fi
[[ -f $CONFIG ]] || { echo "submit.sh: no such config or recipe: $CONFIG" >&2; exit 2; }

DRY_RUN=0
TRAIN_ARGS=()
for arg in "$@"; do
    if [[ $arg == --dry-run ]]; then DRY_RUN=1; else TRAIN_ARGS+=("$arg"); fi
done

# '# sbatch: --nodes=4 --gpus-per-node=8 ...' (the first such line of the recipe)
HEADER=$(sed -n 's/^#[[:space:]]*sbatch:[[:space:]]*//p' "$CONFIG" | head -n 1)
read -r -a HEADER_ARGS <<<"$HEADER"
read -r -a EXTRA_ARGS <<<"${CALIBCLIP_SBATCH_ARGS:-}"

NAME=$(basename "$CONFIG" .yaml)
RUN_NAME=${CALIBCLIP_RUN_NAME:-$NAME}
for arg in "${TRAIN_ARGS[@]}"; do
    [[ $arg == run.name=* ]] && RUN_NAME=${arg#run.name=}
done
export CALIBCLIP_OUTPUT_DIR=${CALIBCLIP_OUTPUT_DIR:-$PWD/runs}
export CALIBCLIP_RUN_NAME=$RUN_NAME
LOG_DIR="$CALIBCLIP_OUTPUT_DIR/$RUN_NAME/logs"

CMD=(sbatch --job-name="$NAME" --output="$LOG_DIR/slurm-%j.out" "${HEADER_ARGS[@]}"
     "${EXTRA_ARGS[@]}" "$HERE/train.sbatch" "$CONFIG" "${TRAIN_ARGS[@]}")
if [[ $DRY_RUN == 1 ]]; then
    printf 'CALIBCLIP_OUTPUT_DIR=%q CALIBCLIP_RUN_NAME=%q' "$CALIBCLIP_OUTPUT_DIR" "$RUN_NAME"
    printf ' %q' "${CMD[@]}"
    echo
    exit 0
fi
mkdir -p "$LOG_DIR"  # sbatch does not create the folder of --output
"${CMD[@]}"
echo "logs: $LOG_DIR/  (tail -f $LOG_DIR/slurm-<job>.out; attempts in $LOG_DIR/attempts.tsv)"
