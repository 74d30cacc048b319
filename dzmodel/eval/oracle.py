"""`dz eval oracle DATASET --out DIR`: replay recorded demonstrations through the exact evaluation path.

A perfect policy would output the recorded actions. The oracle is that policy: for each episode recorded by
`dz data record libero` it returns the episode's own actions, chunk by chunk, and everything around it is the
evaluation's code: `evaluate_policy` with the same env worker pool, the recorded init state and env seed, the
settle steps, chunked execution (`action_horizon` actions per query) and gripper binarisation; the actions pass
through the training normalisation (q99 with clipping, the run's statistics, as the model's training targets,
in float32) and come back through `EmbodiedPolicy.predict` and the same `NormStats.unnormalize` that un-normalises
the model's output. The images go through the policy adapter's transforms as well.

If the recorded successes do not reproduce, training and evaluation disagree somewhere (image orientation,
gripper sign, action scale, normalisation, chunk alignment, init state), and no model trained on the data can
succeed either. Below `MIN_RATE` the command exits 1.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..atomic import atomic_write_text
from ..data.errors import DataError

MIN_RATE = 0.95
_SESSION = re.compile(r"^task(\d+)-ep(\d+)-try(\d+)$")  # libero_eval.SESSION_FORMAT


@dataclass
class ReplayModel:
    """Stands in for `DreamZeroPolicy` behind the policy adapter: `predict_actions` returns the next chunk of a
    recorded episode's normalised actions (as the model would predict them, float32), un-normalised by the
    same `action_stats.unnormalize` as the model's output."""

    action_stats: object                        # NormStats
    horizon: int
    normalized: dict[tuple[int, int], np.ndarray]  # (task, episode id) -> float32 [T + padding, A]
    sessions: dict = field(default_factory=dict)   # session id -> chunks served so far
    state_stats: object = None                     # the replay reads no state

    def predict_actions(self, obs: dict) -> np.ndarray:
        sid = str(obs["session_id"])
        m = _SESSION.match(sid)
        if m is None:
            raise ValueError(f"oracle: unexpected session id {sid!r}")
        actions = self.normalized[(int(m.group(1)), int(m.group(2)))]
        k = self.sessions.get(sid, 0)
        self.sessions[sid] = k + 1
        chunk = actions[k * self.horizon:(k + 1) * self.horizon]
        if len(chunk) < self.horizon:  # past the padding: hold still (the step limit ends the episode)
            chunk = np.concatenate([chunk, np.repeat(actions[-1:], self.horizon - len(chunk), axis=0)])
        return self.action_stats.unnormalize(chunk.astype(np.float64))

    def predict_batch(self, observations: list[dict]) -> list[np.ndarray]:
        return [self.predict_actions(obs) for obs in observations]


def _episode_actions(reader, emb, episode: int) -> np.ndarray:
    """The embodiment's action vector of every row of an episode, as training reads it (float64)."""
    from ..data.dataset import key_vectors

    cols = reader.read_columns(episode, sorted({k.column for k in emb.action}))
    return key_vectors(cols, emb.action, slice(None))


def _statistics(dataset: Path, emb, metadata: Path | None, out: Path) -> Path:
    if metadata is not None:
        return metadata
    from ..data.dataset import embodiment_metadata

    path = out / "metadata.json"
    embodiment_metadata(dataset, emb, path)
    return path


