"""Success of every closed-loop run of docs/results.md sections 6-8 (LIBERO-Object tasks 0-3) against the training
step, with 95 % Wilson intervals: the seed-to-seed and checkpoint-to-checkpoint spread in one picture.

    .venv/bin/python docs/archive/results/plot_runs.py            # writes docs/archive/results/libero_scripted_runs.png
"""

import csv
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).parent
# label -> (colour, marker, filled, CSV files); each CSV holds one checkpoint's per-task rows and an "all" row
RUNS = {
    "round-2 code, seed 0 (round 2)": ("tab:gray", "s", True, "round2/results_s{1000,1500,2000,3000}.csv"),
    "round-2 code, seed 0 (round 3)": ("black", "s", True, "round3/old_code_s{1000,1500,2000,3000}.csv"),
    "round-2 code, seed 1 (round 4)": ("tab:purple", "s", True, "round4/round2code_s1_raw_1500.csv"),
    "full, seed 0, device noise (round 3)": ("tab:red", "o", True, "round3/new_raw_s{1500,3000}.csv"),
    "full, seed 0, device noise, EMA (round 3)": ("tab:red", "o", False, "round3/new_ema_s{1500,3000}.csv"),
    "full, seed 0, round 2's noise": ("tab:orange", "o", True, "round4/full_s0cpu_raw_{1500,2000}.csv"),
    "full, seed 1": ("tab:blue", "o", True, "round4/full_s1_raw_{1500,2000}.csv"),
    "full, seed 1, EMA": ("tab:blue", "o", False, "round4/full_s1_ema_2000.csv"),
    "full, seed 2": ("tab:cyan", "o", True, "round4/full_s2_raw_{1500,2000}.csv"),
    "full, seed 2, EMA": ("tab:cyan", "o", False, "round4/full_s2_ema_2000.csv"),
    "LoRA r64, seed 0": ("tab:green", "^", True, "round4/lora_s0_raw_{1500,2000}.csv"),
    "LoRA r64, seed 1": ("tab:olive", "^", True, "round4/lora_s1_raw_2000.csv"),
    "LoRA r64, seed 1, EMA": ("tab:olive", "^", False, "round4/lora_s1_ema_2000.csv"),
}


def expand(pattern: str) -> list[Path]:
    """'a_{1,2}.csv' -> [a_1.csv, a_2.csv]: one brace group, as the shell would."""
    if "{" not in pattern:
        return [HERE / pattern]
    head, rest = pattern.split("{", 1)
    choices, tail = rest.split("}", 1)
    return [HERE / f"{head}{c}{tail}" for c in choices.split(",")]


def overall(path: Path) -> tuple[int, int, int]:
    """(step, successes, episodes) of the checkpoint's "all" row."""
    with path.open() as f:
        for row in csv.DictReader(f):
            if row["task"] == "all":
                return int(row["step"]), int(row["successes"]), int(row["episodes"])
    raise ValueError(f"{path}: no 'all' row")


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    p, d = k / n, 1 + z * z / n
    centre, half = (p + z * z / (2 * n)) / d, z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return max(0.0, centre - half), min(1.0, centre + half)


def main(out: Path = HERE / "libero_scripted_runs.png") -> Path:
    fig, ax = plt.subplots(figsize=(10, 5.5))
    for i, (label, (colour, marker, filled, pattern)) in enumerate(RUNS.items()):
        points = sorted(overall(p) for p in expand(pattern))
        xs = [s + (i - len(RUNS) / 2) * 12 for s, _, _ in points]  # spread the runs apart at each step
        ys = [k / n for _, k, n in points]
        lo, hi = zip(*(wilson(k, n) for _, k, n in points))
        ax.errorbar(xs, ys, yerr=[[y - a for y, a in zip(ys, lo)], [b - y for y, b in zip(ys, hi)]], color=colour,
                    marker=marker, mfc=colour if filled else "white", ls="-" if filled else "none", capsize=2,
                    label=label)
    ax.set(xlabel="training step", ylabel="success, LIBERO-Object tasks 0-3", xticks=[1000, 1500, 2000, 3000],
           ylim=(-0.02, 0.75), title="libero_scripted: every evaluated checkpoint (95 % Wilson intervals)")
    ax.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    ax.legend(fontsize=7, ncol=2, loc="upper left")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return out


if __name__ == "__main__":
    print(main())
