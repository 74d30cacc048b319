"""`dz data record libero`'s bookkeeping against a scripted env pool (no simulator): only successes are kept,
in (task, attempt) order whatever the worker count, the dataset reads as LeRobot v3.0 through the LIBERO
embodiments, attempts and successes per task are recorded, an interrupted recording leaves nothing behind, and
bad arguments get one clear error. The real simulator, expert and oracle run in test_record_oracle.py."""

import json

import numpy as np
import pytest

from dzmodel.data.errors import DataError
from dzmodel.eval.libero_env import WorkerCrashed
from dzmodel.eval.libero_workers import ExpertStep
from dzmodel.eval.libero_record import RECORDING_FILE, RecordConfig, goal_predicates, read_recording, record_libero

from .lockstep_pool import Lockstep, Staggered, overlapping

pytest.importorskip("libero")  # the task list and BDDL files come from LIBERO's package (no simulator needed)

SIZE = 32


class ExpertPool(Lockstep):
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
                "state": np.full(8, n, np.float32), "objects": np.arange(6, dtype=np.float32) + n}

    def reset(self, assignments, inits):
        out = {}
        for w, task, ep in assignments:
            assert inits[w].env_seed is not None
            self.running[w] = [(task.index, ep), 0]
            out[w] = {**self._obs((task.index, ep), 0), "init_state": np.arange(5.0) + ep}
        return out

    def expert_step(self, seeds, options=None):
        out = {}
        self.options = options
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
            opts = (options or {}).get(w) or {}
            executed = np.asarray(opts["execute"]) if opts.get("execute") is not None else action + opts.get("noise", 0)
            out[w] = ExpertStep(self._obs(key, n), self.success_at.get(key) == n, action, executed, True)
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
    assert rec["env_steps"] == 4 + 6 + 3 + 5 + 2 * 280  # the successes' steps and the failures' (throughput)
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


def test_workers_step_while_another_resets_and_the_dataset_is_unchanged(tmp_path):
    """A LIBERO reset takes seconds (it reloads the model): the other workers keep stepping meanwhile, and the
    dataset does not depend on the order in which replies come."""
    class OutOfOrder(Staggered, ExpertPool):
        pass

    pools = []

    def factory(n):
        pools.append(OutOfOrder(n, {(0, 0): 4, (0, 2): 6, (3, 1): 3, (3, 2): 5}))
        return pools[-1]

    cfg = RecordConfig(suite="object", tasks=[0, 3], episodes=3, image_size=SIZE, workers=3, codec="libx264")
    record_libero(cfg, tmp_path / "staggered", progress=False, log=lambda s: None, pool_factory=factory)
    _record(tmp_path, workers=3, name="lockstep")
    assert overlapping(pools[0].log) > 0
    for rel in ("data/chunk-000/file-000.parquet", "meta/episodes/chunk-000/file-000.parquet", "meta/stats.json"):
        assert (tmp_path / "staggered" / rel).read_bytes() == (tmp_path / "lockstep" / rel).read_bytes(), rel


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


def test_bad_arguments_get_one_clear_error(tmp_path, monkeypatch):
    with pytest.raises(DataError, match="--suite: must be one of 'object', 'spatial', 'goal', '10', got 'kitchen'"):
        RecordConfig(suite="kitchen")
    with pytest.raises(DataError, match=r"--tasks\[0\]: task 12 is not in LIBERO-object \(tasks 0..9\)"):
        record_libero(RecordConfig(tasks=[12]), tmp_path / "x", progress=False)
    # every task of the four suites has a skill now: a task whose goal has none is made by rewriting task 9's goal
    import dzmodel.eval.libero_record as record_module

    real = record_module.goal_predicates
    opened = [("in", "white_yellow_mug_1", "microwave_1_heating_region"), ("open", "microwave_1")]
    monkeypatch.setattr(record_module, "goal_predicates",
                        lambda bddl: opened if "MICROWAVE" in str(bddl).upper() else real(bddl))
    with pytest.raises(DataError, match=r"cannot solve 1 of the requested tasks.*task 9 .*"
                                        r"\(open microwave_1\): opening a hinged door"):
        record_libero(RecordConfig(suite="10", tasks=[0, 9]), tmp_path / "x", progress=False)
    with pytest.raises(DataError, match="--image-size: must be even"):
        RecordConfig(image_size=33)
    assert not (tmp_path / "x").exists()


