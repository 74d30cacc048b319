"""World-model previews: the video a converted model predicts, beside what the camera saw.

DreamZero denoises the future video with the actions. For a few held-out windows (the action error's: episodes the
run never trained on; a run that held none out, such as the closed-loop profile, shows training episodes and says
so in the titles), the policy sees the anchor frame, state and instruction, predicts one chunk, and its
predicted video latents are decoded by the VAE (`DreamZeroPolicy.predicted_frames`). Per converted step:

    <out>/step_XXXXXXX/ep<E>_t<T>.mp4   context | predicted | real via VAE | real, side by side, one frame per
                                         predicted frame
    <out>/step_XXXXXXX/grid.png          a still grid: per window the context, then predicted, real via VAE and
                                         real at a few times
    <out>/step_XXXXXXX/previews.json     latent errors per window and their means
The real frames are the episode's next frames, laid out as the model sees them (same views, size and crop).

Why "real via VAE": the small presets' VAE is seeded random, its decoder no inverse of its encoder, so even a
perfect prediction decodes to texture. Compare the predicted column with the real frames encoded and decoded by
the same VAE (`DreamZeroPolicy.compare_with_real`), not with the real one. The numbers to watch across checkpoints
are the latent errors: `latent_mse`, the predicted latents against the real frames', and `still_latent_mse`, the
same for a model that predicts nothing moves (the context latent repeated), which a useful model beats.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .action_error import Window, heldout_windows


def real_future(policy, window: Window, count: int, video_backend: str = "auto") -> np.ndarray:
    """The `count` frames after the anchor (fewer at the episode's end), laid out as the model sees them."""
    from ..data.lerobot_format import open_dataset

    reader = open_dataset(window.dataset)
    length = reader.episode(window.episode).length
    rows = list(range(window.anchor + 1, min(window.anchor + 1 + count, length)))
    if not rows:
        return np.zeros((0, *policy.frame(window.views).shape[1:]), dtype=np.uint8)
    views = {short: np.asarray(reader.read_frames(window.episode, key, rows, backend=video_backend))
             for short, key in policy.embodiment.views.items()}
    return policy.frame(views)


GAP = 4  # white columns between panels


def side_by_side(context: np.ndarray, *panels: np.ndarray) -> np.ndarray:
    """uint8 [T, H, (1 + P)·W + P·GAP, 3]: per t, the context frame then each panel's frame t. The first panel sets
    T, H and W: shorter panels are padded with black (an episode that ended), larger frames cropped to it (the
    VAE's output is cropped to whole patches)."""
    t, h, w, _ = panels[0].shape
    gap = np.full((t, h, GAP, 3), 255, dtype=np.uint8)
    columns = [np.broadcast_to(context[:h, :w], (t, h, w, 3))]
    for panel in panels:
        panel = panel[:t, :h, :w]
        columns += [gap, np.concatenate([panel, np.zeros((t - len(panel), h, w, 3), dtype=np.uint8)])]
    return np.concatenate(columns, axis=2)


def split_panels(strip: np.ndarray, count: int) -> list[np.ndarray]:
    """The `count` panels of a `side_by_side` strip, each [T, H, W, 3]."""
    w = (strip.shape[2] - (count - 1) * GAP) // count
    return [strip[:, :, k * (w + GAP):k * (w + GAP) + w] for k in range(count)]


def write_mp4(frames: np.ndarray, path: Path, fps: int = 8) -> Path:
    """uint8 [T, H, W, 3] -> an H.264 mp4 (cropped to even sizes), written atomically (`encode_video`)."""
    from ..data.video import encode_video

    h, w = frames.shape[1] - frames.shape[1] % 2, frames.shape[2] - frames.shape[2] % 2
    return encode_video(path, np.ascontiguousarray(frames[:, :h, :w]), fps, codec="libx264")


ROWS = ("predicted", "real via VAE", "real")  # the strips' panels after the context, a grid row each


RANDOM_VAE_NOTE = ("VAE: seeded random weights (no pretrained VAE, vision stage off): decoded frames look like noise "
                   "by construction, not from a fault")


def write_grid(windows: list[tuple[str, np.ndarray]], path: Path, columns: int = 4, note: str | None = None) -> Path:
    """A PNG: per window (title, strip), the context and `columns` frames of each panel in `ROWS`, one over the
    other at the same times; `note` goes above them all."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(ROWS)
    fig, axes = plt.subplots(n * len(windows), columns + 1, figsize=(2 * (columns + 1), 1.1 * n * len(windows)),
                             squeeze=False)
    for r, (title, strip) in enumerate(windows):
        context, *panels = split_panels(strip, 1 + n)
        picks = np.linspace(0, len(strip) - 1, columns).round().astype(int)
        for ax in axes[n * r:n * (r + 1)].flat:
            ax.axis("off")
        axes[n * r, 0].imshow(context[0])
        axes[n * r, 0].set_title(f"{title}\ncontext", fontsize=7)
        for row, (label, panel) in enumerate(zip(ROWS, panels)):
            for ax, i in zip(axes[n * r + row, 1:], picks):
                ax.imshow(panel[i])
                ax.set_title(f"{label} t+{i + 1}", fontsize=7)
    if note:
        fig.suptitle(note, fontsize=8, color="darkred", wrap=True)
    fig.tight_layout()
    from ..atomic import save_figure

    return save_figure(fig, path)


ERRORS = ("latent_mse", "still_latent_mse")  # per window (None when its episode ended too soon), and their means


def describe_errors(errors: dict) -> str:
    """'latent MSE 0.012 (still 0.034)', of a window or of a step's means; '' when unknown (the episode ended)."""
    if errors["latent_mse"] is None:
        return ""
    return f"latent MSE {errors['latent_mse']:.4g} (still {errors['still_latent_mse']:.4g})"


def _mean(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return float(np.mean(known)) if known else None


def write_previews(model_dir: str | Path, out_dir: str | Path, windows: int = 2, stride: int = 4,
                   device: str = "cpu", solver=None, seed: int = 0, policy=None) -> dict:
    """Previews of one converted model for `windows` held-out windows (evenly spread over the held-out episodes;
    over the training episodes when the run held none out), and their latent errors (None for a window whose
    episode ends before the predicted block does; the means are over the others)."""
    import json

    from ..atomic import atomic_write_text
    from ..policy.policy import load_policy, read_train_config

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
    rows, files, errors = [], [], []
    for i, w in enumerate(chosen):
        session = f"preview-{i}"
        policy.predict(session, w.views, w.state, w.instruction)
        predicted = policy.policy.predicted_frames(session)
        context, real = policy.frame(w.views)[-1:], real_future(policy, w, len(predicted))
        check = policy.policy.compare_with_real(session, np.concatenate([context, real]))
        policy.end_session(session)
        round_trip = check.round_trip if check is not None else real[:0]  # black: the episode ended too soon
        strip = side_by_side(context[0], predicted, round_trip, real)
        name = f"ep{w.episode}_t{w.anchor}"
        files.append(str(write_mp4(strip, out / f"{name}.mp4")))
        errors.append({"episode": int(w.episode), "anchor": int(w.anchor), **{k: getattr(check, k, None) for k in ERRORS}})
        seen = " (trained on)" if training else ""
        rows.append((f"episode {w.episode}{seen}, frame {w.anchor}\n{describe_errors(errors[-1])}".rstrip(), strip))
    random_vae = not (cfg.encoder_weights or {}).get("vae")  # the preset's seeded VAE: decodes are not images
    grid = write_grid(rows, out / "grid.png", note=RANDOM_VAE_NOTE if random_vae else None)
    means = {k: _mean([e[k] for e in errors]) for k in ERRORS}
    atomic_write_text(out / "previews.json", json.dumps({"step": step, "seen_in_training": training,
                                                         "random_vae": random_vae,
                                                         "windows": errors, **means}, indent=1))
    return {"step": step, "videos": files, "grid": str(grid), "windows": len(chosen), "seen_in_training": training,
            "random_vae": random_vae,
            "window_errors": errors, **means}
