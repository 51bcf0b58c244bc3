"""``aiogpu info``: the backend, why it was chosen, and every device with its lanes."""
from __future__ import annotations

import argparse


def run(args: argparse.Namespace) -> int:
    from ..runtime import Runtime

    rt = Runtime(args.backend)
    try:
        print(rt.describe())
    finally:
        rt.close()
    return 0