def test_the_expert_has_a_skill_for_every_goal_term_of_the_four_suites():
    """`dz data record libero` refuses a task by name when a goal term has no skill; every task of Spatial, Object,
    Goal and LIBERO-10 has one (LIBERO-10 task 9: the mug into the microwave, then its door closed), and the terms
    without a skill are still named."""
    from dzmodel.eval.libero_env import list_tasks
    from dzmodel.eval.libero_expert import unsupported_term

    for suite in ("spatial", "object", "goal", "10"):
        for task in list_tasks(suite):
            assert [t for t in goal_predicates(task.bddl_file) if unsupported_term(t)] == [], (suite, task.index)
    assert unsupported_term(("close", "microwave_1")) is None
    assert "opening a hinged door" in unsupported_term(("open", "microwave_1"))
    assert "no skill for predicate 'up'" in unsupported_term(("up", "plate_1"))


def test_goal_predicates(tmp_path):
    bddl = tmp_path / "t.bddl"
    bddl.write_text("(define (problem x)\n (:goal\n    (And (On akita_black_bowl_1 plate_1) (Open drawer_1))\n  )\n)\n")
    assert goal_predicates(bddl) == [("on", "akita_black_bowl_1", "plate_1"), ("open", "drawer_1")]


def test_nothing_succeeded_writes_nothing(tmp_path):
    cfg = RecordConfig(suite="object", tasks=[0], episodes=1, image_size=SIZE, workers=1, codec="libx264")
    with pytest.raises(DataError, match="no attempt succeeded"):
        record_libero(cfg, tmp_path / "rec", progress=False, pool_factory=lambda n: ExpertPool(n, {}))
    assert list(tmp_path.iterdir()) == []


# --- DART noise, DAgger, privileged object positions (bookkeeping; the simulator runs in test_record_sim.py) -------


def _cfg(**kw):
    base = dict(suite="object", tasks=[0, 3], episodes=3, image_size=SIZE, workers=2, codec="libx264")
    return RecordConfig(**{**base, **kw})


SUCCESS = {(0, 0): 4, (0, 2): 6, (3, 1): 3, (3, 2): 5}


def test_objects_column_is_recorded_and_ignored_by_the_embodiments(tmp_path):
    from dzmodel.data.dataset import WindowDataset, embodiment_metadata
    from dzmodel.data.embodiments import get_embodiment
    from dzmodel.data.lerobot_format import open_dataset
    from dzmodel.data.sampling import WindowSpec

    _record(tmp_path)
    out = tmp_path / "rec"
    reader = open_dataset(out)
    info = json.loads((out / "meta" / "info.json").read_text())
    assert info["features"]["observation.objects"]["shape"] == [6]
    assert info["features"]["observation.objects"]["names"]["axes"][:3] == ["object_x", "object_y", "object_z"]
    assert info["dz_recording"]["objects_key"] == "observation.objects" and "executed_action" not in info["features"]
    objects = np.asarray(reader.read_columns(1, ["observation.objects"])["observation.objects"])
    np.testing.assert_allclose(objects, np.arange(6)[None] + np.arange(6)[:, None])  # the obs before each step
    for tag in ("libero_sim", "libero_sim_small"):
        emb = get_embodiment(tag)
        assert all(k.column != "observation.objects" for k in (*emb.state, *emb.action))
        meta = embodiment_metadata(out, emb, None)[tag]
        assert set(meta["statistics"]["state"]) == {"state"} and meta["modalities"]["state"]["state"]["shape"] == [8]
        ds = WindowDataset(reader, emb, WindowSpec(1, 2, 2, emb.sampling), meta["statistics"], train=False)
        sample = ds.sample(0)
        assert sample["state"].shape[-1] == 8 and sample["action"].shape[-1] == 7
        assert not any("object" in k for k in sample)


def test_dart_records_the_clean_label_and_the_noised_action_beside_it(tmp_path):
    from dzmodel.data.lerobot_format import open_dataset

    pools = []

    def factory(n):
        pools.append(ExpertPool(n, SUCCESS))
        return pools[-1]

    summary = record_libero(_cfg(dart_noise=0.25), tmp_path / "rec", progress=False, log=lambda s: None,
                            pool_factory=factory)
    opts = pools[0].options
    assert {o["noise"] for o in opts.values()} == {0.25} and all("execute" not in o for o in opts.values())
    assert len({o["noise_seed"] for o in opts.values()}) == len(opts)  # a noise stream per episode
    reader = open_dataset(tmp_path / "rec")
    cols = reader.read_columns(1, ["action", "executed_action"])
    np.testing.assert_allclose(np.asarray(cols["action"])[:, 0], 0.1 * np.arange(1, 7), rtol=1e-6)  # the label
    np.testing.assert_allclose(np.asarray(cols["executed_action"]) - np.asarray(cols["action"]), 0.25, rtol=1e-5)
    info = json.loads((tmp_path / "rec" / "meta" / "info.json").read_text())
    assert info["dz_recording"]["dart_noise"] == 0.25 and info["dz_recording"]["executed_key"] == "executed_action"
    assert info["features"]["executed_action"]["shape"] == [7]
    assert summary["options"]["dart_noise"] == 0.25 and summary["successes"] == 4
    assert [r["success_rate"] for r in summary["per_task"]] == [round(2 / 3, 4), round(2 / 3, 4)]
    assert all("noise_seed" in e for e in summary["episodes"])



