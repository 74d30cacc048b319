"""The end-to-end tests' server harness leaves nothing running behind it."""

import sys
import time

from dzmodel.proctree import alive
from tests.flows.servers import background


def test_background_kills_what_its_command_started_in_a_session_of_its_own(tmp_path):
    """As a Prefect worker starts its flow runs: a child in a new session, which the group's signals miss."""
    pid_file = tmp_path / "child.pid"
    spawn = ("import subprocess, sys, time; "
             "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'], start_new_session=True); "
             f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(300)")
    with background([sys.executable, "-c", spawn], {}, tmp_path / "log"):
        deadline = time.time() + 30
        while not (pid_file.exists() and pid_file.read_text()) and time.time() < deadline:
            time.sleep(0.05)
        child = int(pid_file.read_text())
        assert alive(child)
    assert not alive(child)
