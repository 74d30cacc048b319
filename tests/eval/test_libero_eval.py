"""The LIBERO eval loop's bookkeeping against a scripted env pool (no simulator): chunked execution,
success_once, a crashed worker's episode retried once then failed with a note, tables and the plot.
The real simulator runs in test_smoke_eval.py."""

from dataclasses import dataclass

import numpy as np
import pytest

from dzmodel.eval.libero_env import TaskSpec, WorkerCrashed
from dzmodel.eval.libero_eval import EvalConfig, evaluate_policy, plot_success, summarize, write_results

from .lockstep_pool import Lockstep, Staggered, _per_worker, overlapping


@dataclass
class FakePolicy:
    action_horizon: int = 4
    calls: int = 0
    batches: list = None   # sessions per predict_batch call

    ended: list = None

    def predict(self, session_id, views, state, instruction):
        assert set(views) == {"image", "wrist_image"} and state.shape == (8,)
        self.calls += 1
        return np.full((self.action_horizon, 7), 0.5)

    def predict_batch(self, requests):
        self.batches = (self.batches or []) + [len(requests)]
        return [self.predict(*r) for r in requests]

    def end_session(self, session_id):
        self.ended = (self.ended or []) + [session_id]


class ScriptedPool(Lockstep):
    """success_at[(task, episode)] = the step that succeeds; crash[(task, episode)] = crashes per attempt."""

    def __init__(self, n, success_at, crashes):
        self.num_workers, self.success_at, self.crashes = n, success_at, dict(crashes)
        self.running = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def _obs(self):
        return {"image": np.zeros((8, 8, 3), np.uint8), "wrist_image": np.zeros((8, 8, 3), np.uint8),
                "state": np.zeros(8)}

    def reset(self, assignments):
        out = {}
        for w, task, ep in assignments:
            self.running[w] = [(task.index, ep), 0]
            out[w] = self._obs()
        return out

    def step(self, actions):
        out = {}
        for w, a in actions.items():
            assert a.shape == (7,) and a[-1] in (-1.0, 1.0)  # the gripper is binarised
            key, n = self.running[w]
            self.running[w][1] = n = n + 1
            if self.crashes.get(key, 0) and n == 2:
                self.crashes[key] -= 1
                out[w] = WorkerCrashed(w, "killed by the test")
                continue
            out[w] = (self._obs(), self.success_at.get(key) == n)
        return out


def _tasks(n=3):
    return [TaskSpec("spatial", i, f"task_{i}", f"do task {i}", f"/x/{i}.bddl", 50) for i in range(n)]


def _run(success_at, crashes, **cfg):
    policy = FakePolicy()
    config = EvalConfig(episodes=2, max_steps=10, workers=2, videos=0, **cfg)
    results = evaluate_policy(policy, config, progress=False, tasks=_tasks(),
                              pool_factory=lambda n: ScriptedPool(n, success_at, crashes))
    return policy, {(r.task, r.episode): r for r in results}


def test_success_once_chunks_and_crash_retry():
    policy, res = _run(success_at={(0, 0): 3, (1, 1): 10}, crashes={(2, 0): 1, (2, 1): 2}, actions_per_chunk=2)
    assert len(res) == 6
    assert res[(0, 0)].success and res[(0, 0)].steps == 3  # stops at the first success
    assert res[(1, 1)].success and res[(1, 1)].steps == 10
    assert not res[(0, 1)].success and res[(0, 1)].steps == 10  # ran to max_steps
    assert res[(2, 0)].attempts == 2 and res[(2, 0)].steps == 10 and "retried" in res[(2, 0)].note
    assert not res[(2, 1)].success and res[(2, 1)].attempts == 2 and "crashed twice" in res[(2, 1)].note
    # 2 actions per query: ceil(3/2) + 3 x ceil(10/2) + (2 + 5 for the retried episode) + 2 + 1 (crashed ones)
    assert policy.calls == 2 + 5 * 3 + 1 + 5 + 1 + 1
    assert len(policy.ended) >= 6  # every episode's KV-cache session is released


