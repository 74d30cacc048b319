"""Killing a process tree reaches children in their own sessions (as torchrun's workers are), which a process
group kill misses."""

import os
import signal
import subprocess
import sys
import textwrap
import time

from dzmodel.proctree import alive, descendants, kill_tree

# a launcher that starts a worker in a new session, as torchrun does, and reports the worker's pid
LAUNCHER = textwrap.dedent("""
    import subprocess, sys, time
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    print(worker.pid, flush=True)
    time.sleep(600)
""")


def _launch():
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE, text=True,
                                start_new_session=True)
    return launcher, int(launcher.stdout.readline())


def test_a_group_kill_misses_a_worker_in_its_own_session_and_the_tree_kill_does_not():
    launcher, worker = _launch()
    try:
        assert descendants(launcher.pid) == [worker]
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()
        time.sleep(0.2)
        assert alive(worker)  # what left training running after a killed torchrun
    finally:
        os.kill(worker, signal.SIGKILL)

    launcher, worker = _launch()
    assert sorted(kill_tree(launcher.pid, timeout=10)) == sorted([launcher.pid, worker])
    launcher.wait()
    assert not alive(worker) and not alive(launcher.pid)


def test_a_process_that_already_exited_is_no_error():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    assert kill_tree(p.pid) == [] and descendants(p.pid) == []
