"""The final recipes' per-episode results: joins the evaluations of each training seed's last checkpoint into
docs/results/final/<suite>/seed<N>.csv (seed,task,init_state,checkpoint_step,success; one row per episode) and prints
the per-seed and per-task successes with 95 % Wilson intervals. docs/results/final/libero_object/ holds the recipe
that the libero_object profile runs now (the bf16 residual stream, rounds 18 and 20);
docs/archive/results/final_fp32_stream/ the recipe before it (round 11, the goal's first three seeds). Refuses
overlapping or missing (task, init state) pairs and a checkpoint that differs within a seed. Usage, from the repo root:

    python docs/archive/results/final_tables.py
"""

import csv
import sys
from collections import defaultdict
from pathlib import Path

from dzmodel.eval.libero_eval import wilson_interval

RESULTS = Path(__file__).resolve().parent  # the archive's evaluation files (the sources below)
OUTPUTS = {"final/libero_object": RESULTS.parents[1] / "results" / "final" / "libero_object",  # the user docs' file
           "final_fp32_stream": RESULTS / "final_fp32_stream"}
RECIPES = {  # folder: {seed: the `dz eval libero` per_episode.csv files that make up its 10 tasks x 50 init states}
    "final/libero_object": {  # the profile's own stages, the bf16 residual stream
        0: ["round18/per_episode.csv"],
        1: ["round20/seed1_per_episode.csv"],
        2: ["round20/seed2_per_episode.csv"],
    },
    "final_fp32_stream": {
        0: ["round10/a10ema8_per_episode.csv", "round11/seed0_init10-49_per_episode.csv"],
        1: ["round10/a10s1ema8_per_episode.csv", "round11/seed1_init10-49_per_episode.csv"],
        2: ["round11/seed2_init0-49_per_episode.csv"],
    },
}
TASKS, INIT_STATES = range(10), range(50)


def read_seed(seed: int, files: list[str]) -> list[dict]:
    rows, seen = [], set()
    for name in files:
        with open(RESULTS / name, newline="") as f:
            for row in csv.DictReader(f):
                key = (int(row["task"]), int(row["init_state"]))
                if int(row["seed"]) != seed:
                    sys.exit(f"{name}: training seed {row['seed']}, expected {seed}")
                if key in seen:
                    sys.exit(f"{name}: task {key[0]} init state {key[1]} evaluated twice for seed {seed}")
                seen.add(key)
                rows.append(row)
    missing = {(t, i) for t in TASKS for i in INIT_STATES} - seen
    if missing:
        sys.exit(f"seed {seed}: {len(missing)} (task, init state) pairs missing, e.g. {sorted(missing)[:3]}")
    if len({r["checkpoint_step"] for r in rows}) != 1:
        sys.exit(f"seed {seed}: more than one checkpoint step")
    return sorted(rows, key=lambda r: (int(r["task"]), int(r["init_state"])))


def line(label: str, wins: int, n: int) -> str:
    low, high = wilson_interval(wins, n)
    return f"{label}: {wins}/{n} = {100 * wins / n:.1f} % (95 % interval {100 * low:.1f}-{100 * high:.1f} %)"


def main(out_root: Path | None = None) -> dict[str, dict[int, tuple[int, int]]]:
    """Writes each recipe's seed<N>.csv into OUTPUTS[recipe] (or out_root/<recipe>); returns {recipe: {seed:
    (successes, episodes)}}."""
    return {name: write_recipe(name, sources, out_root / name if out_root else OUTPUTS[name])
            for name, sources in RECIPES.items()}


def write_recipe(name: str, sources: dict[int, list[str]], out: Path) -> dict[int, tuple[int, int]]:
    print(f"{name}:")
    out.mkdir(parents=True, exist_ok=True)
    counts = {}
    total = [0, 0]
    per_task = defaultdict(list)
    for seed, files in sources.items():
        rows = read_seed(seed, files)
        with open(out / f"seed{seed}.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["seed", "task", "init_state", "checkpoint_step", "success"])
            w.writerows([r["seed"], r["task"], r["init_state"], r["checkpoint_step"], r["success"]] for r in rows)
        wins = sum(int(r["success"]) for r in rows)
        total[0] += wins
        total[1] += len(rows)
        for t in TASKS:
            per_task[t].append(sum(int(r["success"]) for r in rows if int(r["task"]) == t))
        counts[seed] = (wins, len(rows))
        print(line(f"seed {seed} (step {rows[0]['checkpoint_step']})", wins, len(rows)))
    print(line("all seeds", *total))
    print("per task, successes of 50 for seeds " + ", ".join(map(str, sources)) + ":")
    for t, wins in per_task.items():
        print(f"  task {t}: " + " ".join(f"{w:2d}" for w in wins) + f"   ({100 * sum(wins) / (50 * len(wins)):.0f} %)")
    return counts


if __name__ == "__main__":
    main()
