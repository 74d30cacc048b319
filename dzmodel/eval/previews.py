"""World-model previews: the video a converted model predicts, beside what the camera saw.

DreamZero denoises the future video with the actions. For a few held-out windows (the action error's: episodes the
run never trained on; a run that held none out, such as the closed-loop profile, shows training episodes and says
so in the titles), the policy sees the anchor frame, state and instruction, predicts one chunk, and its
predicted video latents are decoded by the VAE (`DreamZeroPolicy.predicted_frames`). Per converted step:

    <out>/step_XXXXXXX/ep<E>_t<T>.mp4   context | predicted | real, side by side, one frame per predicted frame
    <out>/step_XXXXXXX/grid.png          a still grid: a row per window (context, then predicted over real at a
                                         few times)
The real frames are the episode's next frames, laid out as the model sees them (same views, size and crop).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .action_error import Window, heldout_windows


def real_future(policy, window: Window, count: int, video_backend: str = "auto") -> np.ndarray:
    """The `count` frames after the anchor (fewer at the episode's end), laid out as the model sees them."""
    from ..data.lerobot_format import open_dataset

    reader = open_dataset(window.dataset)
    length = next(e.length for e in reader.episodes if e.index == window.episode)
    rows = list(range(window.anchor + 1, min(window.anchor + 1 + count, length)))
    if not rows:
        return np.zeros((0, *policy.frame(window.views).shape[1:]), dtype=np.uint8)
    views = {short: np.asarray(reader.read_frames(window.episode, key, rows, backend=video_backend))
             for short, key in policy.embodiment.views.items()}
    return policy.frame(views)


def side_by_side(context: np.ndarray, predicted: np.ndarray, real: np.ndarray) -> np.ndarray:
    """uint8 [T, H, 3W + 2·gap, 3]: the context frame, the predicted frame t and the real frame t (black when the
    episode ended) per t."""
    t, h, w, _ = predicted.shape
    gap = np.full((t, h, 4, 3), 255, dtype=np.uint8)
    real = np.concatenate([real[:t], np.zeros((max(0, t - len(real)), h, w, 3), dtype=np.uint8)])
    if real.shape[1:3] != (h, w):  # the VAE's output is cropped to whole patches: match it
        real = real[:, :h, :w]
    return np.concatenate([np.broadcast_to(context, (t, h, w, 3)), gap, predicted, gap, real], axis=2)


def write_mp4(frames: np.ndarray, path: Path, fps: int = 8) -> Path:
    """uint8 [T, H, W, 3] -> an H.264 mp4 (cropped to even sizes), written atomically (`encode_video`)."""
    from ..data.video import encode_video

    h, w = frames.shape[1] - frames.shape[1] % 2, frames.shape[2] - frames.shape[2] % 2
    return encode_video(path, np.ascontiguousarray(frames[:, :h, :w]), fps, codec="libx264")


def write_grid(rows: list[tuple[str, np.ndarray]], path: Path, columns: int = 4) -> Path:
    """A PNG: per window, the context and `columns` predicted frames over the real ones at the same times."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2 * len(rows), columns + 1, figsize=(2 * (columns + 1), 2.2 * len(rows)), squeeze=False)
    for r, (title, strip) in enumerate(rows):
        t, h, w3, _ = strip.shape
        w = (w3 - 8) // 3
        context, predicted, real = strip[0, :, :w], strip[:, :, w + 4:2 * w + 4], strip[:, :, 2 * w + 8:]
        picks = np.linspace(0, t - 1, columns).round().astype(int)
        for k, (ax_p, ax_r) in enumerate(zip(axes[2 * r], axes[2 * r + 1])):
            for ax in (ax_p, ax_r):
                ax.axis("off")
            if k == 0:
                ax_p.imshow(context)
                ax_p.set_title(f"{title}\ncontext", fontsize=7)
                continue
            i = picks[k - 1]
            ax_p.imshow(predicted[i])
            ax_p.set_title(f"predicted t+{i + 1}", fontsize=7)
            ax_r.imshow(real[i])
            ax_r.set_title(f"real t+{i + 1}", fontsize=7)
    fig.tight_layout()
    from ..pipeline import _save

    return _save(fig, path)


def write_previews(model_dir: str | Path, out_dir: str | Path, windows: int = 2, stride: int = 4,
                   device: str = "cpu", solver=None, seed: int = 0, policy=None) -> dict:
    """Previews of one converted model for `windows` held-out windows (evenly spread over the held-out episodes;
    over the training episodes when the run held none out)."""
    from .policy import load_policy, read_train_config

    model_dir, out = Path(model_dir), Path(out_dir)
    cfg, step = read_train_config(model_dir)
    if policy is None:
        policy = load_policy(model_dir, device=device, solver=solver, seed=seed)
    policy.policy.keep_video = True
    emb, stats = policy.embodiment, policy.policy.action_stats
    where = str(model_dir / "experiment_cfg" / "train_config.json")
    training = not cfg.heldout_episodes
    chosen = heldout_windows(cfg, emb, stats, policy.relative_pairs, stride, windows, where, training=training)
    out.mkdir(parents=True, exist_ok=True)
    rows, files = [], []
    for i, w in enumerate(chosen):
        session = f"preview-{i}"
        policy.predict(session, w.views, w.state, w.instruction)
        predicted = policy.policy.predicted_frames(session)
        policy.end_session(session)
        real = real_future(policy, w, len(predicted))
        strip = side_by_side(policy.frame(w.views)[-1][: predicted.shape[1], : predicted.shape[2]], predicted, real)
        name = f"ep{w.episode}_t{w.anchor}"
        files.append(str(write_mp4(strip, out / f"{name}.mp4")))
        seen = " (trained on)" if training else ""
        rows.append((f"episode {w.episode}{seen}, frame {w.anchor}", strip))
    grid = write_grid(rows, out / "grid.png")
    return {"step": step, "videos": files, "grid": str(grid), "windows": len(chosen), "seen_in_training": training}
