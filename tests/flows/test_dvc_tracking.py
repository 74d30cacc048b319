"""`dz track` (the DVC path's MLflow run) refuses what it cannot log truthfully, before any MLflow run exists.
Its end-to-end run, after `dvc repro` of the demo, is in tests/test_dvc.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dzmodel.config import StagePaths
from dzmodel.pipeline import STAGES

ROOT = Path(__file__).resolve().parents[2]


def _project(tmp_path: Path) -> Path:
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    return tmp_path


def test_missing_stage_records_are_one_error_naming_the_stage_and_what_to_run(tmp_path):
    from flows.dvc_tracking import TrackError, track

    root = _project(tmp_path)
    with pytest.raises(TrackError, match=r"fetch\.json: stage fetch has no record; run `dvc repro`"):
        track(root, profile="demo")
    assert not (root / "mlruns").exists()  # nothing logged, not even an empty run


def test_a_stage_whose_outputs_changed_since_its_record_is_refused(tmp_path):
    from flows.dvc_tracking import TrackError, stage_records

    paths = StagePaths(_project(tmp_path), "demo")
    for stage in STAGES:  # records whose outputs' fingerprint no longer matches (the outputs are missing)
        paths.record(stage).parent.mkdir(parents=True, exist_ok=True)
        paths.record(stage).write_text(json.dumps({"outputs_fingerprint": "0" * 16}))
    with pytest.raises(TrackError, match="stage fetch's outputs changed or are missing since it ran"):
        stage_records(paths)


def test_dz_track_is_a_dz_command():
    import argparse

    from flows.commands import register

    sub = argparse.ArgumentParser(prog="dz").add_subparsers()
    register(sub)
    ns = sub.choices["track"].parse_args(["--profile", "demo", "--set", "promote.min_success=0.9"])
    assert ns.func.__name__ == "cmd_track" and ns.set == ["promote.min_success=0.9"] and not ns.no_promote
