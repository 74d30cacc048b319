"""The pipeline's stage library: dvc.yaml agrees with it; records, fingerprints, summaries, plots, choices."""

import json
import sys
from pathlib import Path

import pytest
import yaml

from dzmodel.config import StagePaths, load_params
from dzmodel.dirlock import DirectoryBusy, directory_lock
from dzmodel.stages import (STAGE_TABLE, TRACK_PARAMS, TRACK_STAGE, dvc_deps, dvc_metrics, dvc_params, dvc_plots,
                            dvc_track_deps)
from dzmodel.pipeline import STAGES, outputs_intact, promotion_decision, run_stage, stage_outputs
from dzmodel.stages.package import chosen_step
from dzmodel.stages.train import MetricsFollower, read_metrics, run_streaming, summarize_training, torchrun_command

ROOT = Path(__file__).resolve().parents[1]


def _demo(tmp_path, *overrides):
    # 3 episodes: the demo holds out 2 (train.heldout_episodes), which the metadata stage leaves out too
    params = load_params(ROOT / "params.yaml", ["fetch.synth_episodes=3", "fetch.synth_length=24", *overrides], "demo")
    return params.selected(), StagePaths(tmp_path, "demo")


def test_dvc_yaml_runs_each_stage_through_dz_and_names_its_outputs():
    dvc = yaml.safe_load((ROOT / "dvc.yaml").read_text())
    assert list(dvc["stages"]) == [*STAGES, TRACK_STAGE]  # then the MLflow run of the reproduction
    assert dvc["stages"].pop(TRACK_STAGE)["cmd"] == "dz track"
    paths = StagePaths(Path("."), "demo")
    for name, stage in dvc["stages"].items():
        assert stage["cmd"] == f"dz stage {name}"
        outs = [next(iter(o)) if isinstance(o, dict) else o for o in stage["outs"]]
        outs = {o.replace("${profile}", "demo") for o in outs}
        assert {str(p) for p in stage_outputs(name, paths)} <= outs, name


def test_dvc_yaml_deps_and_params_are_the_stage_tables():
    """One declaration (dzmodel/stages/): dvc.yaml must list exactly the deps and params the Prefect keys use."""
    dvc = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    as_dvc = StagePaths(Path("."), "${profile}")
    for name in STAGES:
        assert dvc[name]["params"] == dvc_params(name), name
        assert dvc[name]["deps"] == dvc_deps(name, lambda up: [str(p) for p in stage_outputs(up, as_dvc)]), name
    for name in STAGES:  # the metrics and plot images each stage declares, as dvc.yaml lists them
        metrics = [next(iter(m)) for m in dvc[name].get("metrics", [])]
        plots = dvc[name].get("plots", [])
        assert (metrics, plots) == (dvc_metrics(name, as_dvc), dvc_plots(name, as_dvc)), name
    track = dvc[TRACK_STAGE]
    assert track["params"] == [f"profiles.${{profile}}.{p}" for p in TRACK_PARAMS]
    assert track["deps"] == dvc_track_deps(lambda up: [str(p) for p in stage_outputs(up, as_dvc)],
                                           lambda s: str(as_dvc.record(s)))
    # it reruns after any stage: every stage's record is a dep, and so is the MLflow code it runs
    assert {str(as_dvc.record(s)) for s in STAGES} <= set(track["deps"]) and "tasks/tracking.py" in track["deps"]
    # the cache depends on what changes the encodings, not on the learning rate
    assert "profiles.${profile}.train.heldout_episodes" in dvc["metadata"]["params"]  # its statistics leave them out
    assert "profiles.${profile}.train" not in dvc["cache"]["params"]
    assert "profiles.${profile}.train.encoder_weights" in dvc["cache"]["params"]


