"""`dz data record libero`'s bookkeeping against a scripted env pool (no simulator): only successes are kept,
in (task, attempt) order whatever the worker count, the dataset reads as LeRobot v3.0 through the LIBERO
embodiments, attempts and successes per task are recorded, an interrupted recording leaves nothing behind, and
bad arguments get one clear error. The real simulator, expert and oracle run in test_record_oracle.py."""

import json

import numpy as np
import pytest

from dzmodel.data.errors import DataError
from dzmodel.eval.libero_env import WorkerCrashed
from dzmodel.eval.libero_record import RECORDING_FILE, RecordConfig, goal_predicates, read_recording, record_libero

pytest.importorskip("libero")  # the task list and BDDL files come from LIBERO's package (no simulator needed)

SIZE = 32


class ExpertPool:
    """success_at[(task, init_index)] = the step at which the expert succeeds (absent: never); obs and actions
    are functions of (task, init_index, step), so a dataset does not depend on which worker ran what."""

    def __init__(self, n, success_at, crash_at=None, interrupt_after=None):
        self.num_workers, self.success_at = n, success_at
        self.crash_at, self.interrupt_after = crash_at or {}, interrupt_after
        self.running, self.steps_total = {}, 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    @staticmethod
    def _obs(key, n):
        v = (key[0] * 31 + key[1] * 7 + n) % 250
        return {"image": np.full((SIZE, SIZE, 3), v, np.uint8), "wrist_image": np.full((SIZE, SIZE, 3), 255 - v, np.uint8),
                "state": np.full(8, n, np.float32)}

    def reset(self, assignments, inits):
        out = {}
        for w, task, ep in assignments:
            assert inits[w].env_seed is not None
            self.running[w] = [(task.index, ep), 0]
            out[w] = {**self._obs((task.index, ep), 0), "init_state": np.arange(5.0) + ep}
        return out

    def expert_step(self, seeds):
        out = {}
        for w in seeds:
            key, n = self.running[w]
            self.running[w][1] = n = n + 1
            self.steps_total += 1
            if self.interrupt_after is not None and self.steps_total >= self.interrupt_after:
                raise KeyboardInterrupt
            if self.crash_at.get(key) == n:
                out[w] = WorkerCrashed(w, "killed by the test")
                continue
            action = np.array([0.1 * n, 0, 0, 0, 0, 0, 1.0 if n > 2 else -1.0])
            out[w] = (self._obs(key, n), self.success_at.get(key) == n, action)
        return out


def _record(tmp_path, workers=2, name="rec", **kw):
    cfg = RecordConfig(suite="object", tasks=[0, 3], episodes=3, image_size=SIZE, workers=workers, codec="libx264")
    success = {(0, 0): 4, (0, 2): 6, (3, 1): 3, (3, 2): 5}
    return record_libero(cfg, tmp_path / name, progress=False, log=lambda s: None,
                         pool_factory=lambda n: ExpertPool(n, success, **kw))


def test_keeps_successes_in_order_with_metadata(tmp_path):
    from dzmodel.data.lerobot_format import open_dataset

    summary = _record(tmp_path)
    out = tmp_path / "rec"
    rec = read_recording(out)
    assert rec == json.loads((out / RECORDING_FILE).read_text()) and rec["successes"] == summary["successes"] == 4
    assert [(r["task"], r["attempts"], r["successes"]) for r in rec["per_task"]] == [(0, 3, 2), (3, 3, 2)]
    assert [(e["task"], e["init_index"], e["steps"]) for e in rec["episodes"]] == [(0, 0, 4), (0, 2, 6), (3, 1, 3), (3, 2, 5)]
    assert rec["episodes"][1]["init_state"] == [2.0, 3.0, 4.0, 5.0, 6.0]
    assert {f["note"] for f in rec["failures"]} == {"no success within the suite's 280 steps"}
    reader = open_dataset(out)
    reader.check()
    assert [e.length for e in reader.episodes] == [4, 6, 3, 5]
    info = json.loads((out / "meta" / "info.json").read_text())
    assert (info["fps"], info["robot_type"], info["codebase_version"]) == (10, "panda", "v3.0")
    assert info["features"]["observation.state"]["shape"] == [8] and info["features"]["action"]["shape"] == [7]
    cols = reader.read_columns(1, ["action", "observation.state"])
    # one row per env step: the observation before the step and the action taken from it
    np.testing.assert_allclose(np.asarray(cols["action"])[:, 0], 0.1 * np.arange(1, 7), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(cols["observation.state"])[:, 0], np.arange(6))
    assert reader.task_per_frame(2)[0] == "pick up the bbq sauce and place it in the basket"
    frames = reader.read_frames(0, "observation.images.image", [0, 3], backend="pyav")
    assert abs(int(frames[1].mean()) - 3) <= 2  # frame 3 of task 0, init 0 (H.264 keeps flat colours)


