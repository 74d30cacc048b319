"""The convert stage: every complete DCP checkpoint of the run to an HF-style model directory."""

from __future__ import annotations

from ..config import Profile, StagePaths
from .common import Log, print_line, stage_output


def stage_convert(prof: Profile, paths: StagePaths, log: Log = print_line) -> dict:
    from ..train.checkpoint import list_checkpoints
    from ..train.convert import convert_checkpoint
    from ..train.metrics import Progress

    saved = list_checkpoints(paths.stage("train"))
    if not saved:
        raise FileNotFoundError(f"{paths.stage('train')}: no complete checkpoint to convert (run the train stage)")
    out = paths.stage("converted")
    with stage_output(out) as tmp:
        progress = Progress(len(saved), desc="convert", unit="ckpt")
        for step, ckpt in saved:
            convert_checkpoint(ckpt, tmp / f"step_{step:07d}", max_shard_bytes=int(prof.convert.max_shard_gib * 2**30),
                               weights=prof.convert.weights)
            progress.update()
        progress.close()
    log(f"convert: {len(saved)} checkpoints -> {out}")
    return {"converted": str(out), "steps": [s for s, _ in saved]}

