"""The cache stage: the frozen encoders' outputs over the training windows."""

from __future__ import annotations

from pathlib import Path

from ..atomic import atomic_write_text
from ..config import Profile, StagePaths, train_config
from .common import Log, cuda_available, fresh_dir, print_line, require_vision


def stage_cache(prof: Profile, paths: StagePaths, log: Log = print_line) -> dict:
    out = paths.stage("cache")
    if not prof.cache.enabled:
        fresh_dir(out)
        atomic_write_text(out / "DISABLED", "cache.enabled is false: train encodes each batch online\n")
        log("cache: disabled (cache.enabled: false)")
        return {"cache": None}
    from ..train.cache import build_cache

    from ..model.args import OFFLINE_PRESETS
    from ..model.tokenizer import build_tiny_tokenizer

    require_vision(prof, paths, "cache")
    cfg = train_config(prof, paths)  # offline presets: tokenizer = runs/<profile>/tokenizer, built here
    cfg.cache = None
    if not cfg.tokenizer:
        raise ValueError(f"profiles.{paths.profile}.train.tokenizer: the cache needs the tokenizer directory")
    if cfg.preset in OFFLINE_PRESETS and Path(cfg.tokenizer) == paths.tokenizer:
        build_tiny_tokenizer(paths.tokenizer)  # deterministic bytes: rebuilding changes nothing
    build_cache(cfg, out, stride=prof.cache.stride, batch_size=prof.cache.batch_size,
                device="cuda" if cuda_available() else "cpu", command="pipeline")
    log(f"cache: wrote {out}")
    return {"cache": str(out)}

