"""`dz pipeline run` refuses bad parameters at once, before Prefect is imported or any server is started: one line
naming the profile or the key, exit status 2."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import sys
from dzmodel.cli import main
rc = main(sys.argv[1:])
print("rc", rc, "prefect imported", any(m == "prefect" or m.startswith("prefect.") for m in sys.modules))
"""


@pytest.mark.parametrize("args, words", [
    (["--profile", "dmeo"], "profile 'dmeo' is not in"),
    (["--profile", "demo", "--set", "train.nosuch=1"], "--set train.nosuch=1: unknown key"),
])
def test_bad_parameters_fail_before_prefect_starts(tmp_path, args, words):
    pytest.importorskip("prefect", reason="the pipeline extras are not installed (make setup)")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PREFECT_HOME": str(tmp_path / "prefect")}
    r = subprocess.run([sys.executable, "-c", PROBE, "pipeline", "run", "--params", str(ROOT / "params.yaml"),
                        "--root", str(tmp_path), *args], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=120)
    assert "rc 2 prefect imported False" in r.stdout, (r.stdout, r.stderr)
    errors = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and words in errors[0], r.stderr
    assert not (tmp_path / "prefect").exists()  # no database made or touched
