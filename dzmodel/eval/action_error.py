"""Held-out action error: how well a converted model predicts the action chunks of episodes it never trained on.

    dz eval action-error runs/demo/converted --out runs/demo/eval/action_error

The held-out episodes are the run's own: the last `heldout_episodes` of each of its datasets, read from the
train config stored with the model (experiment_cfg/train_config.json), so training and this evaluation split
the same way. A window is an anchor frame of a held-out episode (every `stride` frames, with a whole chunk
ahead). The policy sees what it sees in a rollout, the anchor frame of each view, the state and the
instruction, and predicts one chunk through the real inference path (`EmbodiedPolicy.predict`: the run's
transforms, the solver settings given, a fixed seed). The error of a window is the mean over (chunk steps,
action dims) of (pred - target)^2 in the q99-normalised action space of the run's statistics; a model's
error is the mean over windows. Two references on the same windows:

* mean_predictor: a constant chunk, the mean normalised action of the training episodes' windows;
* untrained: the same architecture at the run's seeded initialisation (the trainer's step 0).

ratio = trained / mean_predictor: below 1 the model predicts more than the average action does.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..atomic import atomic_write_text
from ..data.dataset import heldout_split, key_vectors
from ..data.lerobot_format import open_dataset
from ..data.transforms import EmbodimentIO, NormStats


class ActionErrorError(ValueError):
    """A model or run whose held-out action error cannot be measured (the message names the file or field)."""


@dataclass
class Window:
    episode: int
    anchor: int
    views: dict[str, np.ndarray]   # short view name -> uint8 [H, W, 3] at the anchor frame
    state: np.ndarray              # raw state at the anchor [S]
    instruction: str
    target: np.ndarray             # normalised action chunk [horizon, A]
    dataset: str = ""              # the dataset the episode is in


def normalised_mse(pred: np.ndarray, target: np.ndarray) -> float:
    """Mean over (chunk steps, action dims) of the squared difference, both already q99-normalised."""
    pred, target = np.asarray(pred, dtype=np.float64), np.asarray(target, dtype=np.float64)
    if pred.shape != target.shape:
        raise ValueError(f"prediction {pred.shape} and target {target.shape} differ in shape")
    return float(np.mean((pred - target) ** 2))


def normalise_chunk(actions: np.ndarray, state: np.ndarray, stats: NormStats, pairs: list) -> np.ndarray:
    """A chunk in the robot's units [horizon, A] -> the model's normalised space (relative keys made relative)."""
    actions = np.asarray(actions, dtype=np.float64)
    io = EmbodimentIO(None, pairs, action_stats=stats, horizon=actions.shape[0])  # the training targets' steps
    return io.actions(actions, np.asarray(state, dtype=np.float64)[None])


def _anchors(length: int, horizon: int, stride: int) -> list[int]:
    return list(range(0, length - horizon + 1, stride))


def split_episodes(cfg, where: str, need_heldout: bool = True) -> list[tuple[str, list[int], list[int]]]:
    """(dataset, training episodes, held-out episodes) of a run's datasets, as its trainer split them."""
    if not cfg.heldout_episodes and need_heldout:
        raise ActionErrorError(f"{where}: train.heldout_episodes is 0, so every episode was trained on and there is "
                               "nothing held out to measure (set train.heldout_episodes >= 1 and retrain)")
    out = []
    for path in cfg.datasets:
        if not Path(path).exists():
            raise ActionErrorError(f"{where}: the run's dataset {path} is not there (a relative path is looked up "
                                   "from each folder above the model, then from the working directory)")
        episodes = [e.index for e in open_dataset(path).episodes]
        train, held = (heldout_split(episodes, cfg.heldout_episodes, f"train.heldout_episodes ({path})")
                       if cfg.heldout_episodes else (episodes, []))
        out.append((str(path), train, held))
    return out


