"""``aiogpu info``: which core is loaded (compiled or interpreted), the backend, why it was
chosen, and every device with its lanes."""
from __future__ import annotations

import argparse

from . import closing


def run(args: argparse.Namespace) -> int:
    from .. import _core
    from ..runtime import Runtime

    print(_core.summary())          # first: it holds where no runtime starts
    rt = Runtime(args.backend)
    with closing(rt):
        print(rt.describe())
    return 0
