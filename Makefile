# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv when missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# On machines without CUDA install the CPU torch build first so that no dependency pulls a
# multi-GB CUDA torch. Override with `make TORCH_SPEC=... test`.
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo "torch" || echo "torch==2.13.0")

.PHONY: demo test venv clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

venv: $(VENV)/.installed

# `make demo FRESH=1` also retrains the cached base model (demo_out/base_hf).
FRESH ?=
demo: $(VENV)/.installed
	$(PY) -m megatron_ext.demo $(if $(filter-out 0,$(FRESH)),--fresh)

test: $(VENV)/.installed
	bash tests/run.sh $(PY)

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info demo_out