def mean_action(cfg, emb, stats: NormStats, pairs: list, stride: int, where: str) -> np.ndarray:
    """The mean normalised action [A] over the training episodes' windows (the constant mean predictor)."""
    columns = sorted({k.column for k in emb.state + emb.action})
    total, count = 0.0, 0
    for path, train, _ in split_episodes(cfg, where):
        reader = open_dataset(path)
        lengths = {e.index: e.length for e in reader.episodes}
        for ep in train:
            cols = reader.read_columns(ep, columns)
            for t in _anchors(lengths[ep], emb.action_horizon, stride):
                rows = np.arange(t, t + emb.action_horizon)
                chunk = normalise_chunk(key_vectors(cols, emb.action, rows), key_vectors(cols, emb.state, np.array([t]))[0],
                                        stats, pairs)
                total = total + chunk.sum(axis=0)
                count += chunk.shape[0]
    if not count:
        raise ActionErrorError(f"{where}: no training episode is {emb.action_horizon} frames long")
    return np.asarray(total, dtype=np.float64) / count


def heldout_windows(cfg, emb, stats: NormStats, pairs: list, stride: int, max_windows: int | None,
                    where: str, video_backend: str = "auto", training: bool = False) -> list[Window]:
    """Every `stride`-th anchor of the held-out episodes (`training`: of the training episodes) with a whole chunk
    ahead, at most `max_windows` (then evenly spaced over them, so every episode still counts)."""
    columns = sorted({k.column for k in emb.state + emb.action})
    todo = []
    for path, train, held in split_episodes(cfg, where, need_heldout=not training):
        reader = open_dataset(path)
        lengths = {e.index: e.length for e in reader.episodes}
        todo += [(path, ep, t) for ep in (train if training else held)
                 for t in _anchors(lengths[ep], emb.action_horizon, stride)]
    if not todo:
        raise ActionErrorError(f"{where}: no {'training' if training else 'held-out'} episode is "
                               f"{emb.action_horizon} frames long")
    if max_windows is not None and len(todo) > max_windows:
        todo = [todo[i] for i in np.linspace(0, len(todo) - 1, max_windows).round().astype(int)]
    windows = []
    for path, ep in dict.fromkeys((p, e) for p, e, _ in todo):
        reader = open_dataset(path)
        anchors = [t for p, e, t in todo if (p, e) == (path, ep)]
        cols = reader.read_columns(ep, columns)
        tasks = reader.task_per_frame(ep)
        frames = {short: reader.read_frames(ep, key, anchors, backend=video_backend) for short, key in emb.views.items()}
        for i, t in enumerate(anchors):
            state = key_vectors(cols, emb.state, np.array([t]))[0]
            target = normalise_chunk(key_vectors(cols, emb.action, np.arange(t, t + emb.action_horizon)), state, stats,
                                     pairs)
            windows.append(Window(ep, t, {s: np.asarray(f[i]) for s, f in frames.items()}, state, tasks[t], target,
                                  str(path)))
    return windows


def predict_errors(policy, windows: list[Window], progress=None, stats: NormStats | None = None,
                   pairs: list | None = None) -> np.ndarray:
    """Per-window normalised MSE of the policy's chunks (one fresh session per window, as a rollout's start).
    stats, pairs: the statistics the windows' targets were normalised with, when not the policy's own."""
    errors = []
    stats = policy.policy.action_stats if stats is None else stats
    pairs = policy.relative_pairs if pairs is None else pairs
    for i, w in enumerate(windows):
        session = f"action-error-{i}"
        chunk = policy.predict(session, w.views, w.state, w.instruction)
        policy.end_session(session)
        pred = normalise_chunk(chunk, w.state, stats, pairs)
        errors.append(normalised_mse(pred, w.target))
        if progress is not None:
            progress.update()
    return np.asarray(errors)


def untrained_policy(trained, cfg):
    """The same policy with the model at the trainer's step 0: the run's seed, and its init_dit if any."""
    from ..train.trainer import initial_model

    ref = trained.policy.model.patch_embedding.weight
    if cfg.init_dit and not Path(cfg.init_dit).exists():
        raise ActionErrorError(f"train.init_dit: {cfg.init_dit} is not there; the untrained reference starts from it")
    model = initial_model(cfg, ref.device).to(device=ref.device, dtype=ref.dtype).eval()  # as the trainer built it
    policy = dataclasses.replace(trained.policy, model=model, sessions={})
    return dataclasses.replace(trained, policy=policy, step=0)


