"""Success across training steps with `eval.checkpoints: last`: `eval.curve_episodes: K` evaluates every earlier
converted checkpoint on init states 0..K-1 per task, then the last on all `eval.episodes`; the curve goes to the
eval plots, metrics/eval.json and MLflow (one point per step), and the final number stays the last checkpoint's."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from dzmodel.config import ParamsError, StagePaths, load_params

ROOT = Path(__file__).resolve().parents[2]
STEPS = (10, 20, 30)
# successes per task at each step; on its 2 curve episodes step 20 looks best, yet nothing is picked from the curve
SUCCESSES = {10: 0, 20: 2, 30: 3}


def _profile(tmp_path, *overrides):
    prof = load_params(ROOT / "params.yaml", ["eval.episodes=4", "eval.tasks=[0, 1]", "eval.checkpoints=last",
                                              "eval.action_error=false", "eval.previews=0", "eval.videos=2",
                                              "eval.perturb=[camera=5]", *overrides], "demo").selected()
    paths = StagePaths(tmp_path, "demo")
    for step in STEPS:
        (paths.stage("converted") / f"step_{step:07d}").mkdir(parents=True)
        (paths.stage("converted") / f"step_{step:07d}" / "config.json").write_text("{}")
    return prof, paths


def _fake_libero(monkeypatch, calls: list):
    """evaluate_run without the simulator: per task min(SUCCESSES[step], episodes) successes; it writes the
    tables as the real one does."""
    import dzmodel.eval.libero_eval as libero_eval
    from dzmodel.eval.libero_eval import _row, write_results

    def fake_run(src, cfg, out, steps=None, **kw):
        calls.append({"out": Path(out).name, "first": cfg.first_init_state, "episodes": cfg.episodes,
                      "steps": steps, "videos": cfg.videos, "perturb": list(cfg.perturb)})
        rows = []
        for step in steps or list(STEPS):
            wins = min(SUCCESSES[step], cfg.episodes)
            rows += [_row(step, t, f"task {t}", cfg.episodes, wins) for t in cfg.tasks]
            rows.append(_row(step, "all", "", cfg.episodes * len(cfg.tasks), wins * len(cfg.tasks)))
        write_results(out, rows, [])
        return rows

    monkeypatch.setattr(libero_eval, "evaluate_run", fake_run)


def test_the_curve_evaluates_earlier_checkpoints_on_fewer_init_states_and_reports_the_last(tmp_path, monkeypatch):
    from dzmodel.stages.eval import stage_eval
    from dzmodel.stages.package import chosen_step

    prof, paths = _profile(tmp_path, "eval.curve_episodes=2")
    calls = []
    _fake_libero(monkeypatch, calls)
    result = stage_eval(prof, paths, log=lambda *a: None)
    # the earlier checkpoints on init states 0..1 (no videos, no perturbations), then the last on 0..3 as configured
    assert calls == [{"out": "curve", "first": 0, "episodes": 2, "steps": [10, 20], "videos": 0, "perturb": []},
                     {"out": "eval", "first": 0, "episodes": 4, "steps": [30], "videos": 2,
                      "perturb": ["camera=5"]}]
    table = list(csv.DictReader((paths.plots("eval") / "success_vs_step.csv").open()))
    assert [(r["step"], r["episodes"], r["successes"], r["success_rate"]) for r in table] == \
        [("10", "4", "0", "0.0"), ("20", "4", "4", "1.0"), ("30", "8", "6", "0.75")]
    assert all(float(r["ci_low"]) <= float(r["success_rate"]) <= float(r["ci_high"]) for r in table)
    assert (paths.plots("eval") / "success_vs_step.png").read_bytes()[:4] == b"\x89PNG"
    summary = json.loads(paths.metrics("eval").read_text())
    assert [(p["step"], p["episodes"], p["rate"]) for p in summary["curve"]] == \
        [(10, 4, 0.0), (20, 4, 1.0), (30, 8, 0.75)]
    assert summary["curve_episodes"] == 2
    # the final number is the last checkpoint on all episodes; the curve's better-looking step 20 is never picked
    assert summary["final_success_rate"] == summary["curve"][-1]["rate"] == 0.75
    assert summary["episodes_per_step"] == 8 and summary["best_step"] == 30 and summary["picked_step"] is None
    assert chosen_step(prof, paths) == (30, 0.75)
    assert [r["step"] for r in result["rows"]] == [30, 30, 30]
    assert [r["step"] for r in result["curve"] if r["task"] == "all"] == [10, 20, 30]
    assert result["plot"] == str(paths.plots("eval") / "success_vs_step.png")


def test_without_a_curve_the_last_checkpoint_is_the_only_point(tmp_path, monkeypatch):
    from dzmodel.stages.eval import stage_eval

    prof, paths = _profile(tmp_path)
    calls = []
    _fake_libero(monkeypatch, calls)
    stage_eval(prof, paths, log=lambda *a: None)
    assert [c["steps"] for c in calls] == [[30]]
    summary = json.loads(paths.metrics("eval").read_text())
    assert [p["step"] for p in summary["curve"]] == [30] and summary["curve_episodes"] == 0


def test_each_curve_point_is_an_mlflow_metric_at_its_training_step(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    from dzmodel.stages.eval import stage_eval
    from tasks.tracking import Tracker, tracking_uri

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # the profile's own store: sqlite under tmp_path
    prof, paths = _profile(tmp_path, "eval.curve_episodes=2")
    _fake_libero(monkeypatch, [])
    result = stage_eval(prof, paths, log=lambda *a: None)
    tracker = Tracker.start(prof, "demo", paths, run_name="curve-test")
    rid = tracker.log_stage("eval", result, False, paths)
    tracker.end()
    client = MlflowClient(tracking_uri(prof, paths.root))

    def history(run_id, key):
        return [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)]

    for run_id in (rid, tracker.run_id):
        assert history(run_id, "eval.success_rate") == [(10, 0.0), (20, 1.0), (30, 0.75)]
        assert [s for s, _ in history(run_id, "eval.success_rate.ci_low")] == [10, 20, 30]
        assert [s for s, _ in history(run_id, "eval.success_rate.ci_high")] == [10, 20, 30]
        assert history(run_id, "eval.episodes") == [(10, 4.0), (20, 4.0), (30, 8.0)]
    assert [s for s, _ in history(rid, "eval.success_rate.task_0")] == [10, 20, 30]
    parent_plots = {a.path for a in client.list_artifacts(tracker.run_id, "plots")}
    assert "plots/success_vs_step.png" in parent_plots
    stage_plots = {a.path for a in client.list_artifacts(rid, "plots")}
    assert {"plots/success_vs_step.png", "plots/success_vs_step.csv"} <= stage_plots


def test_the_plot_marks_the_points_that_used_fewer_episodes(tmp_path, monkeypatch):
    import dzmodel.atomic as atomic
    from dzmodel.eval.libero_eval import FEWER_EPISODES_LABEL, _row, plot_success

    seen = {}

    def capture(fig, path, dpi):
        ax = fig.axes[0]
        seen["legend"] = [t.get_text() for t in ax.get_legend().get_texts()]
        seen["hollow"] = [list(line.get_xdata()) for line in ax.lines if line.get_label() == FEWER_EPISODES_LABEL]

    monkeypatch.setattr(atomic, "save_figure", capture)
    rows = [_row(10, "all", "", 20, 5), _row(20, "all", "", 20, 10), _row(30, "all", "", 500, 400)]
    plot_success(rows, tmp_path / "p.png", "t")
    assert FEWER_EPISODES_LABEL in seen["legend"] and seen["hollow"] == [[10, 20]]
    plot_success([_row(10, "all", "", 20, 5), _row(20, "all", "", 20, 10)], tmp_path / "q.png", "t")
    assert FEWER_EPISODES_LABEL not in seen["legend"] and seen["hollow"] == []  # equal episodes: nothing marked
    plot_success([_row(10, "all", "", 4, 4), _row(20, "all", "", 4, 0)], tmp_path / "r.png", "t")  # rates 1 and 0
    assert seen["hollow"] == []


@pytest.mark.parametrize("overrides, message", [
    (["eval.checkpoints=all", "eval.curve_episodes=2"],
     "--set eval.curve_episodes=2: needs eval.checkpoints: last (checkpoints: all evaluates every checkpoint on all "
     "eval.episodes already)"),
    (["eval.curve_episodes=5"], "--set eval.curve_episodes=5: must be at most eval.episodes (4), got 5"),
    (["eval.curve_episodes=-1"], "--set eval.curve_episodes=-1: must be >= 0, got -1"),
])
def test_a_curve_that_cannot_be_drawn_is_one_error_naming_the_field(overrides, message):
    with pytest.raises(ParamsError) as exc:
        load_params(ROOT / "params.yaml", ["eval.episodes=4", "eval.checkpoints=last", *overrides], "demo")
    assert message in str(exc.value), str(exc.value)


def test_no_curve_leaves_the_eval_cache_key_as_it_was():
    from dzmodel.config import profile_dict

    without = load_params(ROOT / "params.yaml", [], "demo").selected()
    assert "curve_episodes" not in profile_dict(without)["eval"]
    with_curve = load_params(ROOT / "params.yaml", ["eval.checkpoints=last", "eval.curve_episodes=1"], "demo")
    assert profile_dict(with_curve.selected())["eval"]["curve_episodes"] == 1


def test_the_prefect_table_lists_every_step_of_the_curve(tmp_path, monkeypatch):
    import tasks.artifacts as artifacts
    from dzmodel.stages.eval import stage_eval

    prof, paths = _profile(tmp_path, "eval.curve_episodes=2")
    _fake_libero(monkeypatch, [])
    result = stage_eval(prof, paths, log=lambda *a: None)
    tables = []
    monkeypatch.setattr(artifacts, "create_table_artifact", lambda rows, **kw: tables.append(rows))
    monkeypatch.setattr(artifacts, "create_markdown_artifact", lambda *a, **kw: None)
    artifacts.eval_artifact("demo", result, paths.plots("eval"))
    success = tables[-1]
    assert [(r["step"], r["episodes"]) for r in success if r["task"] == "all"] == [(10, 4), (20, 4), (30, 8)]


@pytest.mark.slow  # two env pools starting on 2 cores: about a minute
def test_the_curve_in_the_simulator_on_the_tiny_preset(tmp_path):
    """The same through the real LIBERO evaluation, kept small: a tiny-preset run with 2 checkpoints, 1 task,
    curve_episodes 1, episodes 2, 16 policy steps each."""
    from dzmodel.data.dataset import embodiment_metadata
    from dzmodel.data.embodiments import get_embodiment
    from dzmodel.data.synth import make_synthetic_dataset
    from dzmodel.stages.eval import stage_eval
    from dzmodel.train.checkpoint import list_checkpoints
    from dzmodel.train.config import TrainConfig
    from dzmodel.train.convert import convert_checkpoint
    from dzmodel.train.trainer import train

    ds = make_synthetic_dataset(tmp_path / "ds", num_episodes=2, episode_length=40)
    embodiment_metadata(ds, get_embodiment("libero_sim_tiny"), tmp_path / "meta.json")
    train(TrainConfig(preset="tiny", model_overrides={"num_action_per_block": 16}, datasets=[str(ds)],
                      embodiment="libero_sim_tiny", metadata=str(tmp_path / "meta.json"), steps=2, save_every=1,
                      out_dir=str(tmp_path / "run"), lr=1e-3, progress=False))
    prof = load_params(ROOT / "params.yaml", ["eval.tasks=[0]", "eval.episodes=2", "eval.curve_episodes=1",
                                              "eval.checkpoints=last", "eval.max_steps=16", "eval.workers=1",
                                              "eval.videos=1", "eval.action_error=false", "eval.previews=0"],
                       "demo").selected()
    paths = StagePaths(tmp_path / "project", "demo")
    for step, ckpt in list_checkpoints(tmp_path / "run"):
        convert_checkpoint(ckpt, paths.stage("converted") / f"step_{step:07d}")
    stage_eval(prof, paths, log=lambda *a: None)
    out = paths.stage("eval")

    def init_states(where: Path) -> list[tuple[str, str]]:
        return [(r["checkpoint_step"], r["init_state"]) for r in csv.DictReader((where / "per_episode.csv").open())]

    assert init_states(out / "curve") == [("1", "0")]
    assert init_states(out) == [("2", "0"), ("2", "1")]
    notes = [e["note"] for where in (out, out / "curve") for e in csv.DictReader((where / "episodes.csv").open())]
    assert notes == ["", "", ""]  # no env worker crashed
    assert not (out / "curve" / "videos").exists() and len(list((out / "videos").glob("*.mp4"))) == 1
    table = list(csv.DictReader((paths.plots("eval") / "success_vs_step.csv").open()))
    assert [(r["step"], r["episodes"]) for r in table] == [("1", "1"), ("2", "2")]
    summary = json.loads(paths.metrics("eval").read_text())
    last = next(r for r in csv.DictReader((out / "results.csv").open()) if r["task"] == "all")
    assert summary["final_success_rate"] == float(last["rate"]) == float(table[-1]["success_rate"])
    assert (paths.plots("eval") / "success_vs_step.png").read_bytes()[:4] == b"\x89PNG"
