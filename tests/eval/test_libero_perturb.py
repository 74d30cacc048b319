"""Robustness perturbations (dzmodel/eval/libero_perturb.py): names and values, the paraphrase table, the eval loop's
per-perturbation episodes and tables, and, in the real simulator (64 px cameras, one env of LIBERO-Spatial task 0),
that each perturbation changes what it names and nothing else, deterministically per (seed, task, init state)."""

import contextlib
import csv
import json
import sys

import numpy as np
import pytest

from dzmodel.eval import libero_perturb as lp
from dzmodel.eval.libero_env import TaskSpec
from dzmodel.eval.libero_eval import EvalConfig, evaluate_policy, robustness_rows, summarize, write_results

KEY = (0, "spatial", 0, 0)  # (eval seed, suite, task, init state)


# --- names, values, errors (no simulator) ------------------------------------------------------------------------


def test_names_values_and_labels():
    ps = lp.parse_perturbations(["position,camera=5", "table=red", " paraphrase=2 "])
    assert [p.label for p in ps] == ["position=0.05", "camera=5", "table=red", "paraphrase=2"]
    assert [p.scene for p in ps] == [True, True, True, False]
    assert ps[1].slug == "camera-5"
    assert lp.parse_perturbations([]) == [] and lp.parse_perturbations(None) == []
    assert [p.label for p in lp.parse_perturbations(["swap", "light", "table", "distractor"])] == \
        ["swap=task", "light=0.5", "table=random", "distractor=2"]
    assert [p.value for p in lp.parse_perturbations(["distractor=1", "distractor=5"])] == [1, 5]
    assert lp.parse_perturbations(["distractor=3"])[0].scene


@pytest.mark.parametrize("item, words", [
    ("lighting", ["--perturb", "unknown perturbation 'lighting'", "known: position"]),
    ("camera=90", ["--perturb", "camera", "(0, 45]"]),
    ("table=pink", ["--perturb", "table", "'pink'"]),
    ("distractor=0", ["--perturb", "distractor", "1 to 5", "got 0"]),
    ("distractor=99", ["--perturb", "distractor", "1 to 5", "got 99"]),
    ("distractor=x", ["--perturb", "distractor", "1 to 5", "'x'"]),
    ("distractor=2.5", ["--perturb", "distractor", "whole number"]),
    ("camera,camera=10", ["--perturb", "listed twice"]),
])
def test_a_bad_perturbation_is_one_error_naming_the_field(item, words):
    with pytest.raises(lp.PerturbationError) as err:
        lp.parse_perturbations([item])
    assert all(w in str(err.value) for w in words), str(err.value)
    with pytest.raises(ValueError, match="eval.perturb"):
        EvalConfig(perturb=[item])


def test_cli_and_params_name_the_bad_perturbation(tmp_path, capsys):
    from dzmodel.cli import main
    from dzmodel.config import ParamsError, load_params

    rc = main(["eval", "libero", str(tmp_path / "model"), "--out", str(tmp_path / "out"), "--perturb", "fog"])
    err = capsys.readouterr().err
    assert rc != 0 and "--perturb: unknown perturbation 'fog'" in err, err
    assert not (tmp_path / "out").exists()  # refused before anything is written
    with pytest.raises(ParamsError) as exc:
        load_params("params.yaml", overrides=["eval.perturb=[camera, fog]"])
    assert "--set eval.perturb=[camera, fog]: unknown perturbation 'fog'" in str(exc.value)
    assert str(exc.value).count("\n") == 0  # one problem, one line
    prof = load_params("params.yaml", overrides=["eval.perturb=[camera=5, paraphrase]"]).selected()
    assert prof.eval.perturb == ["camera=5", "paraphrase"]


def test_the_default_changes_no_cache_key():
    from dzmodel.config import load_params, profile_dict

    prof = load_params("params.yaml").selected()
    assert prof.eval.perturb == [] and "perturb" not in profile_dict(prof)["eval"]


