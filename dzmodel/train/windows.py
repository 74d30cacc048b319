"""The trainer's view of its datasets, shared with the cache and vision stages: a dataset's training windows
(without its held-out episodes, every file verified first), and the offline presets sized to the embodiment."""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path

from ..data.check import verify_files
from ..data.dataset import WindowDataset, heldout_split, load_statistics
from ..data.embodiments import get_embodiment, load_embodiments
from ..data.lerobot_format import open_dataset
from ..data.sampling import WindowSpec
from ..data.transforms import embodiment_stats
from ..model.args import OFFLINE_PRESETS, preset
from .config import TrainConfig


def training_windows(path, emb, spec: WindowSpec, stats: dict, cfg: TrainConfig, train: bool = True) -> WindowDataset:
    """A dataset's windows without its held-out episodes (`heldout_episodes`): training never samples them.
    Every data and video file of a local dataset is verified first (footers, containers, LFS pointers): a corrupt
    file stops the run here with one error, not mid-run or never. An s3:// dataset is not downloaded whole for
    that: its files arrive as training reads them (`dz data check URI` verifies them all)."""
    reader = open_dataset(path)
    if reader.remote is None:  # a remote dataset's files come one by one, size-checked (`dz data check` reads all)
        verify_files(reader)
    episodes = None
    if cfg.heldout_episodes:
        episodes, _ = heldout_split([e.index for e in reader.episodes], cfg.heldout_episodes,
                                    f"train.heldout_episodes ({path})")
    ds = WindowDataset(reader, emb, spec, stats, train=train and cfg.augment, seed=cfg.seed, episodes=episodes,
                       skip_missing=cfg.skip_missing,
                       frame_cache_mib=0 if cfg.data_on_device else cfg.frame_cache_mib)
    if ds.missing and int(os.environ.get("RANK", "0")) == 0:
        eps = sorted({ep for ep, _ in ds.missing})
        print(f"{path}: skip_missing: {len(ds.missing)} video files missing; skipping episodes {eps}", file=sys.stderr)
    return ds


def size_to_embodiment(cfg: TrainConfig) -> TrainConfig:
    """The small offline presets (tiny, small) train from scratch: their state and action widths follow the
    embodiment (from its metadata) when it needs more than the preset has, unless model_overrides sets them. The
    result goes into the saved config, so convert and serve build the same model."""
    if cfg.preset not in OFFLINE_PRESETS or not cfg.metadata or not Path(cfg.metadata).is_file():
        return cfg
    args = preset(cfg.preset, **cfg.model_overrides)
    known = load_embodiments(cfg.embodiment_files)
    tags = list(dict.fromkeys([cfg.embodiment, *cfg.dataset_embodiments]))  # a mixture: the widest of its robots
    widths = {"state": 0, "action": 0}
    for tag in tags:
        emb = get_embodiment(tag, known)
        state_stats, action_stats = embodiment_stats(load_statistics(cfg.metadata, emb.tag), emb, cfg.metadata)
        widths = {"state": max(widths["state"], len(state_stats.q01)),
                  "action": max(widths["action"], len(action_stats.q01))}
    sized = {}
    for field_name, group in (("max_state_dim", "state"), ("action_dim", "action")):
        if field_name not in cfg.model_overrides and widths[group] > getattr(args, field_name):
            sized[field_name] = widths[group]
    if not sized:
        return cfg
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"preset {cfg.preset!r} sized to embodiment {', '.join(tags)}: {sized} (model_overrides)",
              file=sys.stderr)
    return replace(cfg, model_overrides={**cfg.model_overrides, **sized})
