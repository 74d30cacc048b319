"""`dz eval probe`: how much of the scene a VAE's latents hold, measured by linear probes on held-out episodes.

    dz eval probe DATASET --embodiment libero_sim_small --vae random --vae runs/libero_scripted/vision/vae.safetensors \
        --out runs/libero_scripted/probe

Features, per frame: the frame as the model sees it (the embodiment's views, centre crop, resize and layout; no
jitter), encoded alone as a one-frame video (the VAE encodes frame 0 on its own, so no other frame leaks in); the
normalised latent [z, h, w] average-pooled to at most a 4 x 8 grid (where things are survives, and the side-by-side
views stay apart; a full mean over space would keep only colour) and flattened.

Probe: ridge regression on standardised features, its penalty picked by cross-validation over the fit episodes
(folds by episode). Fit on the first episodes, scored on the last `heldout_episodes`: the split is by episode, so
no frame of a scored episode, nor its neighbours, is fitted.

Targets: `eef_pos` = observation.state[0:3] for LIBERO embodiments (eef position in the recorder's and the public
datasets' 8-dim state; the block's x, y and size in the generated data), `gripper` = observation.state[6:8], and
`objects` = the `observation.objects` column (privileged object positions) when the dataset has it; other
embodiments: each state key. `--target NAME=COLUMN[A:B]` names others.

Numbers, per target, on the held-out frames, each dimension first scaled by its spread on the fit frames (so all
count alike; dims constant on the fit frames are left out): r2 = 1 - sum SSE / sum SST pooled over the dimensions
(1: exact; 0: no better than the held-out frames' own mean; < 0: worse); nrmse = sqrt(sum SSE / sum SST), the
error in units of the target's held-out spread; constant_r2 = the r2 of predicting every held-out frame by the fit
frames' mean, the reference a probe must beat; r2_per_dim.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..atomic import atomic_write_text
from ..data.dataset import heldout_split
from ..data.embodiments import Embodiment
from ..data.errors import DataError
from ..data.transforms import compose_layout, transform_view

POOL_GRID = (4, 8)  # at most this latent grid per frame (rows, columns) after average pooling
ALPHAS = (1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0)  # ridge penalties, per fit frame on standardised features
OBJECTS_COLUMN = "observation.objects"


class ProbeError(ValueError):
    """Bad probe input (a target, a VAE source, a split); the message names it."""


@dataclass(frozen=True)
class ProbeTarget:
    name: str
    column: str
    start: int | None = None
    end: int | None = None

    def describe(self) -> str:
        if self.start is None and self.end is None:
            return self.column
        return f"{self.column}[{self.start or 0}:{'' if self.end is None else self.end}]"


_TARGET = re.compile(r"^(?P<name>[A-Za-z_][\w.-]*)=(?P<column>[^\[\]]+)(\[(?P<start>\d*):(?P<end>\d*)\])?$")


def parse_target(text: str) -> ProbeTarget:
    """NAME=COLUMN or NAME=COLUMN[A:B] (a slice of the column's flattened values)."""
    m = _TARGET.match(text.strip())
    if not m:
        raise ProbeError(f"--target {text!r}: expected NAME=COLUMN or NAME=COLUMN[A:B], "
                         "e.g. eef_pos=observation.state[0:3]")
    num = lambda s: int(s) if s else None  # noqa: E731
    return ProbeTarget(m["name"], m["column"], num(m["start"]), num(m["end"]))


def default_targets(emb: Embodiment, features: dict) -> tuple[list[ProbeTarget], list[str]]:
    """(targets, notes): the LIBERO state's eef position and gripper, or each state key; plus object positions
    when the dataset records them."""
    notes = []
    state_cols = {k.column for k in emb.state}
    if emb.tag.startswith("libero") and state_cols == {"observation.state"}:
        targets = [ProbeTarget("eef_pos", "observation.state", 0, 3), ProbeTarget("gripper", "observation.state", 6, 8)]
    else:
        targets = [ProbeTarget(k.name, k.column, k.start, k.end) for k in emb.state]
    if OBJECTS_COLUMN in features:
        targets.append(ProbeTarget("objects", OBJECTS_COLUMN))
    else:
        notes.append(f"objects: skipped, the dataset has no {OBJECTS_COLUMN!r} column")
    return targets, notes


# --- features --------------------------------------------------------------------------------------------------

def layout_frames(reader, emb: Embodiment, episode: int, rows: list[int], backend: str = "auto") -> torch.Tensor:
    """uint8 [N, H, W, 3]: frames `rows` of an episode, every view centre-cropped, resized and laid out."""
    rng = np.random.default_rng(0)  # unused: no random crop or jitter in eval mode
    views = {short: transform_view(reader.read_frames(episode, key, rows, backend=backend), emb.view_size, False, rng,
                                   emb.crop_scale, None)
             for short, key in emb.views.items()}
    return compose_layout(emb, views)


@torch.no_grad()
def frame_features(vae, frames: torch.Tensor, device: torch.device | str = "cpu", batch_size: int = 32) -> np.ndarray:
    """uint8 frames [N, H, W, 3] -> float64 [N, z x gh x gw]: each frame encoded alone, pooled to POOL_GRID."""
    from ..model.conditioning import video_to_unit_range

    dtype = next(vae.parameters()).dtype
    out = []
    for start in range(0, len(frames), batch_size):
        video = video_to_unit_range(frames[start:start + batch_size, None]).to(device, dtype)  # [B, 3, 1, H, W]
        latent = vae.encode(video)[:, :, 0].float()                                             # [B, z, h, w]
        grid = (min(POOL_GRID[0], latent.shape[-2]), min(POOL_GRID[1], latent.shape[-1]))
        out.append(F.adaptive_avg_pool2d(latent, grid).flatten(1).cpu().double().numpy())
    return np.concatenate(out)


def read_targets(reader, targets: list[ProbeTarget], episode: int, rows: np.ndarray,
                 notes: list[str]) -> dict[str, np.ndarray]:
    """Each target's values [len(rows), dims] (float64); a target whose column is missing or unreadable is dropped
    from `targets` with a note."""
    out = {}
    for t in list(targets):
        if t.column not in reader.features:
            notes.append(f"{t.name}: skipped, the dataset has no column {t.column!r}")
            targets.remove(t)
            continue
        try:
            col = reader.read_columns(episode, [t.column])[t.column]
        except DataError as exc:
            notes.append(f"{t.name}: skipped ({exc})")
            targets.remove(t)
            continue
        col = np.asarray(col, dtype=np.float64).reshape(len(col), -1)
        values = col[rows, t.start:t.end]
        if values.shape[1] == 0:
            raise ProbeError(f"target {t.name}: {t.describe()} selects no values of {t.column!r} "
                             f"(it has {col.shape[1]})")
        out[t.name] = values
    return out


# --- the probe --------------------------------------------------------------------------------------------------

def _ridge(x: np.ndarray, y: np.ndarray, alpha: float) -> np.ndarray:
    """Weights [d, k] for centred x [n, d], y [n, k]: (x'x + alpha n I)^-1 x'y."""
    n, d = x.shape
    return np.linalg.solve(x.T @ x + alpha * n * np.eye(d), x.T @ y)


def fit_probe(x: np.ndarray, y: np.ndarray, groups: np.ndarray) -> dict:
    """A ridge probe: feature standardisation and target mean from x, y; the penalty by cross-validation over the
    groups (episodes), scored on targets standardised so every dimension counts alike."""
    mean, std = x.mean(0), x.std(0)
    std[std < 1e-8] = 1.0
    xs = (x - mean) / std
    y_mean, y_std = y.mean(0), y.std(0)
    y_std[y_std < 1e-12] = 1.0
    ys = (y - y_mean) / y_std
    uniq = np.unique(groups)
    alpha, cv = 1.0, None
    if len(uniq) >= 2:
        folds = np.array_split(uniq, min(5, len(uniq)))
        errors = []
        for a in ALPHAS:
            sse = 0.0
            for fold in folds:
                test = np.isin(groups, fold)
                xm, ym = xs[~test].mean(0), ys[~test].mean(0)
                w = _ridge(xs[~test] - xm, ys[~test] - ym, a)
                sse += float((((xs[test] - xm) @ w + ym - ys[test]) ** 2).sum())
            errors.append(sse)
        alpha = ALPHAS[int(np.argmin(errors))]
        cv = dict(zip(map(str, ALPHAS), errors))
    w = _ridge(xs, ys, alpha) * y_std
    return {"mean": mean, "std": std, "w": w, "b": y_mean, "alpha": alpha, "cv_sse": cv}


def predict(probe: dict, x: np.ndarray) -> np.ndarray:
    return (x - probe["mean"]) / probe["std"] @ probe["w"] + probe["b"]


def score(y: np.ndarray, pred: np.ndarray, fit: np.ndarray) -> dict:
    """On held-out y: r2 pooled over the dims, each scaled by its spread on the fit frames `fit` (so every dim
    counts alike and one that barely moves in the held-out episodes cannot dominate); per-dim r2; nrmse; and the
    constant predictor's (the fit frames' mean) pooled r2."""
    scale = fit.std(0)
    live = scale > 1e-9 * max(1.0, float(np.abs(fit).max()))
    if not live.any():
        return {"r2": None, "nrmse": None, "constant_r2": None, "r2_per_dim": [], "dims": int(y.shape[1]),
                "dims_scored": 0}
    ys, ps, ms = (a[:, live] / scale[live] for a in (y, pred, fit.mean(0, keepdims=True)))
    sst = ((ys - ys.mean(0)) ** 2).sum(0)
    sse = ((ys - ps) ** 2).sum(0)
    sse_const = ((ys - ms) ** 2).sum(0)
    per_dim = [float(1 - e / t) if t > 0 else None for e, t in zip(sse, sst)]
    return {"r2": float(1 - sse.sum() / sst.sum()), "nrmse": float(np.sqrt(sse.sum() / sst.sum())),
            "constant_r2": float(1 - sse_const.sum() / sst.sum()), "r2_per_dim": per_dim,
            "dims": int(y.shape[1]), "dims_scored": int(live.sum())}


def probe_dataset(reader, emb: Embodiment, vaes: dict[str, torch.nn.Module], targets: list[ProbeTarget] | None = None,
                  heldout_episodes: int | None = None, stride: int = 2, device: str | torch.device = "cpu",
                  progress: bool = True) -> dict:
    """Fit and score a probe per (VAE, target). `vaes`: name -> VAE module (eval mode, on `device`)."""
    started = time.time()
    notes: list[str] = []
    if targets is None:
        targets, notes = default_targets(emb, reader.features)
    else:
        targets = list(targets)
    if stride < 1:
        raise ProbeError(f"--stride must be >= 1, got {stride}")
    episodes = [e.index for e in reader.episodes]
    if heldout_episodes is None:
        heldout_episodes = max(1, round(0.2 * len(episodes)))
    fit_eps, held_eps = heldout_split(episodes, heldout_episodes, "--heldout-episodes")
    from ..progress import Progress

    bar = Progress(len(episodes), enabled=progress, desc="probe", unit="episode")
    feats: dict[str, list[np.ndarray]] = {name: [] for name in vaes}
    values: dict[str, list[np.ndarray]] = {}
    groups = []
    for ep in episodes:
        rows = np.arange(0, reader.episode(ep).length, stride)
        ys = read_targets(reader, targets, ep, rows, notes)
        frames = layout_frames(reader, emb, ep, rows.tolist())
        for name, vae in vaes.items():
            feats[name].append(frame_features(vae, frames, device))
        for t, v in ys.items():
            values.setdefault(t, []).append(v)
        groups.append(np.full(len(rows), ep))
        bar.update()
    bar.close()
    groups_all = np.concatenate(groups)
    held = np.isin(groups_all, held_eps)
    results: dict[str, dict] = {}
    for name in vaes:
        x = np.concatenate(feats[name])
        results[name] = {}
        for t in targets:
            y = np.concatenate([v for v in values[t.name]])
            probe = fit_probe(x[~held], y[~held], groups_all[~held])
            results[name][t.name] = {**score(y[held], predict(probe, x[held]), y[~held]),
                                     "alpha": probe["alpha"], "features": int(x.shape[1])}
    return {"targets": {t.name: t.describe() for t in targets}, "fit_episodes": fit_eps, "heldout_episodes": held_eps,
            "fit_frames": int((~held).sum()), "heldout_frames": int(held.sum()), "stride": stride,
            "features": f"per frame: the VAE latent mean, average-pooled to at most {POOL_GRID[0]}x{POOL_GRID[1]}, "
                        "flattened", "results": results, "notes": notes, "seconds": round(time.time() - started, 2)}


def describe(result: dict) -> list[str]:
    """One line per (VAE, target)."""
    lines = []
    fmt = lambda v: "  n/a " if v is None else f"{v:6.3f}"  # noqa: E731
    for name, per_target in result["results"].items():
        for target, r in per_target.items():
            lines.append(f"{name:<28} {target:<10} r2 {fmt(r['r2'])}  nrmse {fmt(r['nrmse'])}  "
                         f"constant r2 {fmt(r['constant_r2'])}  ({r['dims_scored']}/{r['dims']} dims, "
                         f"{result['heldout_frames']} held-out frames)")
    return lines + [f"note: {n}" for n in result["notes"]]


# --- the VAEs ---------------------------------------------------------------------------------------------------

def load_probe_vae(spec: str, preset_name: str | None, seed: int = 0, device: str | torch.device = "cpu"):
    """(name, VAE, preset) for one --vae SPEC: 'random' (the preset's seeded random VAE, as a run with train.seed
    `seed` builds it), a VAE safetensors file (e.g. the vision stage's vae.safetensors), or a converted model or
    bundle model directory (the VAE it runs with)."""
    from safetensors import safe_open

    from ..model.components import build_encoders, load_encoder_weights
    from ..train.config import TrainConfig
    from ..train.encoders import frozen_encoders

    path = Path(spec)
    if spec == "random":
        if not preset_name:
            raise ProbeError("--vae random needs --preset (the preset whose seeded random VAE to probe)")
        vae = frozen_encoders(TrainConfig(preset=preset_name, seed=seed), "cpu").vae
        return f"random({preset_name}, seed {seed})", vae.to(device).eval(), preset_name
    if path.is_dir():
        if (path / "encoders" / "vae.safetensors").is_file():  # a bundle's model/
            return load_probe_vae(str(path / "encoders" / "vae.safetensors"), preset_name, seed, device)
        if (path / "config.json").is_file():
            from ..policy.policy import read_train_config

            cfg, _ = read_train_config(path)
            return f"{path.name} ({cfg.preset})", frozen_encoders(cfg, "cpu").vae.to(device).eval(), cfg.preset
        raise ProbeError(f"--vae {spec}: a directory, but neither a converted model (config.json) nor a bundle model "
                         "(encoders/vae.safetensors)")
    if not path.is_file():
        raise FileNotFoundError(f"--vae {spec}: no such file (give 'random', a VAE .safetensors or a model directory)")
    recorded = None
    if path.suffix == ".safetensors":
        with safe_open(str(path), "pt") as f:
            recorded = (f.metadata() or {}).get("preset")
    name = preset_name or recorded
    if not name:
        raise ProbeError(f"--vae {spec}: the file does not record its preset; give --preset")
    if recorded and preset_name and recorded != preset_name:
        raise ProbeError(f"--vae {spec}: a {recorded!r} VAE, not a {preset_name!r} one (--preset)")
    enc = build_encoders(name, device="meta")
    load_encoder_weights(enc, vae=path)
    return str(path), enc.vae.to(device).eval(), name


def run_probe(dataset: str | Path, emb: Embodiment, vae_specs: list[str], out_dir: str | Path,
              preset_name: str | None = None, seed: int = 0, targets: list[ProbeTarget] | None = None,
              heldout_episodes: int | None = None, stride: int = 2, device: str = "cpu", progress: bool = True) -> dict:
    """`dz eval probe`: <out_dir>/probe.json (the result) and probe.txt (its table)."""
    from ..data.lerobot_format import open_dataset

    reader = open_dataset(dataset)
    vaes, presets = {}, set()
    for spec in vae_specs or ["random"]:
        name, vae, p = load_probe_vae(spec, preset_name, seed, device)
        vaes[name] = vae.requires_grad_(False)
        presets.add(p)
    result = probe_dataset(reader, emb, vaes, targets, heldout_episodes, stride, device, progress)
    result.update(dataset=str(dataset), embodiment=emb.tag, vaes=list(vaes), presets=sorted(presets))
    out = Path(out_dir)
    atomic_write_text(out / "probe.json", json.dumps(result, indent=1) + "\n")
    atomic_write_text(out / "probe.txt", "\n".join(describe(result)) + "\n")
    return result
