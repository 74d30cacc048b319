"""Adding a stage to the pipeline is one new module plus one row of the stage table: in a copy of the project with
only those two changes, `dz params dvc --write` gives dvc.yaml its entry, and the Prefect flow runs it in table
order, caches it, keeps its outputs under its key, and logs it to MLflow."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

MODULE = '''"""The thumbnails stage: counts the dataset's files (a stand-in for any new stage)."""


def stage_thumbnails(prof, paths, log):
    out = paths.outputs("thumbnails")[0]
    out.mkdir(parents=True, exist_ok=True)
    files = sum(1 for f in paths.dataset.rglob("*") if f.is_file())
    (out / "count.txt").write_text(str(files))
    log(f"thumbnails: {files} files")
    return {"thumbnails": str(out), "summary": {"files": files}}
'''
ROW = ('    "thumbnails": StageSpec("dzmodel.stages.thumbnails:stage_thumbnails", upstream=("fetch",),\n'
       '                            params=("fetch",), gpu=True),\n')

FLOW = '''
import json, sys
from pathlib import Path

from mlflow.tracking import MlflowClient
from prefect.settings import PREFECT_LOCAL_STORAGE_PATH, temporary_settings
from prefect.testing.utilities import prefect_test_harness

from dzmodel import pipeline
from dzmodel.stages.thumbnails import stage_thumbnails
from tests.flows.test_sft_pipeline import _fake_stages

work = Path(sys.argv[1])
calls = []
pipeline.STAGE_FUNCTIONS = {**_fake_stages(calls), "thumbnails": stage_thumbnails}
with prefect_test_harness(), temporary_settings({PREFECT_LOCAL_STORAGE_PATH: work / "results"}):
    from flows.sft_pipeline import sft_pipeline
    from tasks.stages import STAGE_TASKS

    first = sft_pipeline("demo", root=str(work), promote=False)
    again = sft_pipeline("demo", root=str(work), promote=False)
client = MlflowClient(tracking_uri=f"sqlite:///{work / 'mlruns' / 'mlflow.db'}")
nested = client.search_runs([first["mlflow_experiment_id"]],
                            f"tags.mlflow.parentRunId = '{first['mlflow_run_id']}' and tags.stage = 'thumbnails'")
print(json.dumps({"calls": calls, "first": first, "again_cached": again["cached_stages"],
                  "tags": sorted(STAGE_TASKS["thumbnails"].tags),
                  "logged": [r.data.metrics for r in nested]}, default=str))
'''


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A copy of the project's code and parameters with the new module and its row, nothing else changed."""
    work = tmp_path_factory.mktemp("project")
    for name in ("dzmodel", "tasks", "flows", "infra"):
        shutil.copytree(ROOT / name, work / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("params.yaml", "dvc.yaml", "pyproject.toml"):
        shutil.copy(ROOT / name, work / name)
    (work / "dzmodel" / "stages" / "thumbnails.py").write_text(MODULE)
    table = work / "dzmodel" / "stage_table.py"
    text = table.read_text()
    anchor = "}\nSTAGES = tuple(STAGE_TABLE)"
    assert anchor in text, "the stage table's end moved: update this test"
    table.write_text(text.replace(anchor, ROW + anchor))
    return work


def _run(work: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(work), str(ROOT)])}
    env.pop("MLFLOW_TRACKING_URI", None)
    return subprocess.run([sys.executable, *args], cwd=work, env=env, capture_output=True, text=True, timeout=900)


def test_dvc_yaml_gets_the_new_stage_from_its_row(project):
    yaml = pytest.importorskip("yaml")
    check = _run(project, "-m", "dzmodel.cli", "params", "dvc")
    assert check.returncode != 0 and "thumbnails" in check.stderr  # the check names the stage dvc.yaml lacks
    wrote = _run(project, "-m", "dzmodel.cli", "params", "dvc", "--write")
    assert wrote.returncode == 0, wrote.stderr
    assert _run(project, "-m", "dzmodel.cli", "params", "dvc").returncode == 0
    stages = yaml.safe_load((project / "dvc.yaml").read_text())["stages"]
    entry = stages["thumbnails"]
    assert entry["cmd"] == "dz stage thumbnails"
    assert entry["params"] == ["profiles.${profile}.fetch"]
    assert entry["outs"] == ["runs/${profile}/thumbnails"]
    assert entry["deps"][0] == "data/${profile}/dataset" and "dzmodel/stages/thumbnails.py" in entry["deps"]
    assert list(stages)[-1] == "track" and "runs/${profile}/stages/thumbnails.json" in stages["track"]["deps"]
    original = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    assert {k: v for k, v in stages.items() if k not in ("thumbnails", "track")} == \
        {k: v for k, v in original.items() if k != "track"}  # every other stage as it was


@pytest.mark.slow
def test_the_flow_runs_caches_and_logs_the_new_stage(project):
    pytest.importorskip("prefect", reason="the flow needs the pipeline extras (make setup)")
    pytest.importorskip("mlflow", reason="the flow needs the pipeline extras (make setup)")
    script = project / "run_flow.py"
    script.write_text(FLOW)
    done = _run(project, str(script), str(project))
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["calls"][-1] == "package" and "thumbnails" not in out["calls"]  # the real module ran, not a fake
    assert "thumbnails" in out["first"]["stages"]
    assert "thumbnails" in out["again_cached"]  # unchanged inputs: the second run reuses it
    assert out["tags"] == ["gpu-pool"]  # its row says it uses the GPU pool
    written = list((project / "runs" / "demo" / "store" / "thumbnails").glob("*/thumbnails/count.txt"))
    assert len(written) == 1  # under its cache key, written once
    files = int(written[0].read_text())
    assert files >= 1 and [m.get("thumbnails.files") for m in out["logged"]] == [files]  # its nested MLflow run
