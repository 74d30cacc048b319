"""docs/benchmark.md's claims, checked against what they come from: the per-episode files, the expert tables of
docs/results.md, the profiles in params.yaml and the perturbations the evaluation knows."""

import csv
import re
from pathlib import Path

import pytest

from dzmodel.config import load_params
from dzmodel.eval.libero_eval import wilson_interval
from dzmodel.eval.perturb_spec import KINDS

ROOT = Path(__file__).resolve().parents[1]
PAGE = (ROOT / "docs" / "benchmark.md").read_text()
FLAT = " ".join(PAGE.split())  # the prose with its line breaks as spaces


def _table(text: str, header_start: str) -> list[list[str]]:
    """The rows (cells) of the markdown table whose header line starts with `header_start`."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def test_the_object_row_is_the_per_episode_files():
    seeds = {}
    for seed in (0, 1, 2):
        with open(ROOT / "docs" / "results" / "final" / "libero_object" / f"seed{seed}.csv", newline="") as f:
            rows = list(csv.DictReader(f))
        assert len(rows) == 500 and {(int(r["task"]), int(r["init_state"])) for r in rows} == \
            {(t, i) for t in range(10) for i in range(50)}
        seeds[seed] = sum(int(r["success"]) for r in rows)
    wins = sum(seeds.values())
    low, high = wilson_interval(wins, 1500)
    assert f"{wins:,} of 1,500" in FLAT
    assert f"**{100 * wins / 1500:.1f}** (3 seeds, 95 % interval {100 * low:.1f}-{100 * high:.1f})" in PAGE
    assert f"give {seeds[0]}, {seeds[1]} and {seeds[2]} of 500" in FLAT
    assert f"({100 * seeds[0] / 500:.1f}, {100 * seeds[1] / 500:.1f} and {100 * seeds[2] / 500:.1f} %)" in FLAT


def test_the_published_averages_are_the_mean_of_the_four_suites():
    rows = [r for r in _table(PAGE, "| policy |") if not r[0].startswith("**")]
    assert len(rows) == 5
    for row in rows:
        suites, average = [float(x) for x in row[1:5]], float(row[5])
        assert round(sum(suites) / 4 + 1e-9, 1) == average, row[0]


def _expert_rows(results: str, header: str) -> list[list[str]]:
    return _table(results, header)


def test_the_expert_summary_is_the_tables_of_docs_results():
    results = (ROOT / "docs" / "results.md").read_text()
    summary = {r[0]: r for r in _table(PAGE, "| suite | tasks at 10/10 |")}

    def solved(rows):
        counts = []
        for r in rows:
            m = re.fullmatch(r"(\d+)/10", r[1])
            counts.append(int(m.group(1)) if m else None)
        return counts

    for suite, header in [("Object", "| LIBERO-Object task |"), ("Spatial", "| LIBERO-Spatial task"),
                          ("Goal", "| LIBERO-Goal task |"), ("LIBERO-10", "| LIBERO-10 task |")]:
        counts = solved(_expert_rows(results, header))
        assert len(counts) == 10, suite
        done = [c for c in counts if c is not None]
        row = summary[suite]
        assert row[1] == f"{sum(c == 10 for c in counts)} of 10", suite
        assert row[2].startswith(f"{sum(done)}/{10 * len(done)}"), suite
        refused = [i for i, c in enumerate(counts) if c is None]
        assert (", task " + ", ".join(map(str, refused)) + " refused" in row[2]) == bool(refused), suite
        for task, c in enumerate(counts):  # every task below 10/10 is named with its reason
            if c is None or c < 10:
                assert f"task {task}" in row[3], (suite, task)


def test_the_commands_name_profiles_and_perturbations_that_exist():
    params = load_params(ROOT / "params.yaml")
    for name in re.findall(r"--profile (libero_\w+)", PAGE) + ["libero_spatial", "libero_object", "libero_goal",
                                                               "libero_10"]:
        assert name in params.profiles, name
    listed = re.search(r"eval\.perturb=\[([^\]]*)\]", PAGE).group(1)
    assert [p.strip() for p in listed.split(",")] == list(KINDS)
    for name in KINDS:
        assert f"(`{name}`)" in PAGE, name


@pytest.mark.parametrize("suite", ["libero_spatial", "libero_object", "libero_goal", "libero_10"])
def test_each_suite_profile_evaluates_all_50_init_states_of_the_last_checkpoint(suite):
    profile = load_params(ROOT / "params.yaml").profiles[suite]
    assert profile.eval.episodes == 50 and profile.eval.checkpoints == "last" and profile.eval.select_episodes == 0
    assert profile.eval.tasks == list(range(10)) and profile.eval.curve_episodes == 5


@pytest.mark.parametrize("suite, folder", [("Spatial", "spatial_retries"), ("Goal", "goal_30epochs"),
                                           ("10", "libero10_screen")])
def test_each_screen_number_is_its_per_episode_file(suite, folder):
    with open(ROOT / "docs" / "results" / folder / "per_episode.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    wins, n = sum(int(r["success"]) for r in rows), len(rows)
    low, high = wilson_interval(wins, n)
    bullet = re.search(rf"\*\*LIBERO-{suite}\*\*: .*? (\d+) of (\d+) \(95 % interval ([\d.]+)-([\d.]+) %\)", FLAT)
    assert bullet, f"no screen number for {suite}"
    assert bullet.groups() == (str(wins), str(n), f"{100 * low:.1f}", f"{100 * high:.1f}")


def _perturbed_episodes(folder: str) -> list[tuple[str, bool]]:
    """(perturbation, success) of each episode in a screen's robustness_episodes.csv (success written as True/False
    by the older evaluation, 1/0 by the current one)."""
    with open(ROOT / "docs" / "results" / folder / "robustness_episodes.csv", newline="") as f:
        return [(e["perturbation"], e["success"] in ("True", "1")) for e in csv.DictReader(f)]


def test_the_robustness_table_is_the_perturbed_episodes():
    table = _table(PAGE, "| perturbation |")
    assert [r[0] for r in table] == ["none", *(f"{k}" for k in
                                              ("position=0.05", "swap=task", "camera=10", "light=0.5", "table=random",
                                               "paraphrase=random", "distractor=2"))]
    measured = 0
    for column, folder in ((1, "goal_screen"), (3, "goal_30epochs")):  # one checkpoint per pair of columns
        episodes = _perturbed_episodes(folder)
        for row in table:
            name, wins, interval = row[0], row[column], row[column + 1]
            ran = [won for kind, won in episodes if kind == name]
            if wins.startswith("not measured"):  # (the 15-epoch screen's distractor episodes never started an env)
                continue
            low, high = wilson_interval(sum(ran), len(ran))
            assert (wins, interval) == (str(sum(ran)), f"{100 * low:.1f}-{100 * high:.1f} %"), (folder, name)
            assert len(ran) == 50
            measured += 1
    assert measured == 9 and "successes of 50" in PAGE
    names = {k.split("=")[0] for k in (r[0] for r in table)} - {"none"}
    assert names == set(KINDS)  # every perturbation the evaluation knows has a row
