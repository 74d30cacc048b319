"""The suite's guard against processes that outlive it (tests/leftovers.py): shown failing a session whose test
leaves a process running, and passing one whose test ends what it started."""

import subprocess
import sys
from pathlib import Path

from dzmodel.proctree import alive

ROOT = Path(__file__).resolve().parents[1]


def _session(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    (tmp_path / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    (tmp_path / "test_child.py").write_text(
        "import subprocess, sys\n\n"
        "def test_starts_a_process(tmp_path_factory):\n"
        f"    child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True)\n"
        f"    open({str(tmp_path / 'pid')!r}, 'w').write(str(child.pid))\n{body}")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", str(ROOT / "pyproject.toml"),
               "--rootdir", str(tmp_path), "-m", "", str(tmp_path / "test_child.py")]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_a_process_left_running_fails_the_session_and_is_killed(tmp_path):
    run = _session(tmp_path, "")
    pid = int((tmp_path / "pid").read_text())
    assert run.returncode == 1 and "1 passed" in run.stdout, run.stdout + run.stderr
    assert "still running at the end (killed now): 1" in run.stdout and f"{pid}: " in run.stdout, run.stdout
    assert not alive(pid)


def test_a_session_that_ends_what_it_started_passes(tmp_path):
    run = _session(tmp_path, "    child.kill(); child.wait()\n")
    assert run.returncode == 0 and "1 passed" in run.stdout, run.stdout + run.stderr
    assert "still running" not in run.stdout