class SecondTryPool(ExpertPool):
    """Starts listed in `second` succeed at step 3 of their second try only; every try's noise option is logged."""

    def __init__(self, n, success_at, second):
        super().__init__(n, success_at)
        self.second, self.tries, self.noise = second, {}, []

    def reset(self, assignments, inits):
        for w, task, ep in assignments:
            self.tries[(task.index, ep)] = self.tries.get((task.index, ep), 0) + 1
            if (task.index, ep) in self.second:
                self.success_at[(task.index, ep)] = 3 if self.tries[(task.index, ep)] == 2 else None
        return super().reset(assignments, inits)

    def expert_step(self, seeds, options=None):
        self.noise += [(self.running[w][0], o.get("noise")) for w, o in (options or {}).items() if self.running[w][1] == 0]
        return super().expert_step(seeds, options)


def _retried(tmp_path, workers, name="rec", **kw):
    pools = []

    def factory(n):
        pools.append(SecondTryPool(n, dict(SUCCESS), second={(0, 1), (3, 0)}))
        return pools[-1]

    summary = record_libero(_cfg(workers=workers, dart_noise=0.4, max_steps=10, **kw), tmp_path / name,
                            progress=False, log=lambda s: None, pool_factory=factory)
    return summary, pools[0]


def test_retries_try_a_failed_start_again_with_fresh_seeds_and_scaled_noise(tmp_path):
    summary, pool = _retried(tmp_path, workers=2, retries=2, retry_noise_scale=0.5)
    # every start is kept: two on their retry; the dataset keeps the starts' order
    assert [(e["task"], e["init_index"], e["retry"]) for e in summary["episodes"]] == \
        [(0, 0, 0), (0, 1, 1), (0, 2, 0), (3, 0, 1), (3, 1, 0), (3, 2, 0)]
    assert (summary["starts"], summary["attempts"], summary["successes"]) == (6, 8, 6)
    assert [(r["starts"], r["attempts"], r["kept"]) for r in summary["per_task"]] == [(3, 4, 3), (3, 4, 3)]
    assert pool.tries == {(0, 0): 1, (0, 1): 2, (0, 2): 1, (3, 0): 2, (3, 1): 1, (3, 2): 1}
    retried = {e["init_index"]: e for e in summary["episodes"] if e["retry"]}
    assert all(e["dart_noise"] == 0.2 for e in retried.values())  # 0.4 x 0.5
    firsts = [e for e in summary["episodes"] if not e["retry"]]
    assert all(e["dart_noise"] == 0.4 for e in firsts)
    assert sorted(n for _, n in pool.noise) == [0.2, 0.2] + [0.4] * 6
    assert [(f["task"], f["init_index"], f["retry"]) for f in summary["failures"]] == [(0, 1, 0), (3, 0, 0)]
    seeds = [(e["expert_seed"], e["noise_seed"]) for e in summary["episodes"]]
    assert len(set(seeds)) == len(seeds)


def test_retries_give_the_same_dataset_whatever_the_worker_count(tmp_path):
    one, _ = _retried(tmp_path, workers=1, name="one", retries=1)
    three, _ = _retried(tmp_path, workers=3, name="three", retries=1)
    assert one["episodes"] == three["episodes"] and len(one["episodes"]) == 6
    for rel in ("data/chunk-000/file-000.parquet", "meta/stats.json"):
        assert (tmp_path / "one" / rel).read_bytes() == (tmp_path / "three" / rel).read_bytes(), rel


def test_without_retries_a_failed_start_is_not_tried_again(tmp_path):
    summary, pool = _retried(tmp_path, workers=2)
    assert max(pool.tries.values()) == 1 and summary["successes"] == 4 and "retry" not in summary["episodes"][0]