class ResetCrashPool(ScriptedPool):
    """Every reset of task 1 crashes (an env that cannot be built: a missing asset, say)."""

    def reset(self, assignments):
        out = super().reset(assignments)
        for w, task, _ in assignments:
            if task.index == 1:
                out[w] = WorkerCrashed(w, "FileNotFoundError: assets/x/x.xml")
        return out


def test_an_env_that_cannot_start_stops_the_evaluation_instead_of_counting_failures():
    from dzmodel.eval.libero_eval import EnvStartError

    config = EvalConfig(episodes=2, max_steps=10, workers=2, videos=0)
    with pytest.raises(EnvStartError, match=r"task 1 \(task_1\), init state 0: .*could not start.*assets/x/x.xml"):
        evaluate_policy(FakePolicy(), config, progress=False, tasks=_tasks(),
                        pool_factory=lambda n: ResetCrashPool(n, {}, {}))


def test_episodes_needing_a_chunk_share_one_policy_forward():
    """Batched (default): both running episodes query together, one predict_batch per step that needs chunks; with
    batch_policy off each episode queries alone. Same results either way; the timing counts chunks and forwards."""
    runs = {}
    for batched in (True, False):
        policy = FakePolicy()
        timing = {}
        config = EvalConfig(episodes=2, max_steps=10, workers=2, videos=0, actions_per_chunk=2,
                            batch_policy=batched)
        results = evaluate_policy(policy, config, progress=False, tasks=_tasks(), timing=timing,
                                  pool_factory=lambda n: ScriptedPool(n, {(0, 0): 3}, {}))
        runs[batched] = (policy, timing, [(r.task, r.episode, r.success, r.steps) for r in results])
    (bp, bt, bres), (sp, st, sres) = runs[True], runs[False]
    assert bres == sres and bp.calls == sp.calls == bt["chunks"] == st["chunks"]
    assert max(bp.batches) == 2 and sp.batches is None
    assert bt["forwards"] < bt["chunks"] and st["forwards"] == st["chunks"]
    assert bt["policy_s"] >= 0 and bt["env_s"] >= 0


def test_episodes_step_while_another_resets_with_the_same_results():
    """A LIBERO reset takes seconds: the other episodes keep stepping (and querying the policy) meanwhile, and the
    results do not depend on the order in which replies come."""
    class OutOfOrder(Staggered, ScriptedPool):
        def step_waits(self, worker):
            return 1 + worker % 2  # odd workers step at half the speed

    pools, results, timings = [], {}, {}
    for name, factory in (("lockstep", ScriptedPool), ("staggered", OutOfOrder)):
        def make(n, factory=factory):
            pools.append(factory(n, {(0, 0): 3, (1, 1): 7, (2, 0): 5}, {(2, 1): 1}))
            return pools[-1]

        config = EvalConfig(episodes=4, max_steps=10, workers=3, videos=0, actions_per_chunk=2)
        timings[name] = {}
        out = evaluate_policy(FakePolicy(), config, progress=False, tasks=_tasks(), pool_factory=make,
                              timing=timings[name])
        results[name] = [(r.task, r.episode, r.success, r.steps, r.attempts) for r in out]
    assert results["staggered"] == results["lockstep"] and len(results["lockstep"]) == 12
    assert overlapping(pools[1].log) > 0
    # episodes out of phase still share forwards: one that needs a chunk waits for those whose reply will need one
    # (32 forwards for 55 chunks here; 42 if each asked as soon as it could)
    staggered = timings["staggered"]
    assert staggered["chunks"] == timings["lockstep"]["chunks"] == 55 and staggered["forwards"] <= 0.6 * 55


