"""The design card's name for the HSA signal pool and the background waiter thread.

The code lives in ``aiogpu/hsa/signals.py``, with the HSA backend, its only user. This name stays
importable (``from aiogpu.signals import CompletionHub``) as that very module, not a copy of its
names: ``aiogpu.signals is aiogpu.hsa.signals``, so whatever is set on one is seen through the other.
"""
import sys
from typing import TYPE_CHECKING

from ..hsa import signals as _module

if TYPE_CHECKING:     # the names, for type checkers (at run time the module itself stands here)
    from ..hsa.signals import *  # noqa: F403

sys.modules[__name__] = _module