def test_dvc_metrics_and_plot_data_are_committed_to_git_where_the_stages_write_them():
    """`dvc exp show`, `dvc metrics diff` and `dvc plots diff` read a commit's or an experiment's metrics from git:
    every metrics file and plot CSV is `cache: false`, at the path `dz stage` writes it, and not git-ignored (else
    they show `!` for every revision but the workspace). The plot images are DVC-cached and git-ignored."""
    import subprocess

    dvc = yaml.safe_load((ROOT / "dvc.yaml").read_text())
    paths = StagePaths(Path("."), "demo")

    def entries(stage, kind):  # {path: its options}
        return {(next(iter(o)) if isinstance(o, dict) else o).replace("${profile}", "demo"):
                (next(iter(o.values())) or {}) if isinstance(o, dict) else {}
                for o in dvc["stages"][stage].get(kind, [])}

    committed, cached = {}, {}
    for stage in [s for s in STAGES if STAGE_TABLE[s].metrics]:  # vision, train, eval
        metrics = entries(stage, "metrics")
        assert set(metrics) == {str(paths.metrics(stage))}, stage
        csvs = {o: spec for o, spec in entries(stage, "outs").items() if o.endswith(".csv")}
        assert {Path(o).parent for o in csvs} <= {paths.plots(stage)}, stage
        committed |= metrics | csvs
        cached |= entries(stage, "plots")
    csv_plots = {f.replace("${profile}", "demo") for p in dvc["plots"] for spec in p.values() for f in spec["y"]}
    assert csv_plots <= set(committed) and len(csv_plots) == 4
    ignored = subprocess.run(["git", "check-ignore", "--no-index", *committed, *cached], cwd=ROOT,
                             capture_output=True, text=True).stdout.split()
    assert sorted(ignored) == sorted(cached), "git-ignored metrics or plot data: no revision but the workspace has them"
    assert all(spec.get("cache") is False for spec in committed.values()), committed
    assert cached and all(spec.get("cache", True) for spec in cached.values()), cached


def _key(stage, prof):
    from tasks.stages import cache_key

    return cache_key(stage, prof, ["upstream"])


def test_prefect_keys_follow_the_params_each_stage_reads(tmp_path):
    base, _ = _demo(tmp_path)
    lr, _ = _demo(tmp_path, "train.lr=0.01")
    weights, _ = _demo(tmp_path, "train.encoder_weights={vae: v.safetensors}")
    seed, _ = _demo(tmp_path, "train.seed=3")
    assert _key("cache", lr) == _key("cache", base) and _key("train", lr) != _key("train", base)
    assert _key("cache", weights) != _key("cache", base) and _key("cache", seed) != _key("cache", base)
    assert _key("convert", seed) == _key("convert", base)


def _copy_of_the_library(tmp_path) -> Path:
    import shutil

    root = tmp_path / "repo"
    shutil.copytree(ROOT / "dzmodel", root / "dzmodel", ignore=shutil.ignore_patterns("__pycache__"))
    return root


def test_the_code_fingerprint_changes_with_any_module_a_stage_imports(tmp_path):
    from dzmodel.stages import code_fingerprint

    root = _copy_of_the_library(tmp_path)
    before = {s: code_fingerprint(s, root) for s in STAGES}
    assert before["train"] == code_fingerprint("train", ROOT)
    with open(root / "dzmodel/model/lora.py", "a") as f:  # convert imports it only through train/convert.py
        f.write("# changed\n")
    after = {s: code_fingerprint(s, root) for s in STAGES}
    assert after["convert"] != before["convert"] and after["train"] != before["train"]
    with open(root / "dzmodel/serve/server.py", "a") as f:  # the policy server: no stage runs it
        f.write("# changed\n")
    assert {s: code_fingerprint(s, root) for s in STAGES} == after


def test_a_new_import_joins_the_stage_code(tmp_path):
    from dzmodel.stages import code_files

    root = _copy_of_the_library(tmp_path)
    assert root / "dzmodel/serve/server.py" not in code_files("convert", root)
    with open(root / "dzmodel/stages/convert.py", "a") as f:
        f.write("\n\ndef _later():\n    from ..serve import server  # noqa: F401\n")
    files = code_files("convert", root)
    assert root / "dzmodel/serve/server.py" in files and root / "dzmodel/serve/__init__.py" in files


