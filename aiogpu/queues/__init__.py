"""The design card's name for the HSA AQL writer, back-log, kernarg ring and copy-engine choice.

The code lives in ``aiogpu/hsa/queues.py``, with the HSA backend, its only user. This name stays
importable (``from aiogpu.queues import AqlQueue``) as that very module, not a copy of its names:
``aiogpu.queues is aiogpu.hsa.queues``, so whatever is set on one is seen through the other.
"""
import sys
from typing import TYPE_CHECKING

from ..hsa import queues as _module

if TYPE_CHECKING:     # the names, for type checkers (at run time the module itself stands here)
    from ..hsa.queues import *  # noqa: F403

sys.modules[__name__] = _module
