"""A watchdog for the test run (started by conftest.py): when one test runs past `dump_after_s`, the stacks of the
test process and of every process it started, C stacks through gdb where it is installed and Python stacks through
faulthandler (SIGUSR1, registered by conftest.py and inherited by forked ranks); past `kill_after_s`, those processes
are killed so that the run ends with that report instead of running into CI's limit.

pytest-timeout ends a test hung in Python; a test hung in C (a spin or a wait that never returns to the interpreter)
holds the process where its signal cannot act, and a thread of the test process cannot be relied on either (the hung
thread may hold the GIL). Hence a process of its own, told by conftest.py when each test starts and ends:
`python hang_watch.py PID DUMP_AFTER_S KILL_AFTER_S`, lines `start NODEID` and `end` on its standard input. It ends
when the test process does."""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
import time


def _children() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(name))
    return children


def _tree(root: int) -> list[int]:
    """`root` and its descendants, parents first (this watchdog left out)."""
    children, order, i = _children(), [root], 0
    while i < len(order):
        order.extend(c for c in children.get(order[i], []) if c != os.getpid())
        i += 1
    return order


def _catches_sigusr1(pid: int) -> bool:
    """Whether the process has a handler for SIGUSR1 (faulthandler's, in the test process and ranks forked from it)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            caught = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    except (OSError, StopIteration, ValueError):
        return False
    return bool(caught >> (signal.SIGUSR1 - 1) & 1)


def _report(root: int, nodeid: str, elapsed: float) -> None:
    print(f"\n[hang-watch] {nodeid} has run for {elapsed:.0f} s: stacks of the test process {root} and its children",
          flush=True)
    gdb = shutil.which("gdb")
    for pid in _tree(root):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace")[:200]
        except OSError:
            continue
        print(f"[hang-watch] process {pid}: {command}", flush=True)
        if gdb is not None:
            try:
                subprocess.run([gdb, "-p", str(pid), "-batch", "-nx", "-iex", "set auto-load off", "-ex",
                                "set print frame-arguments none", "-ex", "thread apply all bt 12"],
                               stdin=subprocess.DEVNULL, timeout=120)
            except subprocess.TimeoutExpired:
                print(f"[hang-watch] gdb did not finish on {pid} within 120 s", flush=True)
        if _catches_sigusr1(pid):  # faulthandler's dump of every Python thread, to the same stderr
            try:
                os.kill(pid, signal.SIGUSR1)
            except ProcessLookupError:  # ended since
                continue
            time.sleep(1.0)
        else:  # a process started by exec (a server under test, a compiler): SIGUSR1 would end it
            print(f"[hang-watch] process {pid} has no SIGUSR1 handler: no Python stacks", flush=True)


def main() -> None:
    root, dump_after_s, kill_after_s = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
    nodeid, started, reported = "", 0.0, False
    stdin = sys.stdin.fileno()
    buffer = b""
    reading = True
    while True:
        ready, _, _ = select.select([stdin] if reading else [], [], [], 1.0)
        if ready:
            data = os.read(stdin, 65536)
            reading = bool(data)  # at the end of the input, the test process is still watched until it exits
            buffer += data
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                kind, _, name = line.decode(errors="replace").partition(" ")
                nodeid, started, reported = (name, time.monotonic(), False) if kind == "start" else ("", 0.0, False)
        try:
            os.kill(root, 0)
        except ProcessLookupError:
            return
        if not nodeid:
            continue
        elapsed = time.monotonic() - started
        if elapsed > dump_after_s and not reported:
            reported = True
            _report(root, nodeid, elapsed)
        if elapsed > kill_after_s:
            print(f"[hang-watch] {nodeid} has run for {elapsed:.0f} s: killing the test run", flush=True)
            for pid in reversed(_tree(root)):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            return


if __name__ == "__main__":
    main()
