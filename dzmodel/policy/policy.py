"""A converted DreamZero checkpoint as a robot policy: per-view camera frames + state -> an action chunk.

The embodiment's IO is the training pipeline in eval mode (`data.transforms.EmbodimentIO`, which the loaders
compose too): each view centre-cropped and resized to the embodiment's view size, the views laid out as in
training, the state q99-normalised, and after the model the actions un-normalised and made absolute again for
relative action keys; the prompt is built from the same template. Inference goes through the sessions'
API (`sessions.DreamZeroPolicy.predict_batch`, a KV cache per session).

Rooms: `dzmodel.policy` sits above `train` (a model directory carries its run's training config) and below
`eval` and `serve`, which both load a policy from here and import nothing from each other. The IO pipeline it
composes sits in the data layer, below the loaders that compose it as well.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..data.dataset import load_statistics
from ..data.remote import is_remote
from ..data.embodiments import Embodiment, get_embodiment, load_embodiments
from ..data.transforms import EmbodimentIO, NormStats, action_key_stats, embodiment_stats, relative_action_dims
from ..model.fp8 import freeze_blocks_to_fp8, resolve_precision
from ..model.sampler import SolverConfig
from ..model.state_dict import load_dreamzero_dir
from ..model.tokenizer import load_tokenizer
from ..train.config import TrainConfig, locate, located
from ..train.parallelize import DTYPES
from .sessions import DreamZeroPolicy, build_policy


class PolicyLoadError(RuntimeError):
    """A model directory that cannot serve as a policy for the requested embodiment."""


@dataclass
class EmbodiedPolicy:
    policy: DreamZeroPolicy
    embodiment: Embodiment
    relative_pairs: list
    step: int | None
    model_dir: Path
    state_dims: dict[str, int] = field(default_factory=dict)   # width of each state key, in embodiment order
    precision: str = "bf16"            # what the DiT blocks' linears run in: bf16 (or the weights' dtype) or fp8
    precision_note: str | None = None  # why fp8 was asked for and not used, for the caller to show

    @property
    def action_horizon(self) -> int:
        return self.embodiment.action_horizon

    @property
    def action_dim(self) -> int:
        return int(self.policy.action_stats.q01.shape[0])

    @property
    def frame_stride(self) -> int | None:
        """Control steps between the frames the model saw in training (its windows' frame spacing): an
        action chunk of H steps spans one block of 4·num_frame_per_block frames. None when H is not a multiple
        of that (the frames are then not evenly spaced, and each query sends only the current frame)."""
        per_block = self.policy.frames_per_block
        return self.action_horizon // per_block if self.action_horizon % per_block == 0 else None

    @property
    def io(self) -> EmbodimentIO:
        """The embodiment's input and output pipeline with this policy's statistics (the loaders' own)."""
        return EmbodimentIO(self.embodiment, self.relative_pairs, self.policy.state_stats, self.policy.action_stats)

    def frame(self, views: dict[str, np.ndarray]) -> np.ndarray:
        """Camera frames (uint8 [H, W, 3] or [T, H, W, 3] per view name) -> the model's laid-out frames."""
        frames = {}
        for name in self.embodiment.views:
            if name in views:
                x = np.asarray(views[name])
                frames[name] = np.ascontiguousarray(x[None] if x.ndim == 3 else x)
        return self.io.images(frames, train=False, rng=np.random.default_rng(0)).numpy()

    def predict(self, session_id: str, views: dict[str, np.ndarray], state: np.ndarray, instruction: str,
                reset: bool | None = None) -> np.ndarray:
        """One action chunk [action_horizon, action_dim] in the robot's units. `views` hold the current frame, or
        the frames since the last call ([T, H, W, 3] per view, `frame_stride` control steps apart, the newest
        last); `reset` starts the session (None: a single frame does, as upstream)."""
        return self.predict_batch([(session_id, views, state, instruction, reset)])[0]

    def predict_batch(self, requests: list[tuple]) -> list[np.ndarray]:
        """(session_id, views, state, instruction[, reset]) per robot -> one chunk each, in one batched forward."""
        states = [np.asarray(r[2], dtype=np.float64).reshape(-1) for r in requests]
        obs = []
        for (sid, views, _, instruction, *reset), state in zip(requests, states):
            o = {"images": self.frame(views), "state": state, "prompt": self.embodiment.prompt(instruction),
                 "session_id": sid}
            if reset and reset[0] is not None:
                o["reset"] = bool(reset[0])
            obs.append(o)
        # the sessions normalise the state and un-normalise the actions with the pipeline's statistics (`io.state`,
        # `action_stats.unnormalize`); the last output step here
        io = self.io
        return [io.absolute(a[: self.action_horizon], state) for a, state in zip(self.policy.predict_batch(obs), states)]

    def end_session(self, session_id: str) -> None:
        self.policy.sessions.pop(session_id, None)


def read_train_config(model_dir: Path) -> tuple[TrainConfig, int | None]:
    path = model_dir / "experiment_cfg" / "train_config.json"
    if not path.is_file():
        raise PolicyLoadError(f"{model_dir}: no experiment_cfg/train_config.json (convert it with `dz convert`)")
    raw = json.loads(path.read_text())
    step = raw.pop("step", None)
    raw.pop("weights", None)  # raw or ema: which weights dz convert exported
    return located(TrainConfig.from_dict(raw), model_search_dirs(model_dir)), step


def model_search_dirs(model_dir: Path) -> list[Path]:
    """Where a converted model's relative paths (datasets, encoder weights, ...) are looked up. A DVC or Prefect
    stage records them relative to the project, so first each folder above the model, nearest first (the project
    that made it, whatever the working directory); a path found in none of them stays as given (relative to the
    working directory, or for the error to name)."""
    model = Path(os.path.abspath(model_dir))  # the path as the user sees it, not a link's target
    return list(model.parents)


def locate_dataset(path: str, model_dir: Path) -> str:
    """A run's dataset as its config names it, looked up as `model_search_dirs` says (a URI as it is)."""
    return path if is_remote(path) else locate(path, model_search_dirs(model_dir))


def model_embodiment(model_dir: Path, cfg: TrainConfig, embodiment_files: list[str] | None = None) -> Embodiment:
    """The embodiment a converted model trained on: built in, or from the YAML copies `dz convert` stored
    in experiment_cfg/embodiments/ (or `embodiment_files`)."""
    if embodiment_files is None:
        embodiment_files = sorted(str(p) for p in (model_dir / "experiment_cfg" / "embodiments").glob("*.yaml"))
    return get_embodiment(cfg.embodiment, load_embodiments(embodiment_files))


def policy_statistics(emb: Embodiment, metadata: Path) -> tuple[NormStats, NormStats, list, dict[str, int]]:
    """The state and action q99 statistics a policy normalises with, its relative-action dims and the width of
    each state key, from a run's metadata.json (the eval oracle uses the same ones)."""
    stats = load_statistics(metadata, emb.tag)
    state_stats, action_stats = embodiment_stats(stats, emb, str(metadata))
    state_dims = {k.name: len(stats["state"][k.name]["q01"]) for k in emb.state}
    action_dims = {name: len(p.q01) for name, p in action_key_stats(stats, emb, str(metadata)).items()}
    pairs = relative_action_dims(emb, state_dims, action_dims) if emb.relative_action_keys else []
    return state_stats, action_stats, pairs, state_dims


def load_policy(model_dir: str | Path, device: torch.device | str = "cpu", embodiment: str | None = None,
                embodiment_files: list[str] | None = None, solver: SolverConfig | None = None,
                seed: int = 0, weights_dtype: torch.dtype | None = None, precision: str = "bf16",
                self_contained: bool = False) -> EmbodiedPolicy:
    """A converted model directory (`dz convert`, or a bundle's model/) -> an EmbodiedPolicy.

    embodiment: the embodiment the caller evaluates or deploys; it must be the one the run trained on.
    weights_dtype: default bf16 on CUDA (inference reads bf16 weights, no autocast), the saved dtype elsewhere.
    precision: "fp8" rounds the DiT blocks' linear weights to e4m3 once and runs their matmuls in FP8
    (`model.fp8.freeze_blocks_to_fp8`) where the device can; elsewhere it stays as it was and `precision_note`
    says why.
    self_contained: read nothing outside model_dir (a bundle's verified copy, `dz serve`): its encoders must be
    in model_dir/encoders, or be the preset's seeded ones, never files the run's config names elsewhere."""
    from ..train.encoders import frozen_encoders, load_saved_encoders

    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise PolicyLoadError(f"{model_dir}: not a converted model directory (no config.json); "
                              "run `dz convert RUN --out DIR` first")
    cfg, step = read_train_config(model_dir)
    if embodiment is not None and embodiment != cfg.embodiment:
        raise PolicyLoadError(f"{model_dir}: trained for embodiment {cfg.embodiment!r}, not {embodiment!r}")
    emb = model_embodiment(model_dir, cfg, embodiment_files)
    state_stats, action_stats, pairs, state_dims = policy_statistics(emb, model_dir / "experiment_cfg" / "metadata.json")

    model = load_dreamzero_dir(model_dir, device)
    if model.args.num_action_per_block != emb.action_horizon:
        raise PolicyLoadError(f"{model_dir}: " + emb.horizon_mismatch(model.args.num_action_per_block, "the model",
                                                                      trained=True))
    saved = model_dir / "encoders"
    outside = sorted(k for k, v in cfg.encoder_weights.items() if v)
    if self_contained and outside and not saved.is_dir():
        raise PolicyLoadError(f"{model_dir}: no encoders/, and the run's {', '.join(outside)} weights are files "
                              "outside the bundle, which are not verified; package it again with `dz package` "
                              "(which carries them in model/encoders/)")
    encoders = load_saved_encoders(cfg.preset, saved, device) if saved.is_dir() else frozen_encoders(cfg, device)
    tok_dir = model_dir / "tokenizer"
    if not (tok_dir / "tokenizer.json").is_file():
        raise PolicyLoadError(f"{model_dir}: no tokenizer/ (re-run `dz convert`, which copies the run's tokenizer)")
    if weights_dtype is None and torch.device(device).type == "cuda":
        weights_dtype = torch.bfloat16
    policy = build_policy(model, encoders, load_tokenizer(tok_dir), action_stats, state_stats,
                          solver=solver, seed=seed, image_size=emb.image_size, weights_dtype=weights_dtype)
    if precision not in ("bf16", "fp8"):
        raise ValueError(f"precision must be bf16 or fp8, got {precision!r}")
    # without FP8 the blocks run the weights' dtype: bf16 on CUDA, the saved one elsewhere (fp32 for an fp32 run),
    # named as train.precision names it
    weights = next(policy.model.parameters()).dtype
    served = {dtype: name for name, dtype in DTYPES.items() if name != "fp8"}.get(weights, str(weights))
    effective, note = resolve_precision(precision, device, fallback=served)
    if effective == "fp8":
        freeze_blocks_to_fp8(policy.model)
    return EmbodiedPolicy(policy=policy, embodiment=emb, relative_pairs=pairs, step=step, model_dir=model_dir,
                          state_dims=state_dims, precision=effective if effective == "fp8" else served,
                          precision_note=note)
