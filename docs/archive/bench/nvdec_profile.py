"""Where the NVDEC loader's time goes at the 5B DROID shape (GPU machine; needs PyNvVideoCodec).

For the DROID-shaped recording of `dz bench data --trainer-loader` (written there: the GPU image cannot encode),
micro-batches of `--micro-batch` samples at `--embodiment`:

* host: the DataLoader's own work per micro-batch (windows, vectors, collate; frames only named);
* each variant's images against the library's RGB on the legacy default stream (the decoder before), one batch;
* for each variant and number of decoding threads: `VideoImages.fill`'s rate, split into the decoder calls
  (summed over threads), the rest of the lanes' reads (copies out of the decoder's buffers, the NV12 conversion),
  and the augmentation and layout;
* the decoder's ceiling: every frame of each file decoded in order, on several decoders side by side.

Variants: `stream=own` (each decoding thread's decoders and copies on its own CUDA stream, as the library does) or
`stream=legacy` (the legacy default stream); `native=1` (NV12 out of NVDEC, converted by `nvdec.nv12_to_rgb`
where the file's colour allows it, as the library does) or `native=0` (the library's RGB conversion).

    PYTHONPATH=$PWD python docs/archive/bench/nvdec_profile.py --out OUT.jsonl
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from dzmodel.bench.loader_bench import droid_dataset, trainer_dataset
from dzmodel.data.nvdec import NvdecDecoder, VideoImages, import_nvc


class _TimedCalls:
    """A decoder whose frame reads are timed into its owner's counters."""

    def __init__(self, decoder, owner):
        self.decoder, self.owner = decoder, owner

    def __len__(self):
        return len(self.decoder)

    def get_stream_metadata(self):
        return self.decoder.get_stream_metadata()

    def get_batch_frames_by_index(self, indices):
        t0 = time.perf_counter()
        frames = self.decoder.get_batch_frames_by_index(indices)
        with self.owner._lock:
            self.owner.decode_s += time.perf_counter() - t0
            self.owner.frames += len(indices)
        return frames


class TimedDecoder(NvdecDecoder):
    """The library's decoder, timed; own_stream=False puts its decoders and copies on the legacy default stream,
    native=False keeps the library's RGB conversion for every file."""

    def __init__(self, device, threads: int, own_stream: bool = True, native: bool = True):
        super().__init__(device, threads=threads)
        self.own_stream, self.native = own_stream, native
        self.decode_s = self.lane_s = 0.0
        self.frames = 0

    def _native_colour(self, path):
        return self.native and super()._native_colour(path)

    def _open(self, path, stream, native):
        return _TimedCalls(super()._open(path, stream, native), self)

    def _read_on_lane(self, path, indices, decoders, lane_stream, caller_stream):
        t0 = time.perf_counter()
        out = super()._read_on_lane(path, indices, decoders, lane_stream if self.own_stream else None, caller_stream)
        if not self.own_stream:  # as the decoder before: its lane waited for the copy out of the decoder's buffer
            torch.cuda.current_stream(self.device).synchronize()
        with self._lock:
            self.lane_s += time.perf_counter() - t0
        return out


def host_batches(dataset, mb, n, workdir, embodiment):
    ds, sampler, collate = trainer_dataset(dataset, mb, workdir, embodiment)
    for d in ds.datasets:
        d.decode_on_host = False
    torch.set_num_threads(1)
    loader = torch.utils.data.DataLoader(ds, batch_size=mb, sampler=sampler, collate_fn=collate, num_workers=0)
    it = iter(loader)
    next(it)
    t0 = time.perf_counter()
    batches = [next(it) for _ in range(n)]
    return ds, batches, (time.perf_counter() - t0) / n


def fill_rate(ds, batches, threads, device, own_stream=True, native=True):
    dec = TimedDecoder(device, threads, own_stream, native)
    video = VideoImages(ds.datasets, dec, train=True, seed=0)
    for b in batches[:2]:  # open the decoders, warm the kernels
        video.fill(copy.copy(b))
    torch.cuda.synchronize()
    dec.decode_s = dec.lane_s = 0.0
    dec.frames = 0
    read_wall = 0.0
    original = dec.read_many

    def timed_read_many(requests):
        nonlocal read_wall
        t = time.perf_counter()
        out = original(requests)
        read_wall += time.perf_counter() - t
        return out

    dec.read_many = timed_read_many
    t0 = time.perf_counter()
    for b in batches:
        out = video.fill(copy.copy(b))
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    dec.close()
    n = len(batches) * len(batches[0]["position"])
    return {"what": "fill", "threads": threads, "own_stream": own_stream, "native": native,
            "decoders": dec.opened, "nv12_decoders": dec.native_files,
            "samples_per_s": round(n / wall, 2), "ms_per_batch": round(1e3 * wall / len(batches), 1),
            "read_ms_per_batch": round(1e3 * read_wall / len(batches), 1),
            "augment_ms_per_batch": round(1e3 * (wall - read_wall) / len(batches), 1),
            "decoder_call_ms_per_frame_thread_sum": round(1e3 * dec.decode_s / max(dec.frames, 1), 3),
            "rest_of_read_ms_per_frame_thread_sum": round(1e3 * (dec.lane_s - dec.decode_s) / max(dec.frames, 1), 3),
            "frames_per_s": round(dec.frames / wall, 1), "images": list(out["images"].shape)}