def run_oracle(dataset: str | Path, out: str | Path, metadata: str | Path | None = None,
               embodiment: str = "libero_sim", max_episodes: int | None = None, workers: int = 2,
               camera_size: int | None = None, videos: int = 0, progress: bool = True,
               pool_factory=None, log=print) -> dict:
    """Replay the recorded episodes of `dataset` (module docstring); writes results.csv, episodes.csv and
    summary.json (with `oracle_success_rate`) to `out` and returns the summary."""
    from ..data.embodiments import get_embodiment, load_embodiments
    from ..data.lerobot_format import open_dataset
    from .libero_env import list_tasks, zero_action
    from .libero_workers import EpisodeInit
    from .libero_eval import EvalConfig, evaluate_policy, summarize, write_results
    from .libero_record import read_recording
    from ..policy.policy import EmbodiedPolicy, policy_statistics

    dataset, out = Path(dataset), Path(out)
    rec = read_recording(dataset)
    opts = rec.get("options") or {}
    if opts.get("executed_key"):  # DART noise or DAgger: the labels were not what the env executed
        how = "DAgger" if opts.get("dagger_model") else f"DART noise {opts.get('dart_noise')}"
        raise DataError(f"{dataset}: recorded with {how}: its actions are the expert's labels, not the executed "
                        f"actions ({opts['executed_key']}), so replaying them cannot reproduce the episodes; the oracle "
                        "replays plain expert recordings")
    reader = open_dataset(dataset)
    emb = get_embodiment(embodiment, load_embodiments())
    if emb.relative_action_keys:
        raise DataError(f"--embodiment: {emb.tag!r} has relative action keys; LIBERO's recorded actions are absolute "
                        "deltas, replay them through libero_sim or libero_sim_tiny")
    out.mkdir(parents=True, exist_ok=True)
    meta_path = _statistics(dataset, emb, Path(metadata) if metadata else None, out)
    _, action_stats, pairs, _ = policy_statistics(emb, meta_path)
    tasks = {t.index: t for t in list_tasks(rec["suite"])}
    recorded = rec["episodes"]
    if max_episodes and max_episodes < len(recorded):  # evenly spread, so that every task is replayed
        recorded = [recorded[i] for i in np.linspace(0, len(recorded) - 1, max_episodes).round().astype(int)]
    if not recorded:
        raise DataError(f"{dataset}: the recording holds no episodes")
    H, pad = emb.action_horizon, zero_action()
    normalized, specs, clipped = {}, [], []
    for ep in recorded:
        raw = _episode_actions(reader, emb, ep["episode_index"])
        if len(raw) != ep["steps"]:
            raise DataError(f"{dataset}: episode {ep['episode_index']} has {len(raw)} rows, the recording says "
                            f"{ep['steps']}")
        hold = np.array(pad)
        hold[-1] = raw[-1, -1]  # past the end: no motion, the gripper as last commanded
        padded = np.concatenate([raw, np.repeat(hold[None], H, axis=0)])
        span = action_stats.q99 - action_stats.q01
        clipped.append(((raw < action_stats.q01) | (raw > action_stats.q99)) & (span > 0))
        normalized[(ep["task"], ep["episode_index"])] = action_stats.normalize(padded).astype(np.float32)
        specs.append((tasks[ep["task"]], ep["episode_index"],
                      EpisodeInit(state=np.asarray(ep["init_state"], dtype=np.float64), env_seed=ep["env_seed"])))
    model = ReplayModel(action_stats, H, normalized)
    policy = EmbodiedPolicy(policy=model, embodiment=emb, relative_pairs=pairs, step=None, model_dir=dataset)
    size = camera_size or int(reader.features["observation.images.image"].shape[0])
    cfg = EvalConfig(suite=rec["suite"], workers=workers, camera_size=size, videos=videos,
                     max_steps=rec["max_steps"])
    log(f"oracle: replaying {len(specs)} recorded episodes of LIBERO-{rec['suite']} through the evaluation path "
        f"({workers} env workers, chunks of {H}, q99 statistics {meta_path})")
    results = evaluate_policy(policy, cfg, out, progress=progress, tag="oracle", episodes=specs,
                              pool_factory=pool_factory)
    rows = summarize(results)
    write_results(out, rows, [asdict(r) for r in results])
    ok = sum(r.success for r in results)
    rate = ok / len(results)
    frac = np.concatenate(clipped).mean(axis=0)
    summary = {
        "dataset": str(dataset), "suite": rec["suite"], "embodiment": emb.tag, "statistics": str(meta_path),
        "recorded_successes": len(results), "reproduced": ok, "oracle_success_rate": round(rate, 4),
        "passed": rate >= MIN_RATE, "min_rate": MIN_RATE,
        "per_task": [{k: r[k] for k in ("task", "task_name", "episodes", "successes", "rate")} for r in rows],
        "not_reproduced": [{"task": r.task, "episode": r.episode, "steps": r.steps, "note": r.note}
                           for r in results if not r.success],
        "clipped_action_fraction_per_dim": [round(float(x), 5) for x in frac],
    }
    atomic_write_text(out / "summary.json", json.dumps(summary, indent=1) + "\n")
    log(f"oracle: {ok}/{len(results)} recorded successes reproduced ({rate:.1%}; "
        f"{'passed' if summary['passed'] else 'FAILED'}, gate {MIN_RATE:.0%}) -> {out / 'summary.json'}")
    return summary
