"""Ctrl-C held back in critical sections: the code lives in ``aiogpu._core.interrupts`` (compiled
with the core); this name is that module itself, so that patching either patches the code in use."""
import sys

from ._core import interrupts

sys.modules[__name__] = interrupts
