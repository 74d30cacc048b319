"""The fetch stage: a dataset from the hub, a local path, the synthetic generator or LIBERO recording."""

from __future__ import annotations

from ..config import Profile, StagePaths
from .common import Log, print_line


def stage_fetch(prof: Profile, paths: StagePaths, log: Log = print_line) -> dict:
    from ..data.fetch import fetch_dataset
    from ..data.lerobot_format import open_dataset
    from ..eval.libero_record import record_into

    f = prof.fetch
    synth = ({"num_episodes": f.synth_episodes, "episode_length": f.synth_length, "seed": f.seed}
             if f.source == "synthetic" else None)
    if synth is not None and f.synth_motion != "walk":  # absent by default: existing fetch markers stay valid
        synth["motion"] = f.synth_motion
    if synth is not None and f.synth_embodiment != "libero_sim":  # likewise
        synth["embodiment"] = f.synth_embodiment
    source = (str(paths.root / f.source) if f.source not in ("synthetic", "libero") and (paths.root / f.source).exists()
              else f.source)
    log(f"fetch: {source} -> {paths.dataset}")
    # the fields at their defaults that change nothing are left out: the fetch markers of earlier recordings stay valid
    record = dict(f.record.recorder_options(), seed=f.seed) if f.source == "libero" else None
    dest = fetch_dataset(source, paths.data, revision=f.revision, allow_patterns=f.allow or None,
                         synth_kwargs=synth, name="dataset", record_kwargs=record, retries=f.retries,
                         retry_delay_s=f.retry_delay_s, skip_missing=f.skip_missing, recorder=record_into)
    reader = open_dataset(dest)
    frames = sum(e.length for e in reader.episodes)
    log(f"fetch: {len(reader.episodes)} episodes, {frames} frames at {reader.fps:g} fps, views {reader.video_keys}")
    return {"dataset": str(dest), "episodes": len(reader.episodes), "frames": frames, "fps": reader.fps,
            "views": list(reader.video_keys)}

