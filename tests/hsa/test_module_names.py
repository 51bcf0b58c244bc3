"""The design card's module names stay importable: ``aiogpu.signals`` and ``aiogpu.queues`` are
the HSA backend's ``aiogpu.hsa.signals`` and ``aiogpu.hsa.queues`` themselves (one module under
two names, whichever is imported first), so a user's imports and patches reach the code in use."""
from __future__ import annotations

import subprocess
import sys

import pytest

from backends import ROOT


@pytest.mark.parametrize("old, new, name", [("aiogpu.queues", "aiogpu.hsa.queues", "AqlQueue"),
                                            ("aiogpu.signals", "aiogpu.hsa.signals", "CompletionHub")])
@pytest.mark.parametrize("old_first", [True, False], ids=["old-name-first", "new-name-first"])
def test_the_design_card_names_are_the_hsa_modules(old: str, new: str, name: str, old_first: bool) -> None:
    first, second = (old, new) if old_first else (new, old)
    script = (f"import importlib, sys\n"
              f"a = importlib.import_module({first!r})\n"
              f"b = importlib.import_module({second!r})\n"
              f"from {old} import {name} as cls\n"
              f"import aiogpu\n"
              f"assert a is b is sys.modules[{old!r}] is sys.modules[{new!r}], (a, b)\n"
              f"assert getattr(aiogpu, {old.split('.')[1]!r}) is b\n"
              f"assert cls.__module__ == {new!r}, cls.__module__\n"
              f"print('same')\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert out.returncode == 0 and out.stdout == "same\n", out.stderr
