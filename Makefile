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
	$(PY) -m pip install --quiet --no-compile "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet --no-compile -e '.[dev]'
	@# The bytecode pip would compile one file at a time, on every core at once (2 cores: `make venv` 108 s instead
	@# of ~165 s); files of the packages' own tests that this Python cannot parse are skipped, as by pip.
	$(PY) -c "import compileall, sysconfig; p = sysconfig.get_paths(); \
	  [compileall.compile_dir(d, quiet=2, workers=0) for d in {p['purelib'], p['platlib']}]"
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
