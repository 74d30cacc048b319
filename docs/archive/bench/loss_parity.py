"""Loss parity of two `dz train` runs (bf16 and fp8) from the same seed and data: the mean loss of the last WINDOW
logged steps of each, their relative difference, the held-out action loss of each run's last scored step
(`train.val_cache`: val_action_loss) and its relative difference, and the curves in one PNG.

    python docs/archive/bench/loss_parity.py BF16_METRICS.jsonl FP8_METRICS.jsonl --out docs/bench/fp8_parity.png \
        [--labels bf16 "fp8 (bf16 stream)"]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def read(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def parity(reference: list[dict], other: list[dict], window: int) -> dict:
    tail = lambda rows: [r["loss"] for r in rows if r["step"] > rows[-1]["step"] - window]  # noqa: E731
    ref, oth = tail(reference), tail(other)
    ref_mean, oth_mean = sum(ref) / len(ref), sum(oth) / len(oth)
    result = {"window_steps": window, "reference_mean_loss": ref_mean, "other_mean_loss": oth_mean,
              "relative_difference": (oth_mean - ref_mean) / ref_mean,
              "steps": [reference[-1]["step"], other[-1]["step"]]}
    held_out = [[r for r in rows if "val_action_loss" in r] for rows in (reference, other)]
    if all(held_out):
        ref_val, oth_val = held_out[0][-1], held_out[1][-1]
        if ref_val["step"] != oth_val["step"]:
            raise SystemExit(f"the runs' last held-out scores are of steps {ref_val['step']} and {oth_val['step']}")
        result.update(heldout_step=ref_val["step"], reference_heldout_action_loss=ref_val["val_action_loss"],
                      other_heldout_action_loss=oth_val["val_action_loss"],
                      heldout_relative_difference=(oth_val["val_action_loss"] - ref_val["val_action_loss"])
                      / ref_val["val_action_loss"])
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reference")
    ap.add_argument("other")
    ap.add_argument("--window", type=int, default=100)
    ap.add_argument("--out", default="fp8_parity.png")
    ap.add_argument("--labels", nargs=2, default=["bf16", "fp8"], metavar=("REFERENCE", "OTHER"),
                    help="the two runs' names in the plot")
    ns = ap.parse_args()
    labels = ns.labels  # reference, other
    reference, other = read(ns.reference), read(ns.other)
    result = parity(reference, other, ns.window)
    print(json.dumps(result))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    held = "heldout_step" in result
    fig, axes = plt.subplots(1, 2 if held else 1, figsize=(12 if held else 7, 4), squeeze=False)
    ax = axes[0][0]
    for rows, label in zip((reference, other), labels):
        ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label=label, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"last {ns.window} steps: {labels[1]} {100 * result['relative_difference']:+.2f} % against {labels[0]}")
    ax.legend()
    if held:
        ax = axes[0][1]
        for rows, label in zip((reference, other), labels):
            scored = [r for r in rows if "val_action_loss" in r]
            ax.plot([r["step"] for r in scored], [r["val_action_loss"] for r in scored], "o-", label=label)
        ax.set_xlabel("step")
        ax.set_ylabel("held-out action loss")
        ax.set_title(f"step {result['heldout_step']}: {labels[1]} {100 * result['heldout_relative_difference']:+.2f} % "
                     f"against {labels[0]}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(ns.out, dpi=120)
    print(f"plot: {ns.out}")


if __name__ == "__main__":
    main()