def test_the_stage_code_holds_every_module_a_stage_loads(tmp_path):
    """Run fetch and metadata in a fresh interpreter: every dzmodel file it loaded is in the stages' computed code,
    and the data file that names the embodiments is too."""
    import subprocess

    from dzmodel.stages import code_files

    script = f"""
import json, sys
from pathlib import Path
from dzmodel.config import StagePaths, load_params
from dzmodel.pipeline import run_stage
prof = load_params({str(ROOT / "params.yaml")!r}, ["fetch.synth_episodes=3", "fetch.synth_length=24"], "demo").selected()
run_stage(sys.argv[1], prof, StagePaths(Path({str(tmp_path)!r}), "demo"), log=lambda s: None)
print(json.dumps(sorted(m.__file__ for n, m in sys.modules.items() if n.startswith("dzmodel") and m.__file__)))
"""
    for stage in ("fetch", "metadata"):  # one interpreter each: what one stage loads, nothing left by another
        out = subprocess.run([sys.executable, "-c", script, stage], capture_output=True, text=True, cwd=tmp_path,
                             check=True)
        loaded = set(json.loads(out.stdout.strip().splitlines()[-1]))
        code = {str(p) for p in code_files(stage)}
        assert len(loaded) > 10 and not sorted(loaded - code), f"{stage} loaded what its code lacks: {loaded - code}"
        assert str(ROOT / "dzmodel/data/embodiments.yaml") in code


def test_dz_params_dvc_fails_when_dvc_yaml_deps_are_stale(tmp_path):
    import subprocess

    stale = (ROOT / "dvc.yaml").read_text().replace("      - dzmodel/model/lora.py\n", "", 1)
    (tmp_path / "dvc.yaml").write_text(stale)
    cmd = [sys.executable, "-m", "dzmodel.cli", "params", "dvc", "--dvc-yaml", str(tmp_path / "dvc.yaml")]
    check = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert check.returncode == 1 and "differ from the stage table" in check.stderr
    assert subprocess.run([*cmd, "--write"], capture_output=True, cwd=ROOT).returncode == 0
    assert (tmp_path / "dvc.yaml").read_text() == (ROOT / "dvc.yaml").read_text()


def test_dz_params_dvc_writes_the_metrics_and_plots_the_stage_table_declares(tmp_path):
    """A plot image dropped from dvc.yaml, a metrics file of a stage that declares none, and a stage's missing
    metrics block: `dz params dvc` reports each, and `--write` puts back the table's lists."""
    import subprocess

    text = (ROOT / "dvc.yaml").read_text()
    edits = [text.replace("      - metrics/${profile}/plots/throughput.png\n", "", 1),
             text.replace("    cmd: dz stage convert\n", "    cmd: dz stage convert\n    metrics:\n"
                          "      - metrics/${profile}/convert.json:\n          cache: false\n", 1),
             text.replace("    metrics:\n      - metrics/${profile}/vision.json:\n          cache: false\n", "", 1)]
    for edited in edits:
        assert edited != text
        (tmp_path / "dvc.yaml").write_text(edited)
        cmd = [sys.executable, "-m", "dzmodel.cli", "params", "dvc", "--dvc-yaml", str(tmp_path / "dvc.yaml")]
        assert subprocess.run(cmd, capture_output=True, cwd=ROOT).returncode == 1
        assert subprocess.run([*cmd, "--write"], capture_output=True, cwd=ROOT).returncode == 0
        assert (tmp_path / "dvc.yaml").read_text() == text


def test_a_new_stage_gets_the_metrics_and_plots_it_declares(monkeypatch):
    from dzmodel import pipeline
    from dzmodel.stage_table import StageSpec

    table = dict(STAGE_TABLE, thumbnails=StageSpec("dzmodel.stages.fetch:stage_fetch", upstream=("fetch",),
                                                   params=("fetch",), metrics=True, plots=("grid.png",)))
    for module in ("dzmodel.pipeline", "dzmodel.stages", "dzmodel.stage_table"):
        monkeypatch.setattr(f"{module}.STAGE_TABLE", table)
    text = pipeline.dvc_yaml_with_computed_deps((ROOT / "dvc.yaml").read_text())
    entry = yaml.safe_load(text)["stages"]["thumbnails"]
    assert entry["metrics"] == [{"metrics/${profile}/thumbnails.json": {"cache": False}}]
    assert entry["plots"] == ["metrics/${profile}/plots/grid.png"]


