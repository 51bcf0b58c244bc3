"""Ctrl-C on every command: it stops promptly, with one line on stderr and exit status 130
(the shell's 128 + SIGINT), not a traceback, not minutes later."""
from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest

COMMANDS = {
    "demo": ["demo", "--backend", "emulator", "--batches", "20000"],
    "bench": ["bench", "--backend", "emulator", "--quick"],
    "stress": ["stress", "--ops", "1000000", "--gpus", "2", "--seed", "4"],
}
PROGRESS = ("  [", "  .. ")      # stress and bench report progress on stderr


def _pump(stream, name, lines):
    for line in stream:
        lines.put((name, line.rstrip("\n")))
    lines.put((name, None))


@pytest.mark.parametrize("command", list(COMMANDS))
def test_ctrl_c_stops_the_command_with_one_line_and_status_130(command):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "aiogpu", *COMMANDS[command]], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    lines: queue.Queue = queue.Queue()
    for stream, name in ((proc.stdout, "out"), (proc.stderr, "err")):
        threading.Thread(target=_pump, args=(stream, name, lines), daemon=True).start()
    try:
        lines.get(timeout=60)             # it has started and reports something
        time.sleep(1.5)                   # mid-work
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=10)        # a hang guard; the time it took is reported below
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output, ended = [], 0
    while ended < 2:
        name, line = lines.get(timeout=10)
        if line is None:
            ended += 1
        elif name == "err":
            output.append(line)
    print(f"{command}: exited {took:.2f} s after SIGINT")
    assert rc == 130, (rc, output[-20:])
    report = [line for line in output if not line.startswith(PROGRESS)]
    assert report == ["aiogpu: interrupted"], output[-20:]
