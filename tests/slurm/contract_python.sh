#!/usr/bin/env bash
# CALIBCLIP_PYTHON stand-in: runs tests/slurm/contract_trainer.py with the trainer's arguments.
exec "${CONTRACT_PYTHON:-python3}" "$(dirname "$0")/contract_trainer.py" "$@"
