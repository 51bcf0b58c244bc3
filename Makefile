# The two commands of the README. Each creates or reuses .venv and installs what it needs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# (re-installed when the build changes: pyproject, setup.py, the optional C parts' sources)
C_SOURCES := aiogpu/cuda/_hotc.c aiogpu/vkfd/vkfd.c aiogpu/vkfd/hsakmt.ver
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml setup.py $(C_SOURCES) | cksum | cut -d' ' -f1)

.PHONY: demo test bench info stress clean

$(STAMP): pyproject.toml setup.py $(C_SOURCES)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,ray]'
	@rm -f $(VENV)/.installed-*; touch $@

demo: $(STAMP)
	$(PY) -m aiogpu demo

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) -m aiogpu bench

info: $(STAMP)
	$(PY) -m aiogpu info

clean:
	rm -rf $(VENV) build *.egg-info aiogpu/cuda/_hotc*.so aiogpu/vkfd/libhsakmt.so*