def test_fetch_and_metadata_record_results_and_detect_changed_outputs(tmp_path):
    prof, paths = _demo(tmp_path)
    fetched = run_stage("fetch", prof, paths, log=lambda s: None)
    assert fetched["episodes"] == 3 and Path(fetched["dataset"]) == paths.dataset
    meta = run_stage("metadata", prof, paths, log=lambda s: None)
    entry = json.loads(paths.metadata.read_text())["libero_sim_tiny"]
    assert meta["embodiment"] == "libero_sim_tiny" and entry["statistics"]
    # the statistics come from the training episodes only: train.heldout_episodes 2 of the 3 are left out
    assert prof.train["heldout_episodes"] == 2
    assert (entry["statistics_episodes"], entry["heldout_episodes"]) == (1, [1, 2])
    assert (meta["statistics_episodes"], meta["heldout_episodes"]) == (1, [1, 2])
    assert (paths.metadata.parent / "statistics.csv").read_text().startswith("group,key,dim,mean,std,q01,q99")
    assert outputs_intact("fetch", paths) and outputs_intact("metadata", paths)
    record = json.loads((paths.run / "stages" / "metadata.json").read_text())
    assert record["stage"] == "metadata" and record["outputs_fingerprint"]
    paths.metadata.write_text(paths.metadata.read_text() + " ")  # edited behind the pipeline's back
    assert not outputs_intact("metadata", paths)
    assert not outputs_intact("train", paths)  # never ran


def test_training_summary_keeps_the_last_row_per_step_and_plots(tmp_path):
    _, paths = _demo(tmp_path)
    out = tmp_path / "train"
    out.mkdir()
    rows = [{"step": s, "loss": 1.0 / s, "action_loss": 0.5 / s, "dynamics_loss": 0.5 / s, "lr": 1e-3,
             "grad_norm": 1.0, "samples_per_s_per_gpu": 2.0 + s, "mfu": 0.1, "peak_mem_gib": 1.5} for s in (1, 2, 3)]
    resumed = dict(rows[2], loss=9.0)  # a resumed run logs step 3 again
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows + [resumed]))
    assert [r["loss"] for r in read_metrics(out / "metrics.jsonl")] == [1.0, 0.5, 9.0]
    result = summarize_training(paths, out, wall_s=3.0)
    s = result["summary"]
    assert s["steps"] == 3 and s["loss"] == 9.0 and s["samples_per_s_per_gpu"] == pytest.approx(4.5)
    committed = tmp_path / "metrics" / "demo"  # what git carries: metrics/<profile>/
    assert json.loads((committed / "train.json").read_text())["loss"] == 9.0
    assert (committed / "plots" / "train_losses.csv").read_text().splitlines()[0] == "step,loss,action_loss,dynamics_loss"
    assert all(Path(p).read_bytes()[:4] == b"\x89PNG" for p in result["plots"]) and len(result["plots"]) == 2


def test_metrics_follower_delivers_complete_lines_once(tmp_path):
    path, got = tmp_path / "metrics.jsonl", []
    follow = MetricsFollower(path, got.extend)
    follow()
    path.write_text('{"step": 1}\n{"step": 2')
    follow()
    assert got == [{"step": 1}]
    with path.open("a") as f:
        f.write('}\n{"step": 3}\n')
    follow()
    follow()
    assert [r["step"] for r in got] == [1, 2, 3]


def test_streaming_splits_progress_updates_into_lines():
    lines = []
    code = "import sys; print('start'); sys.stdout.write('10%\\r50%\\r100%\\n'); sys.exit(3)"
    assert run_streaming([sys.executable, "-c", code], lines.append) == 3
    assert lines == ["start", "10%", "50%", "100%"]


def test_an_interrupted_command_is_killed_with_everything_it_started(monkeypatch):
    """A launcher that ignores SIGTERM and started a worker in its own session (as torchrun does): after the
    grace period the whole tree goes, the worker included."""
    import textwrap

    import dzmodel.stages.train as train_stage
    from dzmodel.proctree import alive

    launcher = textwrap.dedent("""
        import signal, subprocess, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
        print(worker.pid, flush=True)
        time.sleep(600)
    """)
    workers = []

    def log(line):
        workers.append(int(line))
        raise KeyboardInterrupt  # as Ctrl-C or a cancelled flow run would

    monkeypatch.setattr(train_stage, "TERM_GRACE_S", 1.0)
    with pytest.raises(KeyboardInterrupt):
        run_streaming([sys.executable, "-c", launcher], log)
    assert workers and not alive(workers[0])


def test_torchrun_command():
    one = torchrun_command(Path("cfg.json"), 2)
    assert one[1:] == ["-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", "-m",
                       "dzmodel.train.launch", "--config", "cfg.json"]
    many = torchrun_command(Path("cfg.json"), 8, nnodes=4)
    assert "--nnodes=4" in many and "--rdzv_backend=c10d" in many and "--standalone" not in many


