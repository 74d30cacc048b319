"""Data-path benchmark: video decode for one DROID-like sample, and DataLoader throughput.

The source is generated locally (nothing downloaded): ``views`` mp4 files of ``height`` x ``width``
at ``fps`` (DROID: 3 views, 480x640, 15 fps), ``num_frames`` long, in H.264 (libx264, veryfast,
crf 23) and AV1 (libsvtav1, preset 12, crf 30, as lerobot's writer), each at GOP 2 (lerobot's
writer) and GOP 30. The picture is a moving pattern with moving blocks and a little noise, so the
codec has realistic work to do.

One *sample* is DROID's ``multi_anchor`` read: 33 frames per view at offsets 0, 3, ..., 96 from a
random anchor, for every view.

(a) decode: ms per sample, median over ``decode_samples`` samples, through the library's own backends
    (``dzmodel.data.video.decode_frames``), all returning RGB uint8 frames:
    * torchcodec, batched: one ``get_frames_at`` call per view, with a fresh decoder, and with the
      per-thread cached decoder the readers use ("tc cached");
    * PyAV, seek-per-frame: seek to the keyframe before each timestamp, decode forward to it.
    Goal: torchcodec >= 3x faster.
(b) loader: samples/s of a ``torch.utils.data.DataLoader`` whose item is one sample through the real
    loader path (batched torchcodec decode, the ``oxe_droid`` train transforms and layout to 352x640),
    for 1, 2, 4 workers (``worker_init_fn``: one compute thread each). Goal: >= 1.5 x 15 = 22.5
    samples/s per GPU. Throughput scales with CPU cores per GPU; ``cpu_count`` is in the result.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from ..data.video import worker_init_fn

OFFSETS = tuple(range(0, 97, 3))  # DROID multi_anchor: 33 frames, 0..96 step 3
OUT_HW = (352, 640)
GOAL_DECODE_RATIO = 3.0
GOAL_SAMPLES_PER_S = 1.5 * 15


# ---------------------------------------------------------------------------------------------
# source videos


def _source_frames(view: int, num_frames: int, height: int, width: int, seed: int):
    """Yield RGB uint8 frames [H, W, 3]: a drifting pattern, moving blocks, mild noise."""
    rng = np.random.default_rng(seed * 100 + view)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    base = rng.uniform(60, 190, size=3).astype(np.float32)
    blocks = [
        (rng.uniform(0, width), rng.uniform(0, height), rng.uniform(-6, 6), rng.uniform(-4, 4),
         int(rng.uniform(30, 90)), rng.uniform(0, 255, size=3))
        for _ in range(4)
    ]
    for t in range(num_frames):
        phase = 0.15 * t + view
        pat = 0.5 + 0.25 * np.sin(xx / 37.0 + phase) + 0.25 * np.cos(yy / 23.0 - 0.7 * phase)
        img = base[None, None, :] * (0.6 + 0.8 * pat[..., None])
        for x0, y0, vx, vy, s, col in blocks:
            cx = int((x0 + vx * t) % (width - s))
            cy = int((y0 + vy * t) % (height - s))
            img[cy : cy + s, cx : cx + s] = col
        img += rng.normal(0, 3.0, size=(height, width, 1)).astype(np.float32)
        yield np.clip(img, 0, 255).astype(np.uint8)


def make_source_videos(
    workdir: str | os.PathLike,
    views: int = 3,
    num_frames: int = 120,
    height: int = 480,
    width: int = 640,
    fps: int = 15,
    codec: str = "libx264",
    gop: int = 2,
    seed: int = 0,
) -> list[Path]:
    """Encode ``views`` mp4 files under ``workdir`` (reused if already there with the same settings)."""
    from ..data.video import encode_video

    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    paths = []
    for v in range(views):
        path = workdir / f"view{v}_{width}x{height}_{fps}fps_{num_frames}f_{codec}_g{gop}_s{seed}.mp4"
        paths.append(path)
        if path.exists():
            continue
        frames = np.stack(list(_source_frames(v, num_frames, height, width, seed)))
        # x264 keeps its default B-frames here (encode_video turns them off): camera files have them
        encode_video(path, frames, fps, codec, crf=23 if codec == "libx264" else 30, gop=gop,
                     preset="veryfast" if codec == "libx264" else 12,
                     options={"bf": "3"} if codec == "libx264" else None)
    return paths


# ---------------------------------------------------------------------------------------------
# decoders


def sample_timestamps(anchor: int, fps: int) -> list[float]:
    return [(anchor + o) / fps for o in OFFSETS]


def _time_ms(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000.0


# ---------------------------------------------------------------------------------------------
# loader


class DroidLikeSamples(torch.utils.data.Dataset):
    """Item i: a random anchor (seeded by i), 33 frames of every view through the real loader path:
    batched torchcodec decode (dzmodel.data.video), then the oxe_droid embodiment's train transforms
    (random crop 0.95, uint8 antialiased resize to 176x320, colour jitter) and its layout
    (wrist stretched over the top row, the two exteriors below) -> [33, 352, 640, 3]."""

    def __init__(self, paths: list[Path], num_frames: int, fps: int, length: int, seed: int = 0):
        from ..data.embodiments import load_embodiments

        self.paths = [str(p) for p in paths]
        self.num_frames, self.fps, self.length, self.seed = num_frames, fps, length, seed
        self.emb = load_embodiments()["oxe_droid"]

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> torch.Tensor:
        from ..data.transforms import compose_layout, transform_view
        from ..data.video import decode_frames

        emb = self.emb
        rng = np.random.default_rng((self.seed, i))
        anchor = int(rng.integers(0, self.num_frames - OFFSETS[-1]))
        ts = sample_timestamps(anchor, self.fps)
        views = {}
        for k, name in enumerate(emb.views):  # fewer source files than views: reuse them in turn
            p = self.paths[k % len(self.paths)]
            frames = decode_frames(p, ts, backend="torchcodec")
            views[name] = transform_view(frames, emb.view_size, True, rng, emb.crop_scale, emb.color_jitter)
        return compose_layout(emb, views)


def loader_throughput(paths, num_frames, fps, workers: int, samples: int, seed: int = 0) -> float:
    """Samples/s over ``samples`` items after one warm-up batch per worker (batch_size=1)."""
    warm = workers if workers > 0 else 1
    ds = DroidLikeSamples(paths, num_frames, fps, length=samples + warm, seed=seed)
    dl = torch.utils.data.DataLoader(
        ds, batch_size=1, num_workers=workers, worker_init_fn=worker_init_fn if workers else None,
        persistent_workers=False, prefetch_factor=2 if workers else None,
    )
    it = iter(dl)
    for _ in range(warm):
        x = next(it)
    t0 = time.perf_counter()
    n = 0
    for x in it:
        assert tuple(x.shape[-3:-1]) == OUT_HW
        n += 1
    return n / (time.perf_counter() - t0)


# ---------------------------------------------------------------------------------------------
# entry point


def bench_decode(paths: list[Path], num_frames: int, fps: int, samples: int, seed: int = 0) -> dict:
    """(a): ms per sample (all views), median over ``samples`` random anchors, single-threaded, through the
    library's own backends (`dzmodel.data.video.decode_frames`): torchcodec batched, with a fresh decoder
    ("torchcodec") or the reader's cached one ("tc cached"), against PyAV seek-per-frame."""
    from ..data.video import clear_decoder_cache, decode_frames

    def torchcodec(p, ts):
        return decode_frames(p, ts, backend="torchcodec")

    def pyav(p, ts):
        return decode_frames(p, ts, backend="pyav")

    def fresh(p, ts):
        clear_decoder_cache()
        return torchcodec(p, ts)

    prev_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rng = np.random.default_rng(seed)
        anchors = rng.integers(0, num_frames - OFFSETS[-1], size=samples + 1)
        tc_ms, av_ms, tc_cached_ms = [], [], []
        max_diff = 0
        for j, a in enumerate(anchors):
            ts = sample_timestamps(int(a), fps)
            if j == 0:  # warm-up (library load, caches) and a check that both return the same frames
                for p in paths:
                    a_tc = torchcodec(p, ts).astype(np.int32)
                    max_diff = max(max_diff, int(np.abs(a_tc - pyav(p, ts).astype(np.int32)).max()))
                continue
            tc_ms.append(_time_ms(lambda: [fresh(p, ts) for p in paths]))
            av_ms.append(_time_ms(lambda: [pyav(p, ts) for p in paths]))
            tc_cached_ms.append(_time_ms(lambda: [torchcodec(p, ts) for p in paths]))
    finally:
        torch.set_num_threads(prev_threads)
    tc_med, av_med = statistics.median(tc_ms), statistics.median(av_ms)
    return {
        "torchcodec_batched_ms_per_sample": round(tc_med, 1),
        "torchcodec_batched_decoder_cached_ms_per_sample": round(statistics.median(tc_cached_ms), 1),
        "pyav_seek_per_frame_ms_per_sample": round(av_med, 1),
        "speedup_torchcodec_vs_pyav": round(av_med / tc_med, 2),
        "max_abs_pixel_diff_torchcodec_vs_pyav": max_diff,
        "samples": samples,
    }


