"""Recording scripted-expert episodes in the real simulator for the expert's tests: `dz data record libero` at 64 px,
one worker, every episode kept, standard init states from 0 with the recorder's seeds."""

import json

import numpy as np
import pytest

from dzmodel.cli import main


def record_expert(tmp_path, suite: str, task: int, episodes: int = 1) -> tuple[dict, dict]:
    """`episodes` expert episodes of task `task` of `suite` (init states 0..episodes-1): (the recording's summary,
    the first episode's columns: action, observation.state, observation.objects). Skips where LIBERO is not
    installed."""
    pytest.importorskip("libero", reason="LIBERO is not installed (make libero)")
    from dzmodel.eval.libero_env import check_libero

    check_libero()
    out = tmp_path / f"{suite}_t{task}"
    rc = main(["data", "record", "libero", "--suite", suite, "--tasks", str(task), "--episodes", str(episodes),
               "--image-size", "64", "--workers", "1", "--keep", "all", "--out", str(out), "--no-progress"])
    assert rc == 0
    rec = json.loads((out / "meta" / "dz_recording.json").read_text())
    from dzmodel.data.lerobot_format import open_dataset

    cols = open_dataset(out).read_columns(0, ["action", "observation.state", "observation.objects"])
    return rec, {k: np.asarray(v) for k, v in cols.items()}
