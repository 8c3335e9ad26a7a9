"""The test run's watchdog (tests/hang_watch.py, started by conftest.py): a hung test gets its processes' stacks
printed, then the run is ended."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

HUNG_TEST = textwrap.dedent('''
    import multiprocessing as mp
    import subprocess
    import sys
    import time


    def _wait_in_child():
        time.sleep(300)


    def test_hangs():
        child = mp.get_context("fork").Process(target=_wait_in_child, daemon=True)
        child.start()
        started = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
        while True:
            time.sleep(300)
''')


@pytest.mark.slow
def test_a_hung_test_gets_its_stacks_printed_and_the_run_ended(tmp_path):
    """Without pytest-timeout, as for a test hung where its signal cannot act."""
    (tmp_path / "test_hung.py").write_text(HUNG_TEST)
    tests = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests), os.environ.get("PYTHONPATH", "")]),
           "TORCH_SHIFT_TEST_DUMP_AFTER_S": "3", "TORCH_SHIFT_TEST_KILL_AFTER_S": "12"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider", "-p", "no:timeout",
               str(tmp_path / "test_hung.py")]
    run = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    output = run.stdout + run.stderr
    assert run.returncode == -9, output  # killed by the watchdog
    assert "[hang-watch] test_hung.py::test_hangs has run for" in output, output
    # the test process, its forked child and the program it started
    assert len(re.findall(r"\[hang-watch\] process \d+: ", output)) == 3, output
    assert "in test_hangs" in output and "in _wait_in_child" in output, output  # the forked ones' Python stacks
    # the started program has no SIGUSR1 handler: not sent the signal, which would have ended it before the kill
    assert output.count("has no SIGUSR1 handler") == 1, output
    assert "killing the test run" in output, output