def test_paraphrases_are_fixed_per_task_and_seeded_per_episode():
    assert len(lp.PARAPHRASES) == 40
    for language, options in lp.PARAPHRASES.items():
        assert len(set(options)) == 3 and language not in options
    language = "pick up the black bowl next to the ramekin and place it on the plate"
    p = lp.Perturbation("paraphrase", "random")
    picks = {lp.episode_language(language, p, (0, "spatial", 1, e)) for e in range(12)}
    assert picks <= set(lp.PARAPHRASES[language]) and len(picks) > 1
    assert lp.episode_language(language, p, KEY) == lp.episode_language(language, p, KEY)
    assert lp.episode_language(language, lp.Perturbation("paraphrase", "3"), KEY) == lp.PARAPHRASES[language][2]
    assert lp.episode_language(language, None, KEY) == language
    assert lp.episode_language(language, lp.Perturbation("camera", 10.0), KEY) == language


def test_the_paraphrase_table_covers_every_task_of_the_four_suites():
    pytest.importorskip("libero", reason="LIBERO is not installed (make libero)")
    from dzmodel.eval.libero_env import list_tasks

    languages = {t.language for s in ("spatial", "object", "goal", "10") for t in list_tasks(s)}
    assert languages == set(lp.PARAPHRASES)


# --- the eval loop (a scripted pool, no simulator) ---------------------------------------------------------------


class _Policy:
    action_horizon = 4

    def __init__(self):
        self.instructions = []

    def predict_batch(self, requests):
        self.instructions += [r[3] for r in requests]
        return [np.zeros((4, 7)) for _ in requests]

    def end_session(self, session):
        pass


