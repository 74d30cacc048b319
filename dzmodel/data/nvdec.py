"""Video decoded on the GPU (`train.video_decode: nvdec`): the loader's CPU workers read only the vectors and say
which frames each window needs; the training process decodes those frames with the GPU's video engine (NVDEC,
through NVIDIA's PyNvVideoCodec) straight into device memory, then crops, resizes and jitters them there.

At the 5B DROID shape a sample is 3 cameras x 33 frames; a CPU worker that decodes and augments them gives about
6 samples/s a core (docs/performance.md), so the CPU cores a GPU can have do not keep up with it. Here:

* `WindowDataset.decode_on_host = False` makes `sample` return `frame_refs` ({view: (video file, frame indices in
  that file)}) instead of `images`; the collator passes them through as a list.
* `NvdecDecoder` keeps an LRU of open decoders (one per file) on each decoding thread and returns the frames as
  uint8 [N, H, W, 3] on the device, in the order asked (duplicates allowed). Each thread's decoders work on that
  thread's own CUDA stream, not the legacy default stream, which would order them behind each other and behind the
  training step. Video that is 8-bit 4:2:0 in BT.601 limited range (or untagged, as LeRobot's encoders leave it)
  comes out of NVDEC as NV12 and is turned into RGB here, a read at a time (`nv12_to_rgb`); other video (BT.709,
  full range, 10-bit, 4:4:4) keeps the library's RGB conversion. On an H200 the two together made the loader
  1.4-1.5x faster at the 5B DROID shape, and `dz train` from video 1.28x (docs/performance.md).
* `VideoImages.fill(batch)` replaces a batch's `frame_refs` with `images`, augmented as the device-resident path
  augments (`augment.draw` from the run's seed and each sample's stream position, `augment.augment_view`, then
  `transforms.compose_layout`): with augmentation off the images equal the CPU loader's where the library converts
  to RGB, and are within 2 levels of them through NV12.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from typing import Sequence

import numpy as np
import torch

from .augment import ViewAugment, augment_views, draw, params_to_device
from .device_dataset import dataset_parts, in_batch_order
from .errors import DataError
from .transforms import compose_layout

INSTALL_HINT = "pip install pynvvideocodec (NVIDIA's wheel; it needs an NVIDIA driver with NVDEC)"

# BT.601 limited range to RGB: the rows of Y - 16 and (U - 128, V - 128)
_LUMA = 255 / 219
_CHROMA = torch.tensor([[0.0, 1.596027], [-0.391762, -0.812968], [2.017232, 0.0]])


@functools.lru_cache(maxsize=None)
def _chroma_on(device: torch.device) -> torch.Tensor:
    """`_CHROMA` on `device`, copied once (not at every read); waited for, as other threads' streams read it."""
    chroma = _CHROMA.to(device)
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    return chroma


