"""The GPU-side scripts of docs/results/ (run where no test runs): they parse, and their usage names every command."""

import re
import subprocess
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).parents[1] / "docs" / "results").glob("*.sh"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_the_script_parses(script):
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_the_usage_line_names_every_command():
    script = Path(__file__).parents[1] / "docs" / "results" / "libero_scripted_gpu.sh"
    text = script.read_text()
    commands = set(re.findall(r"^  ([a-z-]+)\)$", text, re.M))
    result = subprocess.run(["bash", str(script), "no-such-command"], capture_output=True, text=True)
    assert result.returncode == 2
    assert commands and all(c in result.stderr for c in commands), (commands, result.stderr)