def test_package_takes_the_best_evaluated_step_else_the_last(tmp_path):
    prof, paths = _demo(tmp_path)
    for step in (10, 20, 30):
        (paths.stage("converted") / f"step_{step:07d}").mkdir(parents=True)
        (paths.stage("converted") / f"step_{step:07d}" / "config.json").write_text("{}")
    assert chosen_step(prof, paths) == (30, None)  # no evaluation
    paths.metrics("eval").parent.mkdir(parents=True)
    paths.metrics("eval").write_text(json.dumps({"evaluated": True, "best_step": 20}))
    paths.stage("eval").mkdir(parents=True)
    (paths.stage("eval") / "results.csv").write_text("step,task,task_name,episodes,successes,rate\n"
                                                     "10,all,,2,0,0.0\n20,all,,2,2,1.0\n30,all,,2,1,0.5\n")
    assert chosen_step(prof, paths) == (20, 1.0)
    prof.package.checkpoint = "last"
    assert chosen_step(prof, paths) == (30, 0.5)


def test_a_package_version_names_the_weights_and_the_evaluation_it_carries(tmp_path):
    """Another evaluation of the same weights is another bundle and so another package version (a registered
    version is the only one with its package version); the same files give the same version."""
    from dzmodel.stages.package import package_version

    evaluated = tmp_path / "eval"
    evaluated.mkdir()
    (evaluated / "results.csv").write_text("step,task,rate\n3,all,0.5\n")
    weights = "ab" * 32
    first = package_version("0.1.0-demo", weights, evaluated, {"robot_ip": "127.0.0.1"}, 3)
    assert first.startswith("0.1.0-demo+abababab.") and first == package_version(
        "0.1.0-demo", weights, evaluated, {"robot_ip": "127.0.0.1"}, 3)
    (evaluated / "results.csv").write_text("step,task,rate\n3,all,0.6\n")
    others = {package_version("0.1.0-demo", weights, evaluated, {"robot_ip": "127.0.0.1"}, 3),
              package_version("0.1.0-demo", weights, None, {"robot_ip": "127.0.0.1"}, 3),
              package_version("0.1.0-demo", weights, evaluated, {"robot_ip": "10.0.0.2"}, 3),
              package_version("0.1.0-demo", "cd" * 32, evaluated, {"robot_ip": "127.0.0.1"}, 3)}
    assert first not in others and len(others) == 4


@pytest.mark.parametrize("select,checkpoints", [(0, "all"), (2, "all"), (0, "last")])
def test_the_gates_number_is_never_the_one_that_picked_the_checkpoint(tmp_path, monkeypatch, select, checkpoints):
    """With selection init states the checkpoint is picked there and reported on init states it never saw;
    without, nothing is picked and the final number pools the last 3 checkpoints; with `checkpoints: last` only the
    newest checkpoint is evaluated, and the final number is its own."""
    import dzmodel.eval.libero_eval as libero_eval
    from dzmodel.eval.libero_eval import _row
    from dzmodel.stages.eval import stage_eval

    prof, paths = _demo(tmp_path, "eval.episodes=4", f"eval.select_episodes={select}", "eval.action_error=false",
                        "eval.previews=0", f"eval.checkpoints={checkpoints}")
    for step in (10, 20, 30, 40):
        (paths.stage("converted") / f"step_{step:07d}").mkdir(parents=True)
        (paths.stage("converted") / f"step_{step:07d}" / "config.json").write_text("{}")
    calls = []
    # successes per step: on the selection states step 20 looks best, on the reported ones it is not
    table = {"select": {10: 0, 20: 2, 30: 1, 40: 0}, "report": {10: 1, 20: 1, 30: 3, 40: 2}}

    def fake_run(src, cfg, out, steps=None, **kw):
        which = "select" if cfg.first_init_state else "report"
        calls.append((which, cfg.first_init_state, cfg.episodes, steps))
        return [_row(s, "all", "", cfg.episodes, table[which][s]) for s in (steps or [10, 20, 30, 40])]

    monkeypatch.setattr(libero_eval, "evaluate_run", fake_run)
    stage_eval(prof, paths, log=lambda *a: None)
    summary = json.loads(paths.metrics("eval").read_text())
    if select:
        assert calls == [("select", 4, 2, None), ("report", 0, 4, [20])]
        assert summary["picked_step"] == 20 and summary["final_success_rate"] == 0.25
        assert "picked on init states 4..5, reported on 0..3" in summary["final_rule"]
    elif checkpoints == "last":
        assert calls == [("report", 0, 4, [40])]
        assert summary["picked_step"] is None and summary["final_success_rate"] == 0.5
        assert summary["final_rule"] == "the last checkpoint (step 40), fixed in advance (none picked)"
    else:
        assert calls == [("report", 0, 4, None)]
        assert summary["picked_step"] is None and summary["best_step"] == 30
        assert summary["final_success_rate"] == 0.5 and summary["final_rule"].startswith("the last 3 checkpoints")
    assert summary["final_ci_low"] < summary["final_success_rate"] < summary["final_ci_high"]
    assert chosen_step(prof, paths)[1] == summary["final_success_rate"]