CODEC_NAMES = {"libx264": "h264", "libsvtav1": "av1"}


def run_data_bench(
    workdir: str | os.PathLike,
    *,
    views: int = 3,
    num_frames: int = 120,
    height: int = 480,
    width: int = 640,
    fps: int = 15,
    codecs: tuple[str, ...] = ("libx264", "libsvtav1"),
    gops: tuple[int, ...] = (2, 30),
    decode_samples: int = 5,
    workers: tuple[int, ...] = (1, 2, 4),
    loader_samples: int = 16,
    seed: int = 0,
    verbose: bool = True,
) -> dict:
    """Run the data benchmark; return the numbers (and print a table when ``verbose``).

    For every codec in ``codecs`` (libx264 = H.264, libsvtav1 = AV1) and GOP size in ``gops``
    (2 = lerobot's writer, every other frame a keyframe; 30 = a 2 s GOP as cameras / plain ffmpeg
    write) the decode comparison (a) runs; the loader (b) runs per codec on the first GOP.
    Source videos are cached in ``workdir`` (delete it to re-encode).

    Result: ``{"source": {...}, "decode": {"h264_g2": {...}, ...}, "loader": {"samples_per_s":
    {"h264": {"1": x, "2": y, "4": z}, ...}, ...}, "cpu_count": n, "total_s": t}``.
    """
    if num_frames <= OFFSETS[-1]:
        raise ValueError(f"num_frames: must be > {OFFSETS[-1]} for the 0..96 offsets, got {num_frames}")
    if not gops or not codecs:
        raise ValueError("gops / codecs: at least one each")
    for c in codecs:
        if c not in CODEC_NAMES:
            raise ValueError(f"codecs: {c!r} not supported; use {sorted(CODEC_NAMES)}")
    t_start = time.perf_counter()
    result: dict = {
        "source": {"views": views, "frames": num_frames, "height": height, "width": width, "fps": fps,
                   "codecs": [CODEC_NAMES[c] for c in codecs], "gops": list(gops)},
        "frames_per_view": len(OFFSETS),
        "decode": {},
        "loader": {"samples_per_s": {}, "goal_samples_per_s_per_gpu": GOAL_SAMPLES_PER_S, "gop": gops[0]},
        "goal_decode_speedup": GOAL_DECODE_RATIO,
        "cpu_count": os.cpu_count(),
    }
    for codec in codecs:
        name = CODEC_NAMES[codec]
        for gop in gops:
            t0 = time.perf_counter()
            paths = make_source_videos(workdir, views, num_frames, height, width, fps, codec, gop, seed)
            encode_s = time.perf_counter() - t0
            d = bench_decode(paths, num_frames, fps, decode_samples, seed)
            d["encode_s"] = round(encode_s, 2)  # 0 when the cached source was reused
            d["bytes_per_view"] = int(statistics.mean(p.stat().st_size for p in paths))
            result["decode"][f"{name}_g{gop}"] = d
        paths = make_source_videos(workdir, views, num_frames, height, width, fps, codec, gops[0], seed)
        result["loader"]["samples_per_s"][name] = {
            str(w): round(loader_throughput(paths, num_frames, fps, w, loader_samples, seed), 2) for w in workers
        }
    lo = result["loader"]
    lo["best_samples_per_s"] = {c: max(v.values()) for c, v in lo["samples_per_s"].items()}
    # one worker per core at best: the cores a GPU would need at the 1-worker rate
    lo["cores_per_gpu_for_goal_at_1_worker_rate"] = {
        c: math.ceil(GOAL_SAMPLES_PER_S / v["1"]) for c, v in lo["samples_per_s"].items() if v.get("1")
    }
    result["total_s"] = round(time.perf_counter() - t_start, 1)
    if verbose:
        print(format_table(result))
    return result


