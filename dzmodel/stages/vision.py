"""The vision stage: the offline presets' VAE pretrained on the dataset's frames."""

from __future__ import annotations

from ..atomic import atomic_write_text
from ..config import Profile, StagePaths, train_config
from .common import Log, fresh_dir, print_line, stage_output, write_json


def stage_vision(prof: Profile, paths: StagePaths, log: Log = print_line) -> dict:
    """The offline presets' VAE pretrained on the dataset's frames (dzmodel/train/vision.py): cache and train load
    it through train.encoder_weights.vae (`train_config`). Disabled: an empty marker, and they keep their VAE."""
    out, v = paths.stage("vision"), prof.vision
    metrics_file = paths.metrics("vision")
    if not v.enabled:
        fresh_dir(out)
        atomic_write_text(out / "DISABLED", "vision.enabled is false: cache and train use the preset's seeded random "
                                            "VAE, or train.encoder_weights.vae\n")
        write_json(metrics_file, {"pretrained": False})
        log("vision: disabled (vision.enabled: false)")
        return {"vision": None}
    from ..train.vision import VAE_FILE, pretrain_vae

    assert paths.vision_vae.name == VAE_FILE
    with stage_output(out) as tmp:
        report = pretrain_vae(train_config(prof, paths, vision_vae=False), tmp, steps=v.steps, batch_size=v.batch_size,
                              lr=v.lr, clip_frames=v.clip_frames, kl_weight=v.kl_weight,
                              heldout_episodes=v.heldout_episodes, device=v.device, num_workers=v.num_workers,
                              frame_cache_mib=v.frame_cache_mib, data_on_device=v.data_on_device,
                              cuda_graphs=v.cuda_graphs, log=log)
    headline = {k: report[k] for k in ("steps", "heldout_mse", "heldout_mse_random", "heldout_mse_ratio",
                                       "heldout_mse_mean_colour", "seconds")}
    write_json(metrics_file, {"pretrained": True, **headline})
    return {"vision": str(out), "vae": str(paths.vision_vae), **headline}

