"""`dz bench data --trainer-loader`: samples/s of `dz train`'s own data loader at the 5B DROID shape, from video.

A DROID-shaped LeRobot dataset (three cameras at DROID's 180x320, 15 fps; camera-like frames: a 1/f texture seen
by a slowly panning camera, a moving block, sensor noise, so the codec has realistic residual to decode) is written
once to the work directory. The dataset is then built as `Trainer.build_data` builds it (`training_windows`,
`MixtureDataset`, `SampleStream`, the `Collator`) for the `dreamzero_5b` preset and the `oxe_droid` embodiment,
augmentation on, and read through the trainer's DataLoader settings with each number of workers (one core each).
The 5B's umT5 tokenizer is not needed to measure this: the collator uses the project's tiny one at the 5B's text
length (ids only). With `video_decode="nvdec"` the workers only name each window's frames and the main process
decodes them on the GPU (`train.video_decode: nvdec`, dzmodel/data/nvdec.py). Synthetic video is likely cheaper
to decode than real footage: a lower bound on the cost.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import torch

from ..data.embodiments import DROID_EMBODIMENTS

DROID_H, DROID_W, DROID_FPS = 180, 320, 15


def _texture(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """A 1/f ("natural image") texture, zero mean, unit deviation."""
    f = np.fft.rfft2(rng.standard_normal((h, w)))
    f /= np.maximum(np.hypot(np.fft.fftfreq(h)[:, None], np.fft.rfftfreq(w)[None, :]), 1.0 / max(h, w)) ** 1.1
    img = np.fft.irfft2(f, s=(h, w))
    return (img - img.mean()) / img.std()


def _camera(rng: np.random.Generator, frames: int) -> np.ndarray:
    """uint8 [T, 180, 320, 3]: the texture through a slowly panning camera, a moving dark block, noise."""
    tint = rng.uniform(0.5, 1.0, 3)
    big = _texture(rng, DROID_H + 120, DROID_W + 160)
    colour = np.stack([big * (0.8 + 0.2 * c) for c in tint], -1) * 40 + 120
    pan = np.clip(np.cumsum(rng.normal(0, 0.6, (frames, 2)), 0) + [60, 80], 0, [119, 159]).astype(int)
    block = np.cumsum(rng.normal(0, 2, (frames, 2)), 0) + [DROID_H / 2, DROID_W / 2]
    out = np.empty((frames, DROID_H, DROID_W, 3), np.uint8)
    for t in range(frames):
        y, x = pan[t]
        frame = colour[y:y + DROID_H, x:x + DROID_W].copy()
        by, bx = np.clip(block[t], 20, [DROID_H - 20, DROID_W - 20]).astype(int)
        frame[by - 15:by + 15, bx - 15:bx + 15] = [40, 40, 160]
        frame += rng.normal(0, 2.0, frame.shape)
        out[t] = np.clip(frame, 0, 255).astype(np.uint8)
    return out


def droid_dataset(out: str | Path, codec: str = "h264", gop: int = 2, episodes: int = 4, length: int = 300,
                  seed: int = 0, embodiment: str = DROID_EMBODIMENTS[0]) -> Path:
    """A DROID-shaped LeRobot v3.0 dataset (written once: an existing one is reused) and its metadata for
    `embodiment` (`metadata_path`, beside it: metadata is never written into a dataset)."""
    from ..data import synth
    from ..data.dataset import embodiment_metadata
    from ..data.embodiments import get_embodiment
    from ..data.lerobot_writer import LeRobotV3Writer

    out = Path(out)
    if not (out / "meta" / "info.json").is_file():
        rng = np.random.default_rng(seed)
        writer = LeRobotV3Writer(out, DROID_FPS, "synthetic_droid", {k: (DROID_H, DROID_W) for k in synth.DROID_VIEWS},
                                 synth._droid_features(), codec={"h264": "libx264", "av1": "libsvtav1"}[codec],
                                 crf=30, gop=gop)
        for ep in range(episodes):
            traj = synth._episode_trajectory(rng, length, 64)
            writer.add_episode(synth.TASKS[ep % len(synth.TASKS)], {k: _camera(rng, length) for k in synth.DROID_VIEWS},
                               synth._droid_vectors(traj, 64))
        writer.finish()
    if not metadata_path(out, embodiment).is_file():
        embodiment_metadata(out, get_embodiment(embodiment), metadata_path(out, embodiment))
    return out


def metadata_path(dataset: Path, embodiment: str = DROID_EMBODIMENTS[0]) -> Path:
    """<dataset>.metadata.json for oxe_droid, <dataset>.<embodiment>.metadata.json for another."""
    infix = "" if embodiment == DROID_EMBODIMENTS[0] else f".{embodiment}"
    return dataset.with_name(f"{dataset.name}{infix}.metadata.json")


def usable_cores() -> int:
    """The cores this process may run on (taskset's limit), not the machine's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def trainer_dataset(dataset: Path, micro_batch: int, workdir: Path, embodiment: str = DROID_EMBODIMENTS[0]):
    """(dataset, sampler, collate) as `Trainer.build_data` and `Trainer.loader` make them, for the 5B on DROID laid
    out by `embodiment`."""
    from ..data.collate import Collator
    from ..data.dataset import MixtureDataset, StreamSampler, load_statistics
    from ..data.embodiments import get_embodiment
    from ..data.sampling import SampleStream, WindowSpec
    from ..model.args import preset
    from ..model.tokenizer import build_tiny_tokenizer, load_tokenizer
    from ..train.config import TrainConfig
    from ..train.windows import training_windows

    cfg = TrainConfig(preset="dreamzero_5b", datasets=[str(dataset)], embodiment=embodiment,
                      metadata=str(metadata_path(dataset, embodiment)), micro_batch=micro_batch,
                      global_batch=micro_batch)
    a = preset(cfg.preset)
    emb = get_embodiment(cfg.embodiment)
    spec = WindowSpec(a.max_chunk_size, emb.action_horizon, 4 * a.num_frame_per_block, emb.sampling)
    windows = training_windows(str(dataset), emb, spec, load_statistics(cfg.metadata, emb.tag), cfg)
    stream = SampleStream([len(windows)], seed=cfg.seed)
    tok = workdir / "tokenizer"
    if not (tok / "tokenizer.json").is_file():
        build_tiny_tokenizer(tok)
    collate = Collator(load_tokenizer(tok), a.text_len, a.max_state_dim, a.action_dim)
    return MixtureDataset([windows], same_frame_size=True), StreamSampler(stream), collate


def loader_rate(dataset: Path, workers: int, batches: int, micro_batch: int, workdir: Path,
                video_decode: str = "cpu", device: str = "cuda", decode_threads: int = 8,
                embodiment: str = DROID_EMBODIMENTS[0]) -> dict:
    """samples/s of the trainer's DataLoader with `workers` workers (the first 2 batches, the workers' start, not
    timed), and the main process's CPU time per sample. video_decode "nvdec": the workers name the frames and the
    main process decodes and augments them on `device` (`train.video_decode: nvdec`; waited for before the clock
    stops), on `decode_threads` threads (`train.nvdec_threads`); its row counts the decoders opened and those of
    them whose NV12 frames were converted here (`nvdec.nv12_to_rgb`)."""
    from ..data.video import worker_init_fn

    ds, sampler, collate = trainer_dataset(dataset, micro_batch, workdir, embodiment)
    video = None
    if video_decode == "nvdec":
        from ..data.nvdec import VideoImages

        video = VideoImages.attach(ds.datasets, device, train=True, seed=0, threads=decode_threads)
    threads = torch.get_num_threads()
    if workers == 0:
        torch.set_num_threads(1)  # as one worker runs
    try:
        loader = torch.utils.data.DataLoader(ds, batch_size=micro_batch, sampler=sampler, collate_fn=collate,
                                             num_workers=workers, worker_init_fn=worker_init_fn if workers else None,
                                             persistent_workers=bool(workers))
        it = iter(loader) if video is None else map(video.fill, loader)
        for _ in range(2):
            next(it)
        cpu0, t0 = time.process_time(), time.perf_counter()
        for _ in range(batches):
            batch = next(it)
        if batch["images"].is_cuda:
            torch.cuda.synchronize(batch["images"].device)
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    finally:
        torch.set_num_threads(threads)
        if video is not None:
            video.decoder.close()
    n = batches * micro_batch
    nvdec = {} if video is None else {"decode_threads": decode_threads, "decoders": video.decoder.opened,
                                      "nv12_decoders": video.decoder.native_files}
    return {"workers": workers, "video_decode": video_decode, **nvdec,
            "samples": n, "samples_per_s": round(n / wall, 2),
            "main_cpu_ms_per_sample": round(1e3 * cpu / n, 1), "images": list(batch["images"].shape)}


def run_loader_bench(workdir: str | Path, codec: str = "h264", gop: int = 2, workers: tuple[int, ...] = (0, 2),
                     batches: int = 30, micro_batch: int = 2, episodes: int = 4, progress=None,
                     video_decode: str = "cpu", device: str = "cuda",
                     decode_threads: tuple[int, ...] = (8,), embodiment: str = DROID_EMBODIMENTS[0]) -> list[dict]:
    """A row per number of workers (and, for nvdec, per number of decoding threads)."""
    if embodiment not in DROID_EMBODIMENTS:
        raise ValueError(f"the loader bench lays out DROID's cameras: embodiment must be one of "
                         f"{', '.join(DROID_EMBODIMENTS)}, got {embodiment!r}")
    workdir = Path(workdir)
    dataset = droid_dataset(workdir / f"droid_{codec}_g{gop}", codec, gop, episodes, embodiment=embodiment)
    rows = []
    for threads in decode_threads if video_decode == "nvdec" else decode_threads[:1]:
        for w in workers:
            row = {"codec": codec, "gop": gop, "micro_batch": micro_batch, "embodiment": embodiment,
                   "cpu_count": usable_cores(),
                   "date": time.strftime("%Y-%m-%d"),
                   **loader_rate(dataset, w, batches, micro_batch, workdir, video_decode, device, threads,
                                 embodiment)}
            rows.append(row)
            if progress is not None:
                progress(row)
    return rows