class NoisePool(ExpertPool):
    """A start of task t succeeds at step 3 of any try whose DART σ is at most `below[t]`, else never; the σ of
    every try is logged per (task, init index). The first try of each start in `crash_first` crashes its worker."""

    def __init__(self, n, below, crash_first=()):
        super().__init__(n, {})
        self.below, self.noise, self.crash_first = below, [], set(crash_first)

    def expert_step(self, seeds, options=None):
        for w, o in (options or {}).items():
            key, n = self.running[w]
            if n == 0:
                self.noise.append((key, o["noise"]))
                self.success_at[key] = 3 if o["noise"] <= self.below[key[0]] + 1e-9 else None
                first = sum(k == key for k, _ in self.noise) == 1
                self.crash_at[key] = 1 if first and key in self.crash_first else None
        return super().expert_step(seeds, options)


def _piloted(tmp_path, name, workers=2, crash_first=(), **kw):
    pools = []

    def factory(n):  # task 0 succeeds only at the third level, task 3 at once
        pools.append(NoisePool(n, {0: 0.1, 3: 0.4}, crash_first))
        return pools[-1]

    cfg = _cfg(workers=workers, episodes=4, dart_noise=0.4, retries=2, retry_noise_scale=0.5, max_steps=10, **kw)
    return record_libero(cfg, tmp_path / name, progress=False, log=lambda s: None, pool_factory=factory), pools[0]


def test_a_task_whose_pilots_fail_under_full_noise_begins_its_other_starts_where_they_succeeded(tmp_path):
    summary, pool = _piloted(tmp_path, "pilot", noise_pilot=2)
    tries = {}
    for key, sigma in pool.noise:
        tries.setdefault(key, []).append(sigma)
    # the pilots (init states 0, 1) of task 0 go down the ladder; its other starts begin where they succeeded
    assert tries[(0, 0)] == tries[(0, 1)] == [0.4, 0.2, 0.1] and tries[(0, 2)] == tries[(0, 3)] == [0.1]
    assert all(tries[(3, k)] == [0.4] for k in range(4))  # task 3's pilots succeeded at the full σ
    assert [(r["attempts"], r["kept"], r["first_noise"]) for r in summary["per_task"]] == [(8, 4, 0.1), (4, 4, 0.4)]
    assert summary["options"]["noise_pilot"] == 2
    # the starts that skipped the levels above are the attempts that trying them would have reached: same episodes
    plain, _ = _piloted(tmp_path, "plain")
    assert plain["episodes"] == summary["episodes"] and plain["attempts"] == 16
    assert (tmp_path / "plain" / "data/chunk-000/file-000.parquet").read_bytes() == \
        (tmp_path / "pilot" / "data/chunk-000/file-000.parquet").read_bytes()


def test_pilots_give_the_same_dataset_whatever_the_worker_count(tmp_path):
    one, _ = _piloted(tmp_path, "one", workers=1, noise_pilot=2)
    five, _ = _piloted(tmp_path, "five", workers=5, noise_pilot=2)
    assert one["episodes"] == five["episodes"] and one["per_task"] == five["per_task"]


def test_a_pilot_whose_worker_crashed_says_nothing_about_the_noise(tmp_path):
    # task 3's only pilot crashes on its first try and succeeds on its retry, at half the σ: that is no evidence
    # that the full σ fails, so the task's other starts still begin at the full σ
    summary, pool = _piloted(tmp_path, "crash", noise_pilot=1, crash_first={(3, 0)})
    firsts = {key: sigma for key, sigma in reversed(pool.noise)}  # each start's first σ
    assert firsts[(3, 0)] == 0.4 and [s for k, s in pool.noise if k == (3, 0)] == [0.4, 0.2]
    assert [firsts[(3, k)] for k in (1, 2, 3)] == [0.4, 0.4, 0.4]
    assert summary["per_task"][1]["first_noise"] == 0.4


def test_noise_pilot_without_a_noise_ladder_is_refused():
    with pytest.raises(DataError, match="--noise-pilot 2: .* needs --dart-noise > 0, --retries >= 1"):
        _cfg(dart_noise=0.4, noise_pilot=2)

class FakePolicy:
    """Stands in for `EmbodiedPolicy`: a chunk of 4 constant actions that names its call, sessions logged."""

    action_horizon = 4

    def __init__(self):
        self.calls, self.ended = [], []

    def predict_batch(self, requests):
        self.calls.append([sid for sid, views, state, text in requests])
        assert all(set(views) == {"image", "wrist_image"} and len(state) == 8 for _, views, state, _ in requests)
        return [np.tile([0.5, -0.5, 0.25, 0.0, 0.0, 0.1, 0.3], (4, 1)) for _ in requests]

    def end_session(self, sid):
        self.ended.append(sid)


