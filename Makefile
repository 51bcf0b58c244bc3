# The two commands of the README. Each creates or reuses .venv and installs what it needs:
# `make demo` (and info, bench, stress) aiogpu alone, `make test` also its test extras and Ray.
# `make test` runs the suite on the compiled core and fails if the core is interpreted where a C
# compiler exists; `make test-interpreted` runs it on the core's .py sources (AIOGPU_PURE_CORE=1).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Re-installed when the build changes (pyproject, setup.py, the optional C parts' sources, the
# core's sources, which the install compiles, this file). The editable install is setuptools'
# "compat" mode: a path entry to this tree, which mypy follows to the package's py.typed (the
# default mode's import hook is invisible to it; setuptools calls compat transitional: its
# "strict" mode, a tree of links, serves mypy too). It builds the compiled parts in the tree.
C_SOURCES := aiogpu/cuda/_hotc.c aiogpu/vkfd/vkfd.c aiogpu/vkfd/hsakmt.ver
# (the core's modules, and every module elsewhere with a .pxd: the install compiles them)
PXD := $(shell find aiogpu -name '*.pxd')
CORE_SOURCES := $(sort $(wildcard aiogpu/_core/*.py) $(PXD) $(wildcard $(PXD:.pxd=.py)))
BUILD_SOURCES := pyproject.toml setup.py $(C_SOURCES) $(CORE_SOURCES) Makefile
BUILD := $(shell cat $(BUILD_SOURCES) | cksum | cut -d' ' -f1)
# Where a C compiler exists the install compiles the core, and the suite checks it did.
EXPECT_COMPILED := $(if $(shell command -v $${CC:-cc} 2>/dev/null),1,0)
INSTALL := $(PY) -m pip install -q --config-settings editable_mode=compat -e
BASE_STAMP := $(VENV)/.installed-$(BUILD)-base
TEST_STAMP := $(VENV)/.installed-$(BUILD)-test
# A test install serves the demo too.
RUN_STAMP = $(if $(wildcard $(TEST_STAMP)),$(TEST_STAMP),$(BASE_STAMP))

.PHONY: demo test test-interpreted bench info stress clean

$(VENV)/.venv-created:
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@touch $@

$(BASE_STAMP): $(BUILD_SOURCES) | $(VENV)/.venv-created
	$(INSTALL) .
	@rm -f $(VENV)/.installed-*-base; touch $@

$(TEST_STAMP): $(BUILD_SOURCES) | $(VENV)/.venv-created
	$(INSTALL) '.[test,ray]'
	@rm -f $(VENV)/.installed-*; touch $@

demo: $(RUN_STAMP)
	$(PY) -m aiogpu demo

test: $(TEST_STAMP)
	AIOGPU_EXPECT_COMPILED=$(EXPECT_COMPILED) $(PY) -m pytest -q

test-interpreted: $(TEST_STAMP)
	AIOGPU_PURE_CORE=1 $(PY) -m pytest -q

bench: $(TEST_STAMP)
	$(PY) -m aiogpu bench

info: $(RUN_STAMP)
	$(PY) -m aiogpu info

stress: $(RUN_STAMP)
	$(PY) -m aiogpu stress

clean:
	rm -rf $(VENV) build *.egg-info aiogpu/cuda/_hotc*.so aiogpu/vkfd/libhsakmt.so* \
		aiogpu/_core/_compiled.txt $(PXD:.pxd=.c) $(foreach p,$(PXD:.pxd=),$(wildcard $(p).*.so)) \
		aiogpu/_core/*.so