def test_the_head_to_head_refuses_a_candidate_worse_than_the_current_model():
    from dzmodel.pipeline import head_to_head_decision

    same = {"compared": True, "candidate": 0.10, "current": 0.10, "current_version": "3", "windows": 12}
    ok, why = head_to_head_decision(same, 0.05)
    assert ok and "0.1 vs 0.1 for the current v3, on the same 12 windows" in why
    ok, why = head_to_head_decision({**same, "candidate": 0.104}, 0.05)  # within 5 %
    assert ok
    ok, why = head_to_head_decision({**same, "candidate": 0.106}, 0.05)
    assert not ok and "0.106 vs 0.1" in why and "worse by more than 5%" in why
    ok, why = head_to_head_decision({"compared": False, "reason": "no version holds @production yet"}, 0.05)
    assert ok and "not compared" in why and "@production" in why
    assert head_to_head_decision({**same, "candidate": 9.0}, None)[0]  # comparison turned off


def test_promotion_gate():
    assert promotion_decision(0.8, 0.8) == (True, "passed: LIBERO success 80.0% >= gate 80.0%")
    ok, why = promotion_decision(0.5, 0.8)
    assert not ok and why == "refused: LIBERO success 50.0% < gate 80.0%"
    ok, why = promotion_decision(None, 0.0)
    assert not ok and "no LIBERO evaluation" in why


def test_train_restarts_when_its_config_or_data_change_and_keeps_the_old_run(tmp_path):
    from dzmodel.config import train_config
    from dzmodel.stages.train import _start_fresh_if_changed

    prof, paths = _demo(tmp_path)
    run_stage("fetch", prof, paths, log=lambda s: None)
    run_stage("metadata", prof, paths, log=lambda s: None)
    cfg = train_config(prof, paths)
    out, logs = Path(cfg.out_dir), []
    _start_fresh_if_changed(cfg, paths, logs.append)
    (out / "checkpoints").mkdir(parents=True)
    (out / "metrics.jsonl").write_text("{}\n")
    _start_fresh_if_changed(cfg, paths, logs.append)
    assert out.exists() and "resuming" in logs[-1]  # same config and data: resume (after a crash)
    cfg.lr = 5e-4
    with directory_lock(out):  # a `dz train` still running there (e.g. a torchrun started by hand)
        with pytest.raises(DirectoryBusy, match="a running `dz train`"):
            _start_fresh_if_changed(cfg, paths, logs.append)
    assert (out / "metrics.jsonl").is_file()  # left in place
    _start_fresh_if_changed(cfg, paths, logs.append)
    assert not out.exists() and "a fresh run starts" in logs[-1]
    moved = list((paths.run / "superseded").glob("train-*"))
    assert len(moved) == 1 and (moved[0] / "metrics.jsonl").is_file()  # never deleted
    out.mkdir()
    (out / "x").write_text("x")
    paths.metadata.write_text(paths.metadata.read_text().replace("libero_sim_tiny", "libero_sim_tiny "))
    _start_fresh_if_changed(cfg, paths, logs.append)
    assert not out.exists()  # new statistics: the old checkpoints no longer apply