def test_same_dataset_whatever_the_worker_count(tmp_path):
    _record(tmp_path, workers=1, name="one")
    _record(tmp_path, workers=3, name="three")
    for rel in ("data/chunk-000/file-000.parquet", "meta/episodes/chunk-000/file-000.parquet", "meta/stats.json"):
        assert (tmp_path / "one" / rel).read_bytes() == (tmp_path / "three" / rel).read_bytes(), rel
    one, three = (json.loads((tmp_path / n / RECORDING_FILE).read_text()) for n in ("one", "three"))
    assert one["episodes"] == three["episodes"]


def test_a_crashed_worker_fails_its_attempt(tmp_path):
    summary = _record(tmp_path, crash_at={(0, 0): 2})
    assert summary["successes"] == 3
    assert any("crashed" in f["note"] for f in summary["failures"])


def test_interrupted_recording_leaves_nothing(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        _record(tmp_path, interrupt_after=5)
    assert list(tmp_path.iterdir()) == []
    _record(tmp_path)  # a rerun starts cleanly
    assert [p.name for p in tmp_path.iterdir()] == ["rec"]


def test_stale_temporaries_of_dead_runs_are_removed(tmp_path):
    stale = tmp_path / ".rec.rec-999999999-abcd"
    stale.mkdir()
    _record(tmp_path)
    assert not stale.exists()


def test_existing_output_needs_overwrite(tmp_path):
    (tmp_path / "rec").mkdir()
    with pytest.raises(DataError, match="already exists"):
        _record(tmp_path)


def test_bad_arguments_get_one_clear_error(tmp_path):
    with pytest.raises(DataError, match="--suite: unknown LIBERO suite 'kitchen'"):
        RecordConfig(suite="kitchen")
    with pytest.raises(DataError, match=r"--tasks: suite 'object' has tasks 0..9; got \[12\]"):
        record_libero(RecordConfig(tasks=[12]), tmp_path / "x", progress=False)
    with pytest.raises(DataError, match="cannot solve 1 of the requested tasks.*open wooden_cabinet_1_middle_region"):
        record_libero(RecordConfig(suite="goal", tasks=[0, 1]), tmp_path / "x", progress=False)
    with pytest.raises(DataError, match="--image-size"):
        RecordConfig(image_size=33)
    assert not (tmp_path / "x").exists()


def test_goal_predicates(tmp_path):
    bddl = tmp_path / "t.bddl"
    bddl.write_text("(define (problem x)\n (:goal\n    (And (On akita_black_bowl_1 plate_1) (Open drawer_1))\n  )\n)\n")
    assert goal_predicates(bddl) == [("on", "akita_black_bowl_1", "plate_1"), ("open", "drawer_1")]


def test_nothing_succeeded_writes_nothing(tmp_path):
    cfg = RecordConfig(suite="object", tasks=[0], episodes=1, image_size=SIZE, workers=1, codec="libx264")
    with pytest.raises(DataError, match="no attempt succeeded"):
        record_libero(cfg, tmp_path / "rec", progress=False, pool_factory=lambda n: ExpertPool(n, {}))
    assert list(tmp_path.iterdir()) == []
