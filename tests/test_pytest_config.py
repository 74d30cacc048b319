"""The suite's own guard: a test that hangs (a client waiting for an answer that never comes) fails with its
traceback after [tool.pytest]'s timeout, and the rest of the suite still runs, instead of stalling CI until its
time runs out with nothing in the log."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_suite_has_a_per_test_timeout(request):
    assert request.config.pluginmanager.hasplugin("timeout")
    assert float(request.config.getini("timeout")) >= 600  # the slowest slow test takes about 5 minutes
    assert request.config.getini("timeout_method") == "signal"


def test_a_hanging_test_fails_and_the_next_one_runs(tmp_path):
    (tmp_path / "test_hang.py").write_text(
        "import threading\n\n"
        "def test_waits_forever():\n    threading.Event().wait()\n\n"
        "def test_after():\n    pass\n")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", str(ROOT / "pyproject.toml"),
               "--rootdir", str(tmp_path), "-o", "timeout=2", "-m", "", str(tmp_path / "test_hang.py")]
    run = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "Timeout (>2.0s)" in run.stdout and "1 failed, 1 passed" in run.stdout, run.stdout