def test_a_run_started_outside_the_pipeline_is_adopted_only_under_the_same_config(tmp_path):
    from dzmodel.config import train_config
    from dzmodel.stages.train import _start_fresh_if_changed
    from dzmodel.train.checkpoint import MARKER

    prof, paths = _demo(tmp_path)
    run_stage("fetch", prof, paths, log=lambda s: None)
    run_stage("metadata", prof, paths, log=lambda s: None)
    cfg = train_config(prof, paths)
    ckpt = Path(cfg.out_dir) / "checkpoints" / "step_0000010"
    ckpt.mkdir(parents=True)
    (ckpt / MARKER).write_text("")
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 10, "config": dict(cfg.to_dict(), progress=False)}))
    logs = []
    _start_fresh_if_changed(cfg, paths, logs.append)  # e.g. trained by infra/slurm/train.sbatch
    assert ckpt.exists() and "resuming" in logs[-1]
    (paths.run / "train_inputs.json").unlink()
    cfg.lr = 3e-2  # not the demo's lr: a changed config
    _start_fresh_if_changed(cfg, paths, logs.append)
    assert not ckpt.exists() and list((paths.run / "superseded").glob("train-*/checkpoints/step_0000010"))


def test_fetch_passes_the_recorder_only_the_options_that_change_its_data(tmp_path, monkeypatch):
    """Options added to fetch.record later (min_shift_m, dart_noise) are left out where they change nothing, so the
    fetch markers of existing standard-start recordings stay valid; a perturbed or noised recording names them."""
    import dzmodel.data.fetch as fetch
    from dzmodel.stages.fetch import stage_fetch

    seen = []

    def fake_fetch(source, dest_root, record_kwargs=None, **kw):
        seen.append(record_kwargs)
        raise RuntimeError("stop")

    monkeypatch.setattr(fetch, "fetch_dataset", fake_fetch)
    for overrides in (["fetch.record.init=standard", "fetch.record.dart_noise=0"], ["fetch.record.dart_noise=0.1", "fetch.record.max_steps=500"]):
        prof = load_params(ROOT / "params.yaml", overrides, "libero_object").selected("libero_object")
        with pytest.raises(RuntimeError, match="stop"):
            stage_fetch(prof, StagePaths(tmp_path, "libero_object"), log=lambda s: None)
    standard, noised = seen
    assert {"min_shift_m", "dart_noise", "max_steps"}.isdisjoint(standard) and standard["init"] == "standard"
    assert noised["dart_noise"] == 0.1 and noised["max_steps"] == 500 and noised["min_shift_m"] == 0.015 and noised["tasks"] == list(range(10))
    from dzmodel.eval.libero_record import RecordConfig

    assert RecordConfig(**noised).min_shift == 0.015  # what the recorder is handed, it takes


def test_dvc_lock_is_tracked_and_records_the_stages_of_dvc_yaml():
    """dvc.lock is the committed reproduction's record (`dvc status` compares with it): it must list dvc.yaml's
    stages with the same deps, so a dvc.yaml change without a new `dvc repro` (or `dvc commit`) fails here."""
    import subprocess

    tracked = subprocess.run(["git", "ls-files", "--error-unmatch", "dvc.lock"], cwd=ROOT, capture_output=True)
    assert tracked.returncode == 0, "dvc.lock is not tracked by git"
    lock = yaml.safe_load((ROOT / "dvc.lock").read_text())["stages"]
    dvc = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    profile = yaml.safe_load((ROOT / "params.yaml").read_text())["profile"]
    assert set(lock) == set(dvc)
    for name, stage in dvc.items():
        wanted = sorted(d.replace("${profile}", profile) for d in stage["deps"])
        assert sorted(d["path"] for d in lock[name]["deps"]) == wanted, name


def test_the_droid_profile_fetches_droids_layout(tmp_path):
    """`fetch.synth_embodiment: oxe_droid` (the droid profile) generates DROID's three cameras and 14/21-dim
    columns, which its oxe_droid_tiny embodiment reads."""
    from dzmodel.data.lerobot_format import open_dataset

    prof = load_params(ROOT / "params.yaml", ["fetch.synth_episodes=2", "fetch.synth_length=40"], "droid").selected("droid")
    paths = StagePaths(tmp_path, "droid")
    result = run_stage("fetch", prof, paths, log=lambda line: None)
    reader = open_dataset(result["dataset"])
    assert len(reader.video_keys) == 3 and reader.features["observation.state"].shape == (14,)
    assert reader.features["action"].shape == (21,)
    assert prof.metadata.embodiment == "oxe_droid_tiny" and prof.train["model_overrides"] == {"num_action_per_block": 24}
