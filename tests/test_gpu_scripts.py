"""The GPU-side scripts of docs/results/ (run where no test runs): they parse, and their usage names every command."""

import re
import subprocess
from pathlib import Path

import pytest

RESULTS = Path(__file__).parents[1] / "docs" / "results"
SCRIPTS = sorted(RESULTS.glob("*.sh"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_the_script_parses(script):
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("name", ["libero_scripted_gpu.sh", "fastpath_gpu.sh"])
def test_the_usage_line_names_every_command(name):
    script = RESULTS / name
    text = script.read_text()
    commands = set(re.findall(r"^  ([a-z-]+)\)$", text, re.M))
    result = subprocess.run(["bash", str(script), "no-such-command"], capture_output=True, text=True)
    assert result.returncode == 2
    assert commands and all(c in result.stderr for c in commands), (commands, result.stderr)


def test_the_runs_plot_reads_every_recorded_result(tmp_path):
    """docs/results/plot_runs.py names the CSVs of docs/results.md §§6-8: each exists and has its "all" row."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("plot_runs", RESULTS / "plot_runs.py")
    plot_runs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot_runs)
    files = [f for *_, pattern in plot_runs.RUNS.values() for f in plot_runs.expand(pattern)]
    assert len(files) >= 20 and all(f.is_file() for f in files), [f for f in files if not f.is_file()]
    assert all(n in (40, 80) and 0 <= k <= n for _, k, n in map(plot_runs.overall, files))
    low, high = plot_runs.wilson(4, 40)  # 10 %: about 4-24 %
    assert 0.03 < low < 0.05 and 0.22 < high < 0.25 and plot_runs.wilson(0, 40)[0] == 0
    assert plot_runs.main(tmp_path / "runs.png").stat().st_size > 10_000


def test_the_final_csvs_are_the_evaluations_own_episodes(tmp_path):
    """docs/results/final/seed<N>.csv are rebuilt from the evaluations' per-episode files (10 tasks x 50 init
    states per seed, one checkpoint each) and hold the numbers docs/results.md reports."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("final_tables", RESULTS / "final_tables.py")
    final_tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(final_tables)
    counts = final_tables.main(tmp_path)
    assert counts == {0: (439, 500), 1: (400, 500), 2: (443, 500)}
    for seed in counts:
        name = f"seed{seed}.csv"
        assert (tmp_path / name).read_text() == (RESULTS / "final" / name).read_text(), name
        assert (tmp_path / name).read_text().splitlines()[0] == "seed,task,init_state,checkpoint_step,success"