def format_table(r: dict) -> str:
    s, lo = r["source"], r["loader"]
    rows = [
        f"source: {s['views']} views x {s['frames']} frames {s['width']}x{s['height']} @ {s['fps']} fps",
        f"one sample = {s['views']} views x {r['frames_per_view']} frames (offsets 0..96 step 3); {r['cpu_count']} CPUs",
        "",
        f"{'decode, ms/sample (1 thread)':32s} {'torchcodec':>10s} {'tc cached':>10s} {'PyAV seek':>10s} {'speed-up':>9s}",
    ]
    for name, d in r["decode"].items():
        codec, gop = name.split("_g")
        label = f"  {codec} GOP {gop} ({d['bytes_per_view'] / 1e6:.2f} MB/view)"
        rows.append(
            f"{label:32s} {d['torchcodec_batched_ms_per_sample']:10.1f} "
            f"{d['torchcodec_batched_decoder_cached_ms_per_sample']:10.1f} "
            f"{d['pyav_seek_per_frame_ms_per_sample']:10.1f} {d['speedup_torchcodec_vs_pyav']:8.2f}x"
        )
    rows.append(f"  goal: torchcodec >= {r['goal_decode_speedup']:.0f}x PyAV")
    workers = sorted({w for v in lo["samples_per_s"].values() for w in v}, key=int)
    rows += ["", f"loader, GOP {lo['gop']}, samples/s (torchcodec decode + oxe_droid train transforms + layout to 352x640)",
             f"{'  workers':12s}" + "".join(f"{w:>8s}" for w in workers)]
    for c, v in lo["samples_per_s"].items():
        rows.append(f"{'  ' + c:12s}" + "".join(f"{v.get(w, float('nan')):8.2f}" for w in workers))
    rows.append(f"  goal per GPU: {lo['goal_samples_per_s_per_gpu']:.1f} samples/s; at the 1-worker rate that is about "
                + ", ".join(f"{n} cores ({c})" for c, n in lo["cores_per_gpu_for_goal_at_1_worker_rate"].items()))
    rows.append(f"total {r['total_s']} s")
    return "\n".join(rows)


if __name__ == "__main__":  # python -m dzmodel.bench.data_bench [workdir]
    import json
    import sys

    out = run_data_bench(sys.argv[1] if len(sys.argv) > 1 else "/tmp/dz_data_bench")
    print(json.dumps(out, indent=2))
