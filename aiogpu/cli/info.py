"""``aiogpu info``: the backend, why it was chosen, and every device with its lanes."""
from __future__ import annotations

import argparse

from . import closing


def run(args: argparse.Namespace) -> int:
    from ..runtime import Runtime

    rt = Runtime(args.backend)
    with closing(rt):
        print(rt.describe())
    return 0
