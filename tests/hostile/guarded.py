"""Run a hostile input in a child Python process whose memory the parent watches: the child reports its resident
memory after its imports and at the end, and the parent kills it past a ceiling, so a test that measures memory
can fail without taking the machine down."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CEILING_KB = 1_500_000  # the child is killed past this resident size (a runaway, not a measurement)

PROLOGUE = """
import sys, time
def _status_kb(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
"""

# The peak is this process's own (VmHWM, reset to the current size before the body: "5" to clear_refs), not
# getrusage's, which also counts the parent's size at the fork.
MEASURE = """
with open("/proc/self/clear_refs", "w") as _f:
    _f.write("5")
_base = _status_kb("VmRSS")
_start = time.perf_counter()
try:
{body}
finally:
    print(f"ELAPSED {{time.perf_counter() - _start:.3f}}")
    print(f"GROWTH_KB {{_status_kb('VmHWM') - _base}}")
"""


def _rss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


class Outcome:
    def __init__(self, rc: int | None, out: str, killed: str = ""):
        self.rc, self.out, self.killed = rc, out, killed
        values = dict(line.split(" ", 1) for line in out.splitlines() if line.startswith(("ELAPSED ", "GROWTH_KB ")))
        self.elapsed = float(values.get("ELAPSED", "inf"))
        self.growth_mb = int(values.get("GROWTH_KB", "10000000")) / 1024

    def lines(self) -> list[str]:
        return [line for line in self.out.splitlines() if not line.startswith(("ELAPSED ", "GROWTH_KB "))]


def run_guarded(setup: str, body: str, timeout_s: float = 20.0) -> Outcome:
    """`setup` (imports, files) runs first; the growth of peak memory and the time are measured over `body`."""
    script = PROLOGUE + textwrap.dedent(setup) + MEASURE.format(body=textwrap.indent(textwrap.dedent(body), "    "))
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    deadline, killed = time.monotonic() + timeout_s, ""
    while proc.poll() is None:
        if _rss_kb(proc.pid) > CEILING_KB:
            killed = f"killed past {CEILING_KB // 1024} MB resident"
        elif time.monotonic() > deadline:
            killed = f"killed after {timeout_s} s"
        if killed:
            proc.kill()
            break
        time.sleep(0.02)
    out = proc.communicate()[0]
    return Outcome(proc.returncode, out, killed)