def _summary(errors: np.ndarray) -> float:
    return round(float(errors.mean()), 6)


def evaluate_action_error(run_or_model: str | Path, out_dir: str | Path | None = None, steps: list[int] | None = None,
                          stride: int = 4, max_windows: int | None = None, device: str = "cpu", solver=None,
                          seed: int = 0, untrained: bool = True, progress: bool = True) -> dict:
    """The held-out action error of every converted step of a run (or `steps`, or one converted model), with
    the mean-predictor and untrained references. Writes action_error.json and action_error.csv under
    `out_dir` when given; returns {"steps": [{step, trained, ratio}], "mean_predictor", "untrained", "last": ...}."""
    from ..train.metrics import Progress
    from .libero_eval import _models_to_evaluate
    from ..policy.policy import load_policy, read_train_config

    if stride < 1:
        raise ActionErrorError(f"stride: must be >= 1, got {stride}")
    if max_windows is not None and max_windows < 1:
        raise ActionErrorError(f"max_windows: must be >= 1, got {max_windows}")
    src = Path(run_or_model)
    out = Path(out_dir) if out_dir is not None else None
    models = _models_to_evaluate(src, out if out is not None else src.parent / f"{src.name}.action_error", steps)
    first_cfg, _ = read_train_config(models[0][1])
    policy = load_policy(models[0][1], device=device, solver=solver, seed=seed)
    emb, stats, pairs = policy.embodiment, policy.policy.action_stats, policy.relative_pairs
    where = str(models[0][1] / "experiment_cfg" / "train_config.json")
    windows = heldout_windows(first_cfg, emb, stats, pairs, stride, max_windows, where)
    mean = mean_action(first_cfg, emb, stats, pairs, stride, where)
    mean_errors = np.asarray([normalised_mse(np.broadcast_to(mean, w.target.shape), w.target) for w in windows])
    bar = Progress(len(windows) * (len(models) + int(untrained)), enabled=progress, desc="action error", unit="chunk")
    rows = []
    untrained_errors = None
    if untrained:
        untrained_errors = predict_errors(untrained_policy(policy, first_cfg), windows, bar)
    for i, (step, model_dir) in enumerate(models):
        cfg, _ = read_train_config(model_dir)
        if (cfg.datasets, cfg.heldout_episodes) != (first_cfg.datasets, first_cfg.heldout_episodes):
            raise ActionErrorError(f"{model_dir}: trained on another split than {models[0][1]}; evaluate them apart")
        if i:
            policy = load_policy(model_dir, device=device, solver=solver, seed=seed)
        errors = predict_errors(policy, windows, bar)
        rows.append({"step": step, "trained": _summary(errors),
                     "ratio": round(_summary(errors) / max(_summary(mean_errors), 1e-12), 6)})
    bar.close()
    result = {
        "windows": len(windows), "episodes": sorted({w.episode for w in windows}), "stride": stride,
        "heldout_episodes": first_cfg.heldout_episodes, "seed": seed,
        "solver": dataclasses.asdict(solver) if solver is not None else None,
        "mean_predictor": _summary(mean_errors),
        "untrained": _summary(untrained_errors) if untrained_errors is not None else None,
        "steps": rows,
    }
    last = rows[-1]
    result["last"] = {"step": last["step"], "trained": last["trained"], "ratio": last["ratio"]}
    if out is not None:
        write_action_error(out, result)
    return result