def test_envs_with_actions_left_step_while_the_policy_computes():
    """At every policy forward each running episode is in the forward's batch or has its env command in flight:
    none holding actions waits for the forward to end (the envs and the policy overlap)."""
    class Watched(Staggered, ScriptedPool):
        def step_waits(self, worker):
            return 1 + worker % 3  # out of phase, so episodes with actions left meet forwards

    class Policy(FakePolicy):
        idle = 0

        def predict_batch(self, requests):
            in_flight = {w for call, args in pool._submitted() for w, _ in _per_worker(call, args)}
            in_flight |= {w for _, w, _, _ in getattr(pool, "_due", [])}
            asking = {r[0].split("-try")[0] for r in requests}
            ended = {e.split("-try")[0] for e in self.ended or []}
            for w, ((task, episode), _) in pool.running.items():
                name = f"task{task}-ep{episode}"
                self.idle += name not in asking | ended and w not in in_flight
            return super().predict_batch(requests)

    pool = None

    def make(n):
        nonlocal pool
        pool = Watched(n, {(0, 0): 5, (1, 1): 9}, {})
        return pool

    policy = Policy()
    config = EvalConfig(episodes=3, max_steps=12, workers=3, videos=0, actions_per_chunk=4)
    results = evaluate_policy(policy, config, progress=False, tasks=_tasks(), pool_factory=make)
    assert len(results) == 9 and len(policy.batches) > 5
    assert policy.idle == 0


def test_tables_and_plot(tmp_path):
    _, res = _run(success_at={(0, 0): 1, (0, 1): 1, (1, 0): 2}, crashes={})
    rows = summarize(list(res.values()), step=100) + summarize(list(res.values())[:2], step=200)
    overall = [r for r in rows if r["task"] == "all"]
    assert overall[0] == {"step": 100, "task": "all", "task_name": "", "episodes": 6, "successes": 3, "rate": 0.5,
                          "ci_low": 0.1876, "ci_high": 0.8124}
    assert [r["rate"] for r in rows if r["task"] == 0] == [1.0, 1.0]
    write_results(tmp_path, rows, [{"step": 100, "task": 0}])
    assert not (tmp_path / "per_episode.csv").exists()  # no run seed known
    write_results(tmp_path, rows, [{"step": 100, "train_seed": 2, "task": 0, "episode": 7, "success": True}])
    assert (tmp_path / "per_episode.csv").read_text() == "seed,task,init_state,checkpoint_step,success\n2,0,7,100,1\n"
    assert (tmp_path / "results.csv").read_text().splitlines()[0] == \
        "step,task,task_name,episodes,successes,rate,ci_low,ci_high"
    png = plot_success(rows, tmp_path / "plot.png", "t")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_eval_config_and_task_index():
    with pytest.raises(ValueError, match="eval.episodes"):
        EvalConfig(episodes=0)
    with pytest.raises(ValueError, match="has tasks 0..2"):
        evaluate_policy(FakePolicy(), EvalConfig(tasks=[5], videos=0), progress=False, tasks=_tasks(),
                        pool_factory=lambda n: ScriptedPool(n, {}, {}))


class FramePool(ScriptedPool):
    """ScriptedPool whose frames change every step (64 px views, the tiny embodiment's size)."""

    def _obs(self):
        self.t = getattr(self, "t", 0) + 1
        img = np.full((64, 64, 3), self.t % 255, np.uint8)
        return {"image": img, "wrist_image": img[::-1].copy(), "state": np.zeros(8)}


@pytest.fixture(scope="module")
def tiny_embodied(tmp_path_factory):
    """A random tiny policy with 16-action chunks (as the demo trains it) behind the LIBERO tiny embodiment."""
    import dataclasses
    from pathlib import Path

    import dzmodel.policy.sessions as components
    from dzmodel.data.embodiments import get_embodiment
    from dzmodel.policy.policy import EmbodiedPolicy
    from dzmodel.model.sampler import SolverConfig

    real = components.preset
    components.preset = lambda name: dataclasses.replace(real(name), num_action_per_block=16)
    try:
        policy = components.build_tiny_policy(tmp_path_factory.mktemp("tok"), solver=SolverConfig(num_steps=1,
                                                                                                  cfg_scale=1.0))
    finally:
        components.preset = real
    return EmbodiedPolicy(policy, get_embodiment("libero_sim_tiny"), [], None, Path("."))