def nv12_to_rgb(frames: torch.Tensor) -> torch.Tensor:
    """8-bit NV12 frames uint8 [N, 3H/2, W] (a trailing dimension of 1 allowed) -> RGB uint8 [N, H, W, 3]: BT.601
    limited range, each chroma sample over its 2x2 pixels, truncated as FFmpeg's converter does (within 2 levels
    of PyAV's rgb24: tests/data/test_nvdec.py)."""
    n, rows, w = frames.shape[0], frames.shape[1], frames.shape[2]
    x = frames.reshape(n, rows, w)
    h = rows * 2 // 3
    luma = x[:, :h].float().sub_(16.0).mul_(_LUMA).unsqueeze(-1)
    chroma = x[:, h:].reshape(n, h // 2, w // 2, 2).float().sub_(128.0)
    chroma = chroma.repeat_interleave(2, 1).repeat_interleave(2, 2)
    rgb = torch.matmul(chroma, _chroma_on(chroma.device).T).add_(luma)
    return rgb.floor_().clamp_(0, 255).to(torch.uint8)


def _is_nv12(frame: torch.Tensor, height: int, width: int) -> bool:
    """A native frame that is 8-bit NV12 of a height x width picture (even sides)."""
    return (frame.dtype == torch.uint8 and height % 2 == 0 and width % 2 == 0
            and tuple(frame.shape[:2]) == (height * 3 // 2, width) and frame[0, 0].numel() == 1)


def import_nvc():
    """PyNvVideoCodec, or one clear error that says how to get it or how to train without it."""
    try:
        import PyNvVideoCodec as nvc
    except ImportError as e:
        raise DataError(f"train.video_decode: nvdec needs PyNvVideoCodec, which is not installed ({e}): "
                        f"{INSTALL_HINT}; or set train.video_decode: cpu (the loader workers decode)") from e
    return nvc


class NvdecDecoder:
    """Frames of video files decoded on `device` by NVDEC, on `threads` decoding threads (lanes), so the reads of a
    micro-batch run side by side: a GPU has several NVDEC engines, and one thread waiting on each frame keeps only one
    busy. A batch's reads (one per sample and camera) are spread evenly over the lanes (`_assign`). Each lane has
    decoders of its own (they are not shared between threads): one per file, the `cache_size` most recently used
    split over the lanes (at least two each). A LeRobot v3 file holds many episodes, so windows of nearby episodes
    reuse one."""

    def __init__(self, device: torch.device | str, cache_size: int = 32, threads: int = 8):
        import threading
        from concurrent.futures import ThreadPoolExecutor

        if threads < 1:
            raise ValueError(f"NVDEC decoding threads must be >= 1, got {threads}")
        self.device = torch.device(device)
        self.nvc = import_nvc()
        self.threads = threads
        self.cache_size = max(2, cache_size // threads)  # per lane: a lane's run of reads can span two files
        cuda = self.device.type == "cuda"
        self._lanes = [(ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"nvdec-lane{i}"), OrderedDict(),
                        torch.cuda.Stream(self.device) if cuda else None) for i in range(threads)]
        self._lock = threading.Lock()
        self.opened = 0   # decoders created
        self.native_files = 0  # of them, decoders whose NV12 frames are turned into RGB here (`nv12_to_rgb`)
        self._native: dict[str, bool] = {}  # per file: NV12 out (its colour allows it, and its frames are NV12)

    @property
    def _decoders(self) -> OrderedDict:
        """The open decoders of a one-lane decoder, least recently used first (for tests)."""
        return self._lanes[0][1]

    def _assign(self, requests: Sequence[tuple[str, Sequence[int]]]) -> list[int]:
        """A lane for each (path, indices) of a batch: the reads in order of file and first frame, cut into `threads`
        runs of equal frames. Each lane reads about as much, and from few files: a file's reads are split over
        lanes only where it has more than a lane's share (a LeRobot v3 recording holds a camera's episodes in one
        file, so a micro-batch may read only three files), and the same files fall on the same lanes from one batch
        to the next, where their decoders are open."""
        order = sorted(range(len(requests)), key=lambda i: (requests[i][0], min(requests[i][1], default=0)))
        total, done, lanes = sum(len(r[1]) for r in requests) or 1, 0, [0] * len(requests)
        for i in order:
            size = len(requests[i][1])
            lanes[i] = min(self.threads - 1, (2 * done + size) * self.threads // (2 * total))  # the read's middle
            done += size
        return lanes

    def _native_colour(self, path: str) -> bool:
        """Whether the file's colour is what `nv12_to_rgb` assumes: BT.601 (or untagged) in limited range (or
        untagged). A demuxer that cannot tell leaves the conversion to the library."""
        try:
            demuxer = self.nvc.CreateDemuxer(filename=path)
            space, colour_range = demuxer.ColorSpace(), demuxer.ColorRange()
        except Exception:
            return False
        name = lambda value: str(getattr(value, "name", value)).rsplit(".", 1)[-1].upper()  # noqa: E731
        return name(space) in ("BT_601", "UNSPEC") and name(colour_range) in ("MPEG", "UDEF", "UNSPEC")

    def _open(self, path: str, stream, native: bool):
        colour = self.nvc.OutputColorType.NATIVE if native else self.nvc.OutputColorType.RGB
        try:
            return self.nvc.SimpleDecoder(path, gpu_id=self.device.index or 0, use_device_memory=True,
                                          cuda_stream=0 if stream is None else stream.cuda_stream,
                                          output_color_type=colour)
        except Exception as e:  # the library's own errors: unsupported codec, missing file, no NVDEC
            raise DataError(f"{path}: NVDEC cannot open this video ({type(e).__name__}: {e}); "
                            "train.video_decode: cpu decodes it on the loader workers") from e

    def _decoder(self, path: str, decoders: OrderedDict, stream=None) -> tuple:
        """(decoder, native) for `path` on a lane: native decoders give NV12 frames, the others RGB."""
        entry = decoders.get(path)
        if entry is None:
            native = self._native.get(path)
            if native is None:  # asked once a file: a decoder opened again after eviction does not ask again
                native = self._native[path] = self._native_colour(path)
            entry = (self._open(path, stream, native), native)
            decoders[path] = entry
            with self._lock:
                self.opened += 1
                self.native_files += native
            while len(decoders) > self.cache_size:
                decoders.popitem(last=False)
        else:
            decoders.move_to_end(path)
        return entry

    def read(self, path: str, indices: Sequence[int]) -> torch.Tensor:
        """Frames `indices` of the file (any order, duplicates allowed): uint8 [N, H, W, 3] on the device."""
        return self.read_many([(path, indices)])[0]

    def read_many(self, requests: Sequence[tuple[str, Sequence[int]]]) -> list[torch.Tensor]:
        """`read` of each (path, indices), the lanes running side by side; the results in request order. On
        CUDA each lane works on its own stream and has finished when its result comes back; the results are marked
        as used on the caller's current stream."""
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        futures = []
        for (path, indices), lane in zip(requests, self._assign(requests)):
            executor, decoders, lane_stream = self._lanes[lane]
            futures.append(executor.submit(self._read_on_lane, path, indices, decoders, lane_stream, stream))
        return [f.result() for f in futures]

    def _read_on_lane(self, path: str, indices: Sequence[int], decoders: OrderedDict, lane_stream,
                      caller_stream) -> torch.Tensor:
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size == 0:
            raise DataError(f"{path}: no frames asked")
        dec, native = self._decoder(path, decoders, lane_stream)
        n = len(dec)
        if idx.min() < 0 or idx.max() >= n:
            raise DataError(f"{path}: frame index out of range [0, {n}): {idx[(idx < 0) | (idx >= n)][:5].tolist()}")
        uniq, inverse = np.unique(idx, return_inverse=True)
        frames = dec.get_batch_frames_by_index(uniq.tolist())
        if len(frames) != len(uniq):
            raise DataError(f"{path}: NVDEC returned {len(frames)} frames for {len(uniq)} asked")
        with torch.cuda.stream(lane_stream):  # None (a CPU): no stream, nothing to wait for
            # each frame is the decoder's own buffer, reused by its next call: stack copies them out (on the lane's
            # stream, after the decoder's work there), and the lane waits for that copy before decoding again
            out = torch.stack([torch.from_dlpack(f) for f in frames]).to(self.device)
            if native:
                meta = dec.get_stream_metadata()
                if not _is_nv12(out[0], meta.height, meta.width):  # not 8-bit 4:2:0 after all: the library's RGB
                    decoders[path] = (self._open(path, lane_stream, False), False)
                    with self._lock:
                        self.opened += 1
                        self.native_files -= 1
                        self._native[path] = False
                    return self._read_on_lane(path, indices, decoders, lane_stream, caller_stream)
                out = nv12_to_rgb(out)
            if out.dim() != 4 or out.shape[-1] != 3 or out.dtype != torch.uint8:
                raise DataError(f"{path}: NVDEC gave frames {tuple(out.shape)} {out.dtype}, expected uint8 "
                                "[N, H, W, 3]")
            if len(uniq) != len(idx) or not np.array_equal(uniq, idx):
                out = out[torch.from_numpy(inverse).to(out.device)]
            if lane_stream is not None:
                lane_stream.synchronize()
                out.record_stream(caller_stream)  # made on the lane's stream, used on the caller's
        return out

    def close(self) -> None:
        for executor, decoders, _ in self._lanes:
            executor.shutdown(wait=True)
            decoders.clear()


class VideoImages:
    """Fills the `images` of micro-batches whose samples carry `frame_refs`, on the decoder's device."""

    def __init__(self, datasets: Sequence, decoder: NvdecDecoder, train: bool, seed: int):
        self.embodiments = [d.emb for d in datasets]
        self.decoder, self.train, self.seed = decoder, train, seed

    @classmethod
    def attach(cls, datasets: Sequence, device: torch.device | str, train: bool, seed: int,
               threads: int = 8) -> "VideoImages":
        """Switch `datasets` (`WindowDataset`s) to naming their frames, and return what decodes them on `device`
        (on `threads` decoding threads)."""
        for d in datasets:
            d.decode_on_host = False
        return cls(datasets, NvdecDecoder(device, threads=threads), train, seed)

    def fill(self, batch: dict) -> dict:
        """`batch` from the collator with `frame_refs` (and `dataset`, each sample's dataset id) -> the same batch
        with `images` uint8 [B, T, H, W, 3] on the device instead."""
        refs, datasets = batch.pop("frame_refs"), batch.pop("dataset")
        positions = np.asarray(batch["position"], dtype=np.int64)
        parts = dataset_parts(np.asarray(datasets, dtype=np.int64))
        outs = [{"images": self._images(self.embodiments[d], [refs[i] for i in rows], positions[rows])}
                for d, rows in parts]
        batch.update(in_batch_order(outs, parts, self.decoder.device))
        return batch

    def _images(self, emb, refs: list[dict], positions: np.ndarray) -> torch.Tensor:
        B = len(refs)
        names = list(emb.views)
        read = iter(self.decoder.read_many([r[short] for short in names for r in refs]))  # every file at once
        frames = {short: torch.cat([next(read) for _ in refs]) for short in names}
        T = frames[next(iter(emb.views))].shape[0] // B
        views = {s: ViewAugment(source=tuple(frames[s].shape[1:3]), size=tuple(emb.view_size),
                                crop_scale=emb.crop_scale, jitter=dict(emb.color_jitter)) for s in emb.views}
        aug = draw(self.seed, positions, list(views.values()), self.train)
        _, top, left, matrix, coef = params_to_device(aug, self.decoder.device)
        index = torch.arange(B * T, device=self.decoder.device).reshape(B, T)
        return compose_layout(emb, augment_views(frames, index, views, top, left, matrix, coef))


class Prefetch:
    """`fill` over `batches` in a background thread, `depth` batches ahead, so that decoding the next micro-batch
    overlaps the current step instead of stalling the GPU between steps. On CUDA the thread works on its own stream;
    each batch carries an event that the consumer's stream waits for (no host sync), and its tensors are marked as
    used on the consumer's stream (the allocator keeps them until that stream is done with them). Batches come out
    in order; an error in the thread is raised by the iterator; `close` stops the thread."""

    def __init__(self, batches, fill, device: torch.device | str, depth: int = 2):
        import queue
        import threading

        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._work, args=(iter(batches), fill), daemon=True,
                                        name="nvdec-prefetch")
        self._thread.start()

    def _put(self, item) -> bool:
        import queue

        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _work(self, batches, fill) -> None:
        try:
            for batch in batches:
                if self.stream is None:
                    item = (fill(batch), None)
                else:
                    with torch.cuda.stream(self.stream):
                        out = fill(batch)
                        event = torch.cuda.Event()
                        event.record(self.stream)
                    item = (out, event)
                if not self._put(item):
                    return
            self._put(StopIteration())
        except BaseException as e:  # handed to the consumer, raised there
            self._put(e)

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        item = self._queue.get()
        if isinstance(item, StopIteration):
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        batch, event = item
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            for value in batch.values():
                if isinstance(value, torch.Tensor) and value.is_cuda:
                    value.record_stream(current)
        return batch

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