def _dagger(tmp_path, name="rec", policy=None, **kw):
    pools, policy = [], policy or FakePolicy()

    def factory(n):
        pools.append(ExpertPool(n, SUCCESS))
        return pools[-1]

    summary = record_libero(_cfg(dagger="model", max_steps=10, **kw), tmp_path / name, progress=False,
                            log=lambda s: None, pool_factory=factory, policy=policy)
    return summary, policy, pools[0]


def test_dagger_labels_are_the_experts_and_the_policy_acts_at_beta_zero(tmp_path):
    from dzmodel.data.lerobot_format import open_dataset

    summary, policy, pool = _dagger(tmp_path, dagger_beta=0.0)
    # every attempt kept (failures too, DAgger's default), cut at the step limit or at the expert's success
    assert summary["kept"] == 6 and summary["options"]["keep"] == "all" and summary["options"]["dagger_beta"] == 0.0
    assert [e["steps"] for e in summary["episodes"]] == [4, 10, 6, 10, 3, 5]
    assert all(e["policy_steps"] == e["steps"] and set(e["chunk_actors"]) == {"P"} for e in summary["episodes"])
    assert [e["success"] for e in summary["episodes"]] == [True, False, True, False, True, True]
    assert all(o["recover"] and o["hold_orientation"] for o in pool.options.values())
    reader = open_dataset(tmp_path / "rec")
    cols = reader.read_columns(1, ["action", "executed_action"])
    np.testing.assert_allclose(np.asarray(cols["action"])[:, 0], 0.1 * np.arange(1, 11), rtol=1e-6)  # expert labels
    executed = np.asarray(cols["executed_action"])
    np.testing.assert_allclose(executed, np.tile([0.5, -0.5, 0.25, 0.0, 0.0, 0.1, 1.0], (10, 1)), rtol=1e-6)  # policy's, gripper ±1
    # one batched forward per chunk boundary over the running episodes, one session per episode, all ended
    assert max(len(c) for c in policy.calls) == 2
    assert sorted(policy.ended) == sorted({s for c in policy.calls for s in c}) and len(policy.ended) == 6


def test_dagger_beta_one_is_the_expert_and_successes_only_on_request(tmp_path):
    summary, policy, pool = _dagger(tmp_path, dagger_beta=1.0, keep="successes")
    assert policy.calls == [] and summary["kept"] == 4
    assert all(e["policy_steps"] == 0 and set(e["chunk_actors"]) == {"E"} for e in summary["episodes"])
    assert all("execute" not in o for o in pool.options.values())


def test_dagger_mixes_per_chunk_deterministically(tmp_path):
    one, _, _ = _dagger(tmp_path, name="a", dagger_beta=0.5, actions_per_chunk=2)
    two, _, _ = _dagger(tmp_path, name="b", dagger_beta=0.5, actions_per_chunk=2)
    actors = "".join(e["chunk_actors"] for e in one["episodes"])
    assert set(actors) == {"E", "P"} and actors == "".join(e["chunk_actors"] for e in two["episodes"])
    for e in one["episodes"]:
        assert e["policy_steps"] == sum(min(2, e["steps"] - 2 * i) for i, c in enumerate(e["chunk_actors"]) if c == "P")


def test_rows_end_where_the_expert_label_stops_being_valid(tmp_path):
    class GivesUp(ExpertPool):
        def expert_step(self, seeds, options=None):
            out = super().expert_step(seeds, options)
            for w, r in out.items():
                if not isinstance(r, WorkerCrashed) and self.running[w][1] >= 3:
                    out[w] = r._replace(label_valid=False)
            return out

    summary = record_libero(_cfg(keep="all"), tmp_path / "rec", progress=False, log=lambda s: None,
                            pool_factory=lambda n: GivesUp(n, SUCCESS))
    # the 3rd label is invalid: every episode keeps its first 2 rows (and (3, 1)'s success at step 3 is not had)
    assert [(e["task"], e["steps"], e["success"]) for e in summary["episodes"]] == [(0, 2, False)] * 3 + [(3, 2, False)] * 3
    assert {f["note"] for f in summary["failures"]} >= {"the expert gave up (no valid label from here)"}


