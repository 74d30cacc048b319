"""The pipeline's plots say what they show: smoothed losses over the raw ones, throughput per GPU only on a GPU,
success with its 95 % interval and N, the held-out action error against its references, previews from a random
VAE labelled as such."""

from __future__ import annotations

import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")


@pytest.fixture
def figures(monkeypatch):
    """Every figure saved, kept open for inspection."""
    from matplotlib.figure import Figure

    saved = []
    real = Figure.savefig

    def keep(fig, path, *args, **kwargs):
        saved.append(fig)
        return real(fig, path, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    monkeypatch.setattr("matplotlib.pyplot.close", lambda *a, **k: None)
    return saved


def _texts(fig) -> str:
    texts = [t.get_text() for t in fig.texts]
    for ax in fig.axes:
        texts += [ax.get_title(), ax.get_ylabel(), *(t.get_text() for t in ax.texts)]
        legend = ax.get_legend()
        texts += [t.get_text() for t in legend.get_texts()] if legend else []
    return "\n".join(texts)


def test_losses_are_smoothed_over_faint_raw_values_and_throughput_names_its_unit(tmp_path, figures):
    from dzmodel.stages.train import plot_training, smoothed, throughput_unit

    assert smoothed([1.0, 0.0, 0.0], span=1) == [1.0, 0.0, 0.0] and smoothed([2.0, 0.0], span=3) == [2.0, 1.0]
    rows = [{"step": s, "loss": 1.0 + (s % 2), "action_loss": 0.5, "dynamics_loss": 0.5,
             "samples_per_s_per_gpu": 4.0, "peak_mem_gib": 1.0} for s in range(1, 41)]
    plot_training(rows, tmp_path, throughput_unit(on_gpu=False))
    losses, throughput = figures
    lines = losses.axes[0].get_lines()
    assert len(lines) == 6 and sorted(line.get_alpha() or 1.0 for line in lines)[:3] == [0.25] * 3
    smooth = next(line for line in lines if line.get_label() == "loss (smoothed)")
    assert max(smooth.get_ydata()[10:]) - min(smooth.get_ydata()[10:]) < 0.5  # the raw loss jumps by 1
    assert "per process (CPU)" in _texts(throughput) and "per GPU" not in _texts(throughput)
    assert throughput_unit(on_gpu=True) == "samples/s per GPU"


def test_success_is_drawn_with_wilson_intervals_and_n(tmp_path, figures):
    from dzmodel.eval.libero_eval import _row, plot_success, wilson_interval

    rows = [_row(500, "all", "", 1, 1), _row(1000, "all", "", 50, 40)]
    plot_success(rows, tmp_path / "s.png", "success")
    (fig,) = figures
    assert "n=1" in _texts(fig) and "n=50" in _texts(fig) and "Wilson" in _texts(fig)
    low, high = wilson_interval(1, 1)
    assert high - low > 0.7  # one episode: the bar spans most of the axis, not a flat point
    (bars,) = [c for c in fig.axes[0].collections if c.get_segments()]
    spans = [seg[1][1] - seg[0][1] for seg in bars.get_segments()]
    assert spans[0] == pytest.approx(high - low) and spans[1] < 0.3


def test_action_error_is_drawn_against_its_references_or_says_why_not(tmp_path, figures):
    from dzmodel.eval.action_error import plot_action_error

    result = {"measured": True, "windows": 12, "mean_predictor": 0.4, "untrained": 0.9,
              "steps": [{"step": 500, "trained": 0.3, "ratio": 0.75}, {"step": 1000, "trained": 0.1, "ratio": 0.25}]}
    assert plot_action_error(result, tmp_path / "a.png").is_file()
    plot_action_error({"measured": False, "reason": "train.heldout_episodes is 0"}, tmp_path / "b.png")
    measured, skipped = figures
    assert {"trained", "mean predictor", "untrained"} <= set(_texts(measured).splitlines())
    assert "12 windows" in _texts(measured)
    assert "not measured" in _texts(skipped) and "heldout_episodes is 0" in _texts(skipped)


def test_previews_from_a_random_vae_say_so(tmp_path, figures):
    import numpy as np

    from dzmodel.eval.previews import RANDOM_VAE_NOTE, ROWS, write_grid

    strip = np.zeros((4, 8, 8 * (1 + len(ROWS)), 3), dtype=np.uint8)
    write_grid([("episode 0", strip)], tmp_path / "g.png", columns=2, note=RANDOM_VAE_NOTE)
    write_grid([("episode 0", strip)], tmp_path / "h.png", columns=2)
    random, pretrained = figures
    assert "seeded random" in _texts(random) and "seeded random" not in _texts(pretrained)
