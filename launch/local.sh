#!/usr/bin/env bash
# calibclip training on one machine with torchrun (no SLURM).
#
#   launch/local.sh CONFIG [--set key=value ...]
#   NPROC=8 launch/local.sh launch/recipes/qwen3-8b-grpo.yaml       # one node of 8 GPUs
#   launch/local.sh tiny-cpu --set run.steps=3                       # CPU: 2 gloo ranks
#
# NPROC defaults to the number of visible GPUs, or 2 on a machine without GPUs (CPU mode:
# gloo, one thread per rank). Same environment as launch/train.sbatch on GPUs. Resume works
# the same way: run the same command again and the trainer continues from
# <output_dir>/<run name>/checkpoints/latest. To stop with a checkpoint, send SIGTERM to
# torchrun (`kill <pid>`): it passes SIGTERM to the trainers, which finish the step, save and
# exit 75 (torchrun then prints a SignalException; it waits 30 s before SIGKILL, so for big
# models signal the trainer processes themselves). Ctrl-C (SIGINT) stops without saving.
set -euo pipefail

if [[ $# -lt 1 || $1 == -h || $1 == --help ]]; then
    sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
CONFIG=$1
shift
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(dirname "$HERE")
if [[ ! -f $CONFIG && -f "$HERE/recipes/$CONFIG.yaml" ]]; then
    CONFIG="$HERE/recipes/$CONFIG.yaml"
fi

PYTHON=${CALIBCLIP_PYTHON:-}
if [[ -z $PYTHON ]]; then
    if [[ -x "$REPO/.venv/bin/python" ]]; then PYTHON="$REPO/.venv/bin/python"; else PYTHON=python3; fi
fi

GPUS=0
if command -v nvidia-smi >/dev/null 2>&1 && [[ "${CALIBCLIP_CPU:-0}" != 1 ]]; then
    GPUS=$(nvidia-smi -L 2>/dev/null | wc -l || echo 0)
fi
if [[ $GPUS -gt 0 ]]; then
    NPROC=${NPROC:-$GPUS}
    export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
    export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
    export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
    export TORCH_NCCL_AVOID_RECORD_STREAMS=${TORCH_NCCL_AVOID_RECORD_STREAMS:-1}
    export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
    export NVTE_FLASH_ATTN=${NVTE_FLASH_ATTN:-1}
    export NVTE_FUSED_ATTN=${NVTE_FUSED_ATTN:-1}
else
    NPROC=${NPROC:-2}
    export CUDA_VISIBLE_DEVICES=""
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi
export PYTHONUNBUFFERED=1

echo "[calibclip] torchrun: $NPROC rank(s) on this machine ($([[ $GPUS -gt 0 ]] && echo GPU || echo CPU) mode), config $CONFIG $*"
exec "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node="$NPROC" \
    -m megatron_calibclip.cli train --config "$CONFIG" "$@"