def test_start_options_are_checked():
    with pytest.raises(DataError, match="--min-shift-m: a perturbed start must move every object"):
        RecordConfig(init="perturbed", min_shift_m=0.0)
    with pytest.raises(DataError, match=r"--min-shift-m: must be <= --max-shift-m \(0.01\), got 0.02"):
        RecordConfig(init="perturbed", max_shift_m=0.01, min_shift_m=0.02)
    assert RecordConfig(init="perturbed", max_shift_m=0.03).min_shift == 0.015
    assert RecordConfig(init="standard").min_shift == 0.0 and RecordConfig(init="sampled").min_shift == 0.002
    with pytest.raises(DataError, match="--init"):
        RecordConfig(init="random")
    with pytest.raises(DataError, match="--dart-noise"):
        RecordConfig(dart_noise=-0.1)
    with pytest.raises(DataError, match="--retries"):
        RecordConfig(retries=11)
    with pytest.raises(DataError, match="--retry-noise-scale"):
        RecordConfig(retry_noise_scale=1.5)
    with pytest.raises(DataError, match="--dagger-beta"):
        RecordConfig(dagger_beta=1.5)
    with pytest.raises(DataError, match="--keep"):
        RecordConfig(keep="failures")
    assert RecordConfig(dagger="m").keep_mode == "all" and RecordConfig().keep_mode == "successes"


def test_starts_are_described_per_episode(tmp_path):
    class Describes(ExpertPool):
        def reset(self, assignments, inits):
            out = super().reset(assignments, inits)
            for w, task, ep in assignments:
                assert inits[w].describe and inits[w].min_shift_m == 0.01 and inits[w].perturb_seed is not None
                out[w]["init_info"] = {"object_xy_index": [10, 17], "object_shift_xy": [[0.01, 0.0], [0.0, -0.02]],
                                       "min_distance_to_standard": 0.02}
            return out

    summary = record_libero(_cfg(init="perturbed"), tmp_path / "rec", progress=False, log=lambda s: None,
                            pool_factory=lambda n: Describes(n, SUCCESS))
    e = summary["episodes"][0]
    assert e["init"]["mode"] == "perturbed" and e["init"]["base_index"] == e["init_index"] == 0
    assert e["init"]["min_distance_to_standard"] == 0.02 and e["init"]["object_shift_xy"][1] == [0.0, -0.02]
    assert summary["per_task"][0]["object_xy_index"] == [10, 17] and "object_xy_index" not in e["init"]
    assert summary["options"]["min_shift_m"] == 0.01


def test_the_oracle_refuses_recordings_whose_labels_were_not_executed(tmp_path):
    from dzmodel.eval.oracle import run_oracle

    record_libero(_cfg(dart_noise=0.1), tmp_path / "rec", progress=False, log=lambda s: None,
                  pool_factory=lambda n: ExpertPool(n, SUCCESS))
    with pytest.raises(DataError, match="recorded with DART noise 0.1: its actions are the expert's labels"):
        run_oracle(tmp_path / "rec", tmp_path / "oracle", progress=False)


def test_orientation_helpers_agree_with_the_state_convention():
    from dzmodel.eval.libero_env import quat_to_axis_angle
    from dzmodel.eval.libero_expert import matrix_to_rotvec, quat_to_matrix

    rng = np.random.default_rng(0)
    for _ in range(20):
        q = rng.normal(size=4)
        q *= np.sign(q[3]) / np.linalg.norm(q)  # w >= 0: angle in [0, pi]
        m = quat_to_matrix(q)
        np.testing.assert_allclose(m @ m.T, np.eye(3), atol=1e-12)
        np.testing.assert_allclose(matrix_to_rotvec(m), quat_to_axis_angle(q), atol=1e-9)
    flip = quat_to_matrix([1.0, 0.0, 0.0, 0.0])  # pi about x: the gripper's reset orientation
    np.testing.assert_allclose(np.abs(matrix_to_rotvec(flip)), [np.pi, 0, 0], atol=1e-9)


def test_rotvec_of_a_tiny_rotation_is_finite():
    # arccos near 1 is coarse: a trace a few ulps below 3 gives an angle of ~2e-8 with an axis that rounds to zero
    # (DART noise hit this: NaN labels, and NaN executed into the simulator)
    from dzmodel.eval.libero_expert import matrix_to_rotvec

    m = np.eye(3)
    m[0, 0] = 1 - 4e-16
    v = matrix_to_rotvec(m)
    assert np.all(np.isfinite(v)) and np.linalg.norm(v) < 1e-6
