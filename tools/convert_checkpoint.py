#!/usr/bin/env python
"""Standalone checkpoint conversion (the same commands as `calibclip convert`).

    tools/convert_checkpoint.py hf-to-mcore HF_DIR OUT_DIR [--tp N] [--pp N] [--preset NAME]
    tools/convert_checkpoint.py mcore-to-hf CKPT_DIR OUT_DIR [--dtype bfloat16]
    tools/convert_checkpoint.py gguf-to-hf smollm2|FILE.gguf OUT_DIR [--break-bf16-ties SEED]
    tools/convert_checkpoint.py break-bf16-ties HF_DIR OUT_DIR --seed SEED

Exit status 0 on success, 2 on bad input (the message names the tensor or file).
See docs/checkpoints.md.
"""
import sys

from megatron_calibclip.checkpoint.cli import main

if __name__ == "__main__":
    sys.exit(main())