class _Pool:
    num_workers = 1

    def __init__(self):
        self.inits, self._pending = [], {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def submit_reset(self, assignments, inits=None):
        self.inits.append((inits or {}).get(assignments[0][0]))
        self._pending = {w: {"image": np.zeros((8, 8, 3), np.uint8), "wrist_image": np.zeros((8, 8, 3), np.uint8),
                             "state": np.zeros(8)} for w, _, _ in assignments}

    def submit_step(self, actions):
        self._pending = {w: (self._pending_obs(), False) for w in actions}

    def _pending_obs(self):
        return {"image": np.zeros((8, 8, 3), np.uint8), "wrist_image": np.zeros((8, 8, 3), np.uint8),
                "state": np.zeros(8)}

    def wait(self):
        out, self._pending = self._pending, {}
        return out


def _tasks():
    return [TaskSpec("spatial", 1, "t1", "pick up the black bowl next to the ramekin and place it on the plate",
                     "/x.bddl", 50)]


def test_a_perturbed_run_sends_the_scene_to_the_worker_and_the_paraphrase_to_the_policy():
    cfg = EvalConfig(episodes=2, max_steps=2, workers=1, videos=0)
    for p, scene in ((lp.Perturbation("camera", 10.0), True), (lp.Perturbation("paraphrase", "1"), False)):
        policy, pool = _Policy(), _Pool()
        results = evaluate_policy(policy, cfg, progress=False, tasks=_tasks(), pool_factory=lambda n: pool,
                                  perturbation=p)
        assert [(r.task, r.episode) for r in results] == [(1, 0), (1, 1)]
        if scene:
            assert [i.scene for i in pool.inits] == [(p,), (p,)]
            assert [i.scene_key for i in pool.inits] == [(0, "spatial", 1, 0), (0, "spatial", 1, 1)]
            assert set(policy.instructions) == {_tasks()[0].language}
        else:
            assert pool.inits == [None, None]  # the env starts exactly as without the perturbation
            assert set(policy.instructions) == {lp.PARAPHRASES[_tasks()[0].language][0]}
    policy, pool = _Policy(), _Pool()
    evaluate_policy(policy, cfg, progress=False, tasks=_tasks(), pool_factory=lambda n: pool)
    assert pool.inits == [None, None] and set(policy.instructions) == {_tasks()[0].language}


def test_robustness_tables(tmp_path):
    from dzmodel.eval.libero_eval import EpisodeResult

    base = [EpisodeResult(1, "t1", e, e == 0, 5, 1.0) for e in range(4)]
    moved = [EpisodeResult(1, "t1", e, False, 5, 1.0) for e in range(4)]
    rows = summarize(base, 100)
    robust = robustness_rows(base, 100, "none") + robustness_rows(moved, 100, "position=0.05")
    episodes = [{"step": 100, "train_seed": 7, "perturbation": label, **r.__dict__}
                for label, rs in (("none", base), ("position=0.05", moved)) for r in rs]
    write_results(tmp_path, rows, episodes, robust)
    table = list(csv.DictReader((tmp_path / "robustness.csv").open()))
    overall = {r["perturbation"]: r for r in table if r["task"] == "all"}
    assert overall["none"]["successes"] == "1" and overall["position=0.05"]["successes"] == "0"
    assert float(overall["position=0.05"]["ci_high"]) > 0  # the Wilson interval of 0 of 4
    per_episode = (tmp_path / "per_episode.csv").read_text().splitlines()
    assert per_episode[0] == "seed,task,init_state,checkpoint_step,success,perturbation"
    assert per_episode[1] == "7,1,0,100,1,none" and per_episode[-1] == "7,1,3,100,0,position=0.05"
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [r["perturbation"] for r in summary["robustness"]] == ["none", "position=0.05"]
    assert summary["best"]["rate"] == 0.25  # the unperturbed rows pick the best step, as before
    # without perturbations: exactly the files and columns of before
    plain = tmp_path / "plain"
    write_results(plain, rows, [{k: v for k, v in e.items() if k != "perturbation"} for e in episodes[:4]])
    assert not (plain / "robustness.csv").exists()
    assert (plain / "per_episode.csv").read_text().splitlines()[0] == "seed,task,init_state,checkpoint_step,success"
    assert "robustness" not in json.loads((plain / "summary.json").read_text())


# --- the real simulator ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sim():
    pytest.importorskip("libero", reason="LIBERO is not installed (make libero)")
    from dzmodel.eval.libero_env import check_libero, ensure_libero_config, list_tasks

    ensure_libero_config()
    check_libero()
    with contextlib.redirect_stdout(sys.stderr):
        from libero.libero.envs import OffScreenRenderEnv
    task = list_tasks("spatial")[0]
    env = OffScreenRenderEnv(bddl_file_name=task.bddl_file, camera_heights=64, camera_widths=64,
                             camera_names=["agentview", "robot0_eye_in_hand"])
    base = _start(env, task)
    base[0]["settled"] = _settle(env)
    yield env, task, base
    env.close()


def _snapshot(env, raw) -> dict:
    sim = env.env.sim
    m = sim.model._model
    return {"state": np.array(env.get_sim_state()), "cam_pos": m.cam_pos.copy(), "cam_quat": m.cam_quat.copy(),
            "cam_fovy": m.cam_fovy.copy(), "light_pos": m.light_pos.copy(), "light_dir": m.light_dir.copy(),
            "light_diffuse": m.light_diffuse.copy(), "light_specular": m.light_specular.copy(),
            "geom_rgba": m.geom_rgba.copy(), "geom_matid": m.geom_matid.copy(), "mat_rgba": m.mat_rgba.copy(),
            "geom_size": m.geom_size.copy(), "agentview": raw["agentview_image"].copy(),
            "wrist": raw["robot0_eye_in_hand_image"].copy()}


def _start(env, task, perturbation=None, key=KEY):
    from dzmodel.eval.libero_env import init_state

    env.seed(0)
    env.reset()
    state, info = np.array(init_state(task, 0)), {}
    if perturbation is not None:
        state, info = lp.apply_scene(env, state, [perturbation], key)
    raw = env.set_init_state(state)
    return _snapshot(env, raw), info


def _settle(env) -> np.ndarray:
    """The state after the eval's settle steps (LIBERO's init states hold the objects a little above their
    support; they drop onto it)."""
    from dzmodel.eval.libero_env import SETTLE_ACTION, SETTLE_STEPS

    for _ in range(SETTLE_STEPS):
        env.step(list(SETTLE_ACTION))
    return np.array(env.get_sim_state())


def _changed(a: dict, b: dict) -> set[str]:
    return {k for k in b if k not in ("agentview", "wrist") and not np.array_equal(a[k], b[k])}


def _object_xy(env) -> dict[str, int]:
    return {o.name: o.adr for o in lp._objects(env)}


def test_position_moves_every_free_object_by_the_distance_and_nothing_else(sim):
    env, task, (base, _) = sim
    snap, info = _start(env, task, lp.Perturbation("position", 0.05))
    assert _changed(base, snap) == {"state"}  # no model edit
    xy = _object_xy(env)
    diff = np.flatnonzero(snap["state"] != base["state"])
    assert set(diff) <= {a + i for a in xy.values() for i in (0, 1)}  # only object x/y: robot, z, velocities kept
    shifts = info["position=0.05"]["shift_xy"]
    assert set(shifts) == set(xy) and info["position=0.05"]["held_by_fixture"] == []
    for name, adr in xy.items():
        assert np.linalg.norm(snap["state"][adr:adr + 2] - base["state"][adr:adr + 2]) == pytest.approx(0.05, abs=1e-9)
    # a valid start: after the settle steps every object rests at the height it rests at unmoved (on the table,
    # not on another object or a fixture, not fallen off)
    settled = _settle(env)
    heights = {n: (base["settled"][a + 2], settled[a + 2]) for n, a in xy.items()}
    assert all(abs(b - a) < 0.005 for a, b in heights.values()), heights
    # deterministic per (seed, task, init state); another init state key draws other directions
    again, _ = lp.shift_objects(env, base["state"], 0.05, lp.episode_rng(KEY, "position"))
    assert np.array_equal(again, snap["state"])
    other, _ = lp.shift_objects(env, base["state"], 0.05, lp.episode_rng((0, "spatial", 0, 1), "position"))
    assert not np.array_equal(other, snap["state"])


def test_swap_exchanges_two_objects_and_nothing_else(sim):
    env, task, (base, _) = sim
    snap, info = _start(env, task, lp.Perturbation("swap", "task"))
    assert _changed(base, snap) == {"state"}
    a, b = info["swap=task"]["swapped"]
    interest = set(env.env.obj_of_interest)
    assert a in interest or b in interest
    xy = _object_xy(env)
    ia, ib = xy[a], xy[b]
    assert np.array_equal(snap["state"][ia:ia + 2], base["state"][ib:ib + 2])
    assert np.array_equal(snap["state"][ib:ib + 2], base["state"][ia:ia + 2])
    diff = set(np.flatnonzero(snap["state"] != base["state"]))
    assert diff <= {ia, ia + 1, ib, ib + 1}
    again, _ = lp.swap_objects(env, base["state"], "task", lp.episode_rng(KEY, "swap"))
    assert np.array_equal(again, snap["state"])


def test_camera_moves_only_the_agentview_camera(sim):
    import mujoco

    env, task, (base, _) = sim
    snap, info = _start(env, task, lp.Perturbation("camera", 10.0))
    assert _changed(base, snap) == {"cam_pos", "cam_quat"}
    m = env.env.sim.model._model
    cam = mujoco.mj_name2id(m, mujoco.mjtObj.mjOBJ_CAMERA, "agentview")
    moved = {i for i in range(m.ncam) if not np.array_equal(base["cam_pos"][i], snap["cam_pos"][i])
             or not np.array_equal(base["cam_quat"][i], snap["cam_quat"][i])}
    assert moved == {cam}
    assert np.array_equal(base["state"], snap["state"])
    assert not np.array_equal(base["agentview"], snap["agentview"])
    assert np.array_equal(base["wrist"], snap["wrist"])  # the wrist camera sees exactly what it saw
    got = info["camera=10"]
    assert abs(got["azimuth_deg"]) == 10 and abs(got["elevation_deg"]) == 5
    # the orbit keeps the distance to the point looked at; the view turns by the azimuth about the vertical
    fwd = [-lp._quat_to_mat(q)[:, 2] for q in (base["cam_quat"][cam], snap["cam_quat"][cam])]
    yaw = (np.degrees(np.arctan2(fwd[1][1], fwd[1][0]) - np.arctan2(fwd[0][1], fwd[0][0])) + 180) % 360 - 180
    assert yaw == pytest.approx(got["azimuth_deg"], abs=0.5)
    # the same draws for the same episode, others for another init state (the next test's reset undoes the edits)
    again = lp.move_camera(env, 10.0, lp.episode_rng(KEY, "camera"))
    assert (again["azimuth_deg"], again["elevation_deg"]) == (got["azimuth_deg"], got["elevation_deg"])
    draws = {tuple(lp.move_camera(env, 10.0, lp.episode_rng((0, "spatial", 0, e), "camera")).values())[1:3]
             for e in range(8)}
    assert len(draws) > 1


def test_light_changes_only_the_lights(sim):
    env, task, (base, _) = sim
    snap, info = _start(env, task, lp.Perturbation("light", 0.5))
    assert _changed(base, snap) == {"light_dir", "light_diffuse", "light_specular"}
    scale = info["light=0.5"]["intensity_scale"]
    assert scale in (0.5, 2.0)
    assert np.allclose(snap["light_diffuse"], base["light_diffuse"] * scale)
    for before, after in zip(base["light_dir"], snap["light_dir"]):
        cos = np.dot(before, after) / np.linalg.norm(before) / np.linalg.norm(after)
        assert np.degrees(np.arccos(np.clip(cos, -1, 1))) == pytest.approx(lp.LIGHT_TILT_DEG, abs=1e-6)
    assert np.array_equal(base["state"], snap["state"])
    assert lp.change_lights(env, 0.5, lp.episode_rng(KEY, "light")) == info["light=0.5"]  # the same draws


def test_table_recolours_only_the_table_top(sim):
    env, task, (base, _) = sim
    snap, info = _start(env, task, lp.Perturbation("table", "random"))
    assert _changed(base, snap) == {"geom_rgba", "geom_matid"}
    got = info["table=random"]
    assert got["geoms"] == ["table_visual"] and got["colour"] in lp.TABLE_COLOURS
    (changed,) = np.flatnonzero((base["geom_rgba"] != snap["geom_rgba"]).any(axis=1)
                                | (base["geom_matid"] != snap["geom_matid"]))
    assert snap["geom_matid"][changed] == -1
    assert tuple(snap["geom_rgba"][changed]) == pytest.approx(lp.TABLE_COLOURS[got["colour"]])
    assert np.array_equal(base["state"], snap["state"])
    assert not np.array_equal(base["agentview"], snap["agentview"])
    assert lp.recolour_surface(env, "random", lp.episode_rng(KEY, "table")) == got  # deterministic per episode


def test_the_env_worker_applies_a_perturbation(sim):
    """The pool's reset carries the perturbation to the worker process and reports what it changed."""
    from dzmodel.eval.libero_env import init_state
    from dzmodel.eval.libero_workers import EnvWorkerPool, EpisodeInit

    _, task, _ = sim
    p = lp.Perturbation("position", 0.05)
    with EnvWorkerPool(1, camera_size=64, timeout_s=240) as pool:
        reply = pool.reset([(0, task, 0)], {0: EpisodeInit(scene=(p,), scene_key=KEY)})[0]
    assert isinstance(reply, dict), reply
    standard = init_state(task, 0)
    moved = np.flatnonzero(reply["init_state"] != standard)
    assert moved.size and set(reply["perturbation"]) == {"position=0.05"}
    shifts = reply["perturbation"]["position=0.05"]["shift_xy"]
    assert all(np.linalg.norm(s) == pytest.approx(0.05, abs=1e-4) for s in shifts.values())


# --- distractor objects ----------------------------------------------------------------------------------------


def _kinds_of(text: str) -> set[str]:
    return set(lp._declared(text, "(:objects").values()) | set(lp._declared(text, "(:fixtures").values())


def test_distractor_kinds_are_new_to_the_task_and_fixed_per_task():
    pytest.importorskip("libero", reason="LIBERO is not installed (make libero)")
    from pathlib import Path

    from dzmodel.eval.libero_env import list_tasks

    with contextlib.redirect_stdout(sys.stderr):
        from libero.libero.envs.objects import get_object_dict
    library = get_object_dict()
    for kind in (k for kinds in lp.DISTRACTOR_KINDS.values() for k in kinds):
        assert library[kind]().__module__.endswith(lp._family(kind)), kind  # its asset loads, from that family
    for suite in ("spatial", "object", "goal", "10"):
        for task in list_tasks(suite):
            text = Path(task.bddl_file).read_text()
            kinds = lp.distractor_kinds(text, lp.MAX_DISTRACTORS, (0, suite, task.index, 0))
            assert len(set(kinds)) == lp.MAX_DISTRACTORS
            taken = lp._words(task.language) | {w for k in _kinds_of(text) for w in lp._words(k)}
            assert not any(lp._words(k) & taken for k in kinds), (task.name, kinds)
    text = Path(list_tasks("object")[0].bddl_file).read_text()
    kinds = lp.distractor_kinds(text, 3, (0, "object", 0, 0))
    assert all(lp._family(k) == "hope_objects" for k in kinds)  # the scene's own family (groceries) first
    assert lp.distractor_kinds(text, 3, (0, "object", 0, 7)) == kinds  # every episode of a task: one env
    assert lp.distractor_kinds(text, 2, (0, "object", 0, 0)) == kinds[:2]
    assert len({tuple(lp.distractor_kinds(text, 3, (s, "object", 0, 0))) for s in range(6)}) > 1


def test_missing_distractor_models_are_refused_before_any_episode(tmp_path):
    """An install with part of LIBERO's assets (a one-suite bundle) cannot build a scene with distractors from other
    suites: the check names each missing model file and its tasks; the full install passes."""
    pytest.importorskip("libero", reason="LIBERO is not installed (make libero)")
    from dzmodel.eval.libero_env import check_libero, list_tasks

    tasks = list_tasks("goal")
    lp.check_distractor_assets(check_libero() / "assets", tasks, 2, 0)  # the installed assets have every model
    for kinds in lp.DISTRACTOR_KINDS.values():
        for kind in kinds:
            path = tmp_path / lp.distractor_asset(kind)
            path.parent.mkdir(parents=True)
            path.write_text("<mujoco/>")
    lp.check_distractor_assets(tmp_path, tasks, 2, 0)
    first = lp.distractor_kinds(open(tasks[3].bddl_file).read(), 2, (0, "goal", 3))[0]
    (tmp_path / lp.distractor_asset(first)).unlink()
    users = [t.index for t in tasks if first in lp.distractor_kinds(open(t.bddl_file).read(), 2, (0, "goal", t.index))]
    with pytest.raises(lp.PerturbationError) as err:
        lp.check_distractor_assets(tmp_path, tasks, 2, 0)
    assert str(tmp_path / lp.distractor_asset(first)) in str(err.value)
    assert f"(task {', '.join(map(str, users))})" in str(err.value) and "1 object model" in str(err.value)


def test_the_distractor_problem_is_the_task_plus_the_objects():
    pytest.importorskip("libero", reason="LIBERO is not installed (make libero)")
    from libero.libero.envs.bddl_utils import robosuite_parse_problem

    from dzmodel.eval.libero_env import list_tasks

    for suite, index in (("spatial", 0), ("object", 0), ("10", 0)):
        task = list_tasks(suite)[index]
        key = (0, suite, index, 0)
        path = lp.scene_bddl(task.bddl_file, [lp.Perturbation("distractor", 3)], key)
        assert path != task.bddl_file
        base, new = robosuite_parse_problem(task.bddl_file), robosuite_parse_problem(path)
        added = {k: v for k, v in new["objects"].items() if k not in base["objects"]}
        assert sorted(added) == sorted(lp.distractor_kinds(open(task.bddl_file).read(), 3, key))
        assert all(v == [lp.DISTRACTOR_PREFIX + k] for k, v in added.items())
        assert {k: v for k, v in new["objects"].items() if k in base["objects"]} == base["objects"]
        for field in ("goal_state", "obj_of_interest", "fixtures", "language_instruction", "problem_name"):
            assert new[field] == base[field], field
        assert new["initial_state"][:len(base["initial_state"])] == base["initial_state"]
        assert len(new["initial_state"]) == len(base["initial_state"]) + 3
    # without a distractor the env is built from the task's own file
    task = list_tasks("spatial")[0]
    for ps in ([], [lp.Perturbation("camera", 10.0)], [lp.Perturbation("position", 0.05)]):
        assert lp.scene_bddl(task.bddl_file, ps, KEY) == task.bddl_file


@pytest.fixture(scope="module")
def distracted(sim):
    """An env of the same task built from the distractor problem (2 objects), reset as the base one."""
    with contextlib.redirect_stdout(sys.stderr):
        from libero.libero.envs import OffScreenRenderEnv
    _, task, _ = sim
    p = lp.Perturbation("distractor", 2)
    env = OffScreenRenderEnv(bddl_file_name=lp.scene_bddl(task.bddl_file, [p], KEY), camera_heights=64,
                             camera_widths=64, camera_names=["agentview", "robot0_eye_in_hand"])
    yield env, p
    env.close()


def _joint_values(env, state) -> dict[str, np.ndarray]:
    """{joint name: its qpos and qvel values} of a flat [time, qpos, qvel] state of this env's model."""
    m = env.env.sim.model._model
    out = {}
    for j in range(m.njnt):
        nq, nv = lp._joint_sizes(m.jnt_type[j])
        q, v = 1 + m.jnt_qposadr[j], 1 + m.nq + m.jnt_dofadr[j]
        out[lp._name(m, "mjOBJ_JOINT", j)] = np.concatenate([state[q:q + nq], state[v:v + nv]])
    return out


def test_distractors_are_new_objects_resting_clear_on_the_table(sim, distracted):
    from dzmodel.eval.libero_env import init_state

    base_env, task, (base, _) = sim
    env, p = distracted
    snap, info = _start(env, task, p)
    placed = info["distractor=2"]["placed"]
    base_names = set(base_env.env.objects_dict)
    assert set(env.env.objects_dict) - base_names == set(placed) and len(placed) == 2
    assert base_names <= set(env.env.objects_dict)
    task_kinds = {o.category for o in lp._objects(base_env)} | set(base_env.env.parsed_problem["fixtures"])
    assert not set(info["distractor=2"]["kinds"]) & task_kinds
    # the task's objects, the robot and the fixtures start exactly as in the standard init state
    before, after = _joint_values(base_env, init_state(task, 0)), _joint_values(env, snap["state"])
    assert set(before) < set(after) and len(after) == len(before) + 2
    assert all(np.array_equal(before[n], after[n]) for n in before)
    assert snap["state"][0] == init_state(task, 0)[0]
    # the goal is the task's own
    assert env.env.parsed_problem["goal_state"] == base_env.env.parsed_problem["goal_state"]
    assert env.env.obj_of_interest == base_env.env.obj_of_interest
    assert not env.env._check_success()
    # each distractor: on the table, >= 5 mm from every body but the table, off the goal's plate
    sim_, m, d = lp._model(env)
    objects = {o.name: o for o in lp._objects(env)}
    table = int(m.body_rootid[sim_.model.body_name2id("table")])
    roots = {objects[n].root for n in placed}
    assert all(table in pair for pair in lp._touching(m, d, lp.CLEARANCE_M) if set(pair) & roots)
    plate_lo, plate_hi = lp._boxes(m, d, objects["plate_1"].root)
    for name in placed:
        lo, hi = lp._boxes(m, d, objects[name].root)
        assert not (np.all(lo[:2] < plate_hi[:2]) and np.all(hi[:2] > plate_lo[:2])), name
        assert 0 < lp._gap(m, d, objects[name].root, table) <= 2 * lp.REST_GAP_M
    # after the settle steps: resting where they were put (a drop of the 1 mm gap), the task's objects as unperturbed
    settled = _settle(env)
    for name in placed:
        a = objects[name].adr
        assert np.linalg.norm(settled[a:a + 2] - snap["state"][a:a + 2]) < 1e-4
        assert -3 * lp.REST_GAP_M < settled[a + 2] - snap["state"][a + 2] <= 0
        assert lp._support(m, d, objects[name].root)[0] == table
    unmoved, now = _joint_values(base_env, base["settled"]), _joint_values(env, settled)
    for name in (o.name for o in lp._objects(base_env)):
        joint = f"{name}_joint0"
        assert np.allclose(unmoved[joint][:3], now[joint][:3], atol=1e-3), name


def test_distractor_places_are_seeded_per_episode(sim, distracted):
    _, task, _ = sim
    env, p = distracted
    first, info = _start(env, task, p)
    again, info2 = _start(env, task, p)
    assert np.array_equal(first["state"], again["state"]) and info == info2
    other, info3 = _start(env, task, p, key=(0, "spatial", 0, 1))
    assert info3["distractor=2"]["kinds"] == info["distractor=2"]["kinds"]  # one env per task
    assert info3["distractor=2"]["placed"] != info["distractor=2"]["placed"]


def test_a_distractor_env_must_match_the_count(sim, distracted):
    from dzmodel.eval.libero_env import init_state

    base_env, task, _ = sim
    env, _ = distracted
    with pytest.raises(lp.PerturbationError, match="distractor: this env has 0 distractor objects"):
        lp.apply_scene(base_env, init_state(task, 0), [lp.Perturbation("distractor", 2)], KEY)
    with pytest.raises(lp.PerturbationError, match="init state has 5 values"):
        lp.map_state(env, np.zeros(5), set())


def test_the_scripted_expert_solves_an_object_task_among_distractors():
    """The worker builds the distractor env, places them, and the expert still solves the task."""
    pytest.importorskip("libero", reason="LIBERO is not installed (make libero)")
    from dzmodel.eval.libero_env import SUITES, init_state, list_tasks
    from dzmodel.eval.libero_workers import EnvWorkerPool, EpisodeInit

    task = list_tasks("object")[0]
    p = lp.Perturbation("distractor", 3)
    key = (0, "object", 0, 0)
    with EnvWorkerPool(1, camera_size=64, timeout_s=240) as pool:
        reply = pool.reset([(0, task, 0)], {0: EpisodeInit(scene=(p,), scene_key=key)})[0]
        assert isinstance(reply, dict), reply
        assert reply["init_state"].size == init_state(task, 0).size + 3 * (7 + 6)
        assert len(reply["perturbation"]["distractor=3"]["placed"]) == 3
        success = False
        for _ in range(SUITES["object"].max_steps):
            out = pool.expert_step({0: 0})[0]
            assert not isinstance(out, Exception), out
            if out.success:
                success = True
                break
    assert success