@pytest.mark.parametrize("context", ["episode", "frame"])
def test_an_episodes_later_queries_extend_its_session(tiny_embodied, context):
    """context episode: the second query of an episode sends the 8 frames since the first (every 2nd step of a
    16-action chunk) and the KV cache then holds more than frame 0; context frame restarts from one frame."""
    held, sent = [], []
    predict_batch = tiny_embodied.predict_batch

    def spy(requests):
        out = predict_batch(requests)
        for sid, views, *rest in requests:
            sent.append(np.asarray(views["image"]).reshape(-1, 64, 64, 3).shape[0])
            held.append(tiny_embodied.policy.sessions[sid].caches[0].num_frames)
        return out

    tiny_embodied.predict_batch = spy
    try:
        config = EvalConfig(episodes=1, max_steps=40, workers=1, videos=0, context=context)
        evaluate_policy(tiny_embodied, config, progress=False, tasks=_tasks(1),
                        pool_factory=lambda n: FramePool(n, {}, {}))
    finally:
        del tiny_embodied.predict_batch
    assert tiny_embodied.frame_stride == 2 and len(held) == 3  # steps 0, 16, 32
    if context == "episode":
        assert sent == [1, 8, 8] and held[0] == 1 and held[1] > 1 and held[2] > 1
    else:
        assert sent == [1, 1, 1] and held == [1, 1, 1]


def test_a_replanning_interval_must_end_on_a_frame_the_model_saw(tiny_embodied):
    with pytest.raises(ValueError, match="multiple of 2"):
        evaluate_policy(tiny_embodied, EvalConfig(episodes=1, max_steps=8, videos=0, actions_per_chunk=3),
                        progress=False, tasks=_tasks(1), pool_factory=lambda n: FramePool(n, {}, {}))
    with pytest.raises(ValueError, match="eval.context"):
        EvalConfig(context="window")


def test_wilson_intervals_and_pooled_checkpoints():
    from dzmodel.eval.libero_eval import pooled, wilson_interval

    assert wilson_interval(0, 40)[0] == 0.0 and 0.08 < wilson_interval(0, 40)[1] < 0.09
    low, high = wilson_interval(34, 80)  # 42.5 %
    assert 0.32 < low < 0.33 and 0.53 < high < 0.54
    rows = [{"step": s, "task": "all", "episodes": 10, "successes": k} for s, k in ((1, 9), (2, 2), (3, 4), (4, 6))]
    last3 = pooled(rows, [2, 3, 4])
    assert last3["episodes"] == 30 and last3["successes"] == 12 and last3["rate"] == 0.4 and last3["step"] == "2,3,4"


def test_init_states_can_start_past_the_ones_that_picked_a_checkpoint():
    seen = []

    class Pool(ScriptedPool):
        def reset(self, assignments):
            seen.extend(ep for _, _, ep in assignments)
            return super().reset(assignments)

    evaluate_policy(FakePolicy(), EvalConfig(episodes=3, first_init_state=40, max_steps=2, videos=0),
                    progress=False, tasks=_tasks(1), pool_factory=lambda n: Pool(n, {}, {}))
    assert sorted(seen) == [40, 41, 42]
    with pytest.raises(ValueError, match="has 50 init states; asked for 51"):
        evaluate_policy(FakePolicy(), EvalConfig(episodes=3, first_init_state=48, videos=0),
                        progress=False, tasks=_tasks(1), pool_factory=lambda n: Pool(n, {}, {}))