def compare_action_error(candidate: str | Path, other: str | Path, stride: int = 4, max_windows: int | None = None,
                         device: str = "cpu", solver=None, seed: int = 0, progress: bool = False) -> dict:
    """Two converted models (e.g. a candidate and the model in production) on the same windows: the candidate's
    held-out episodes, targets and both models' chunks normalised with the candidate's statistics, the same solver
    and seed. Returns {"windows", "episodes", "candidate", "other"} (mean normalised MSE each). Models of another
    embodiment or action width cannot be compared: ActionErrorError says why."""
    from ..train.metrics import Progress
    from ..policy.policy import load_policy, read_train_config

    first = load_policy(candidate, device=device, solver=solver, seed=seed)
    second = load_policy(other, device=device, solver=solver, seed=seed)
    if (first.embodiment.tag, first.action_dim, first.action_horizon) != (
            second.embodiment.tag, second.action_dim, second.action_horizon):
        raise ActionErrorError(
            f"{other}: embodiment {second.embodiment.tag!r} ({second.action_horizon} x {second.action_dim} actions) "
            f"is not the candidate's {first.embodiment.tag!r} ({first.action_horizon} x {first.action_dim}); "
            "their action errors are not comparable")
    cfg, _ = read_train_config(Path(candidate))
    stats, pairs = first.policy.action_stats, first.relative_pairs
    where = str(Path(candidate) / "experiment_cfg" / "train_config.json")
    windows = heldout_windows(cfg, first.embodiment, stats, pairs, stride, max_windows, where)
    bar = Progress(2 * len(windows), enabled=progress, desc="action error, head to head", unit="chunk")
    errors = [_summary(predict_errors(p, windows, bar, stats, pairs)) for p in (first, second)]
    bar.close()
    return {"windows": len(windows), "episodes": sorted({w.episode for w in windows}), "stride": stride,
            "seed": seed, "candidate": errors[0], "other": errors[1]}


def write_action_error(out: Path, result: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "action_error.json", json.dumps(result, indent=1) + "\n")
    lines = ["step,trained,mean_predictor,untrained,ratio"]
    for r in result["steps"]:
        u = "" if result["untrained"] is None else result["untrained"]
        lines.append(f"{r['step']},{r['trained']},{result['mean_predictor']},{u},{r['ratio']}")
    atomic_write_text(out / "action_error.csv", "\n".join(lines) + "\n")


def describe(result: dict) -> str:
    """One line, e.g. 'held-out action error 0.12 (mean predictor 0.41, untrained 1.3), ratio 0.29 at step 30'."""
    last = result["last"]
    untrained = "" if result.get("untrained") is None else f", untrained {_g(result['untrained'])}"
    return (f"held-out action error {_g(last['trained'])} (mean predictor {_g(result['mean_predictor'])}{untrained}), "
            f"ratio {_g(last['ratio'])} at step {last['step']}")


def _g(x: float) -> str:
    return f"{x:.2g}" if math.isfinite(x) and abs(x) < 10 else f"{x:.3g}"


def plot_action_error(result: dict, path: str | Path) -> Path | None:
    """The held-out action error of each converted step, against the two references a learning run must beat:
    the mean predictor and the untrained model. PNG (saying why, when it was not measured); None without
    matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    from ..atomic import save_figure

    fig, ax = plt.subplots(figsize=(7, 4))
    if not result.get("measured", True) or not result.get("steps"):
        ax.axis("off")
        ax.text(0.5, 0.5, f"held-out action error not measured:\n{result.get('reason', 'no converted step')}",
                ha="center", va="center", wrap=True)
        path = save_figure(fig, Path(path))
        plt.close(fig)
        return path
    rows = sorted((r for r in result["steps"] if r["step"] is not None), key=lambda r: r["step"])
    ax.plot([r["step"] for r in rows], [r["trained"] for r in rows], marker="o", linewidth=2, label="trained")
    ax.axhline(result["mean_predictor"], color="tab:red", linestyle="--", label="mean predictor")
    if result.get("untrained") is not None:
        ax.axhline(result["untrained"], color="gray", linestyle=":", label="untrained")
    ax.set_xlabel("training step"), ax.set_ylabel("action error (normalised units)")
    ax.set_title(f"held-out action error, {result['windows']} windows (lower is better)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3), ax.legend()
    path = save_figure(fig, Path(path))
    plt.close(fig)
    return path
