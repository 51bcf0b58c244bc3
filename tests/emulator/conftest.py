"""Fixtures of the emulator tests: fresh emulators, shut down and checked for internal errors."""
from __future__ import annotations

import pytest

from emu_helpers import Hsa


@pytest.fixture
def make_hsa():
    made: list[Hsa] = []

    def make(**options) -> Hsa:
        h = Hsa(**options)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()
        assert not h.emu.api_errors, [e.traceback for e in h.emu.api_errors]
        assert not h.emu.kernarg_mismatches, h.emu.kernarg_mismatches


@pytest.fixture
def hsa(make_hsa) -> Hsa:
    return make_hsa()
