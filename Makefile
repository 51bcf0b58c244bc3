# The two commands of the README. Each creates or reuses .venv and installs what it needs:
# `make demo` (and info, bench, stress) aiogpu alone, `make test` also its test extras and Ray.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Re-installed when the build changes (pyproject, setup.py, the optional C hot path's source,
# this file). The editable install is setuptools' "compat" mode: a path entry to this tree, which
# mypy follows to the package's py.typed (the default mode's import hook is invisible to it;
# setuptools calls compat transitional: its "strict" mode, a tree of links, serves mypy too).
BUILD := $(shell cat pyproject.toml setup.py aiogpu/cuda/_hotc.c Makefile | cksum | cut -d' ' -f1)
INSTALL := $(PY) -m pip install -q --config-settings editable_mode=compat -e
BASE_STAMP := $(VENV)/.installed-$(BUILD)-base
TEST_STAMP := $(VENV)/.installed-$(BUILD)-test
# A test install serves the demo too.
RUN_STAMP = $(if $(wildcard $(TEST_STAMP)),$(TEST_STAMP),$(BASE_STAMP))

.PHONY: demo test bench info stress clean

$(VENV)/.venv-created:
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@touch $@

$(BASE_STAMP): pyproject.toml setup.py aiogpu/cuda/_hotc.c Makefile | $(VENV)/.venv-created
	$(INSTALL) .
	@rm -f $(VENV)/.installed-*-base; touch $@

$(TEST_STAMP): pyproject.toml setup.py aiogpu/cuda/_hotc.c Makefile | $(VENV)/.venv-created
	$(INSTALL) '.[test,ray]'
	@rm -f $(VENV)/.installed-*; touch $@

demo: $(RUN_STAMP)
	$(PY) -m aiogpu demo

test: $(TEST_STAMP)
	$(PY) -m pytest -q

bench: $(TEST_STAMP)
	$(PY) -m aiogpu bench

info: $(RUN_STAMP)
	$(PY) -m aiogpu info

stress: $(RUN_STAMP)
	$(PY) -m aiogpu stress

clean:
	rm -rf $(VENV) build *.egg-info aiogpu/cuda/_hotc*.so