def against_before(ds, batch, device, variant):
    """A variant's images (augmentation off) against the library's RGB on the legacy stream."""
    ref = VideoImages(ds.datasets, TimedDecoder(device, 4, own_stream=False, native=False), train=False, seed=0)
    new = VideoImages(ds.datasets, TimedDecoder(device, 4, **variant), train=False, seed=0)
    d = (ref.fill(copy.copy(batch))["images"].int() - new.fill(copy.copy(batch))["images"].int()).abs()
    ref.decoder.close()
    new.decoder.close()
    return {"max_abs_diff": int(d.max()), "mean_abs_diff": round(float(d.float().mean()), 4)}


def ceiling(files, decoders_n, device, own_stream=False):
    nvc = import_nvc()
    streams = [torch.cuda.Stream(device) for _ in range(decoders_n)]
    decs = [nvc.SimpleDecoder(str(files[i % len(files)]), gpu_id=device.index or 0, use_device_memory=True,
                              cuda_stream=streams[i].cuda_stream if own_stream else 0,
                              output_color_type=nvc.OutputColorType.RGB) for i in range(decoders_n)]

    def run(dec):
        n = 0
        while True:
            got = dec.get_batch_frames(64)
            n += len(got)
            if len(got) < 64:
                return n

    t0 = time.perf_counter()
    with ThreadPoolExecutor(decoders_n) as pool:
        total = sum(pool.map(run, decs))
    wall = time.perf_counter() - t0
    return {"what": "sequential decode", "decoders": decoders_n, "own_stream": own_stream, "frames": total,
            "frames_per_s": round(total / wall, 1)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default="build/bench_data")
    p.add_argument("--embodiment", default="oxe_droid_5b")
    p.add_argument("--micro-batch", type=int, default=21)
    p.add_argument("--batches", type=int, default=10)
    p.add_argument("--threads", default="8,16")
    p.add_argument("--variants", default="stream=legacy+native=0,stream=own+native=0,stream=own+native=1",
                   help="comma-separated; each KEY=V joined by +: stream=own|legacy, native=1|0")
    p.add_argument("--ceiling", default="1,3,7", help="numbers of decoders for the sequential ceiling")
    p.add_argument("--ceiling-streams", default="0", help="0, 1 or 0,1: the ceiling on the legacy stream, own")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    device = torch.device("cuda", 0)
    workdir = Path(args.workdir)
    dataset = droid_dataset(workdir / "droid_h264_g2", embodiment=args.embodiment)
    ds, batches, host_s = host_batches(dataset, args.micro_batch, args.batches + 2, workdir, args.embodiment)
    rows = [{"what": "host", "ms_per_batch": round(1e3 * host_s, 1), "micro_batch": args.micro_batch,
             "embodiment": args.embodiment}]
    variants = [dict(kv.split("=") for kv in item.split("+")) for item in args.variants.split(",")]
    variants = [{"own_stream": v.get("stream", "own") == "own", "native": v.get("native", "1") == "1"}
                for v in variants]
    for v in variants:
        rows.append({"what": "against the decoder before", **v, **against_before(ds, batches[0], device, v)})
        print(json.dumps(rows[-1]), flush=True)
    for v in variants:
        for threads in map(int, args.threads.split(",")):
            rows.append(fill_rate(ds, batches, threads, device, **v))
            print(json.dumps(rows[-1]), flush=True)
    files = sorted((dataset / "videos").rglob("*.mp4"))
    for own in map(int, args.ceiling_streams.split(",")):
        for n in map(int, args.ceiling.split(",")):
            rows.append(ceiling(files, n, device, bool(own)))
            print(json.dumps(rows[-1]), flush=True)
    gpu = torch.cuda.get_device_name(0)
    with open(args.out, "a") as f:
        for r in rows:
            f.write(json.dumps({**r, "gpu": gpu, "date": time.strftime("%Y-%m-%d")}) + "\n")


if __name__ == "__main__":
    main()
