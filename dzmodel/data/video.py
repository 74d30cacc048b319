"""Video decoding (torchcodec batched, PyAV fallback) and encoding (PyAV) for LeRobot mp4s.

``decode_frames(path, timestamps_s)`` returns uint8 ``[N, H, W, 3]`` frames in the order asked
(duplicates allowed). Each timestamp is mapped to the nearest frame; a frame whose presentation
time is further than ``tolerance_s`` from the request is a DataError (wrong ``from_timestamp``,
a variable-frame-rate file, or a request past the end).

Backends:
  torchcodec  one batched ``VideoDecoder.get_frames_at(indices=...)`` call for the sorted unique
              frames, re-expanded to the requested order; decoders are cached per thread.
  pyav        seek + decode per requested frame (the baseline the benchmark compares against).
  opencv      OpenCV's own FFmpeg (opencv-python wheels): the codecs its build has (every build reads
              H.264; AV1 depends on the build), sequential reads from the nearest requested frame. For
              machines with neither of the above, such as the GPU image, which has opencv-python-headless.
  auto        torchcodec when it imports (it needs FFmpeg shared libraries), else PyAV, else OpenCV.

torchcodec, av, cv2 and PIL are imported lazily: the GPU image lacks most of them, and the model code
must import without them.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np
import torch

from dzmodel.data.errors import DataError

BACKENDS = ("auto", "torchcodec", "pyav", "opencv")
DEFAULT_TOLERANCE_S = 1e-3
CODEC_ALIASES = {"av1": "libsvtav1", "libsvtav1": "libsvtav1", "h264": "libx264", "libx264": "libx264"}

_torchcodec_error: str | None = None  # why torchcodec cannot be used (None: not tried yet or fine)
_torchcodec_checked = False
_local = threading.local()  # per-thread torchcodec decoder cache
_DECODER_CACHE_SIZE = 8


# --------------------------------------------------------------------------------------------
# backend selection


def torchcodec_available() -> bool:
    """True when ``torchcodec.decoders.VideoDecoder`` imports (it loads FFmpeg shared libraries)."""
    global _torchcodec_checked, _torchcodec_error
    if not _torchcodec_checked:
        try:
            from torchcodec.decoders import VideoDecoder  # noqa: F401
        except Exception as e:  # ImportError, or RuntimeError when the FFmpeg libraries are missing
            _torchcodec_error = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        _torchcodec_checked = True
    return _torchcodec_error is None


def resolve_backend(backend: str = "auto") -> str:
    """The backend ``decode_frames`` will use for ``backend`` ("auto" picks torchcodec if usable)."""
    if backend not in BACKENDS:
        raise DataError(f"video backend: {backend!r} is not one of {BACKENDS}")
    if backend == "auto":
        if torchcodec_available():
            return "torchcodec"
        return "pyav" if _module_available("av") or not _module_available("cv2") else "opencv"
    if backend == "torchcodec" and not torchcodec_available():
        raise DataError(
            f"video backend: torchcodec cannot be loaded ({_torchcodec_error}); "
            "install torchcodec with a matching FFmpeg, or use backend='pyav'"
        )
    return backend


def _module_available(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def _import_av():
    try:
        import av
    except ImportError as e:
        raise DataError(f"video: PyAV is not installed ({e}); `pip install av`") from e
    return av


def worker_init_fn(worker_id: int) -> None:
    """DataLoader ``worker_init_fn``: one compute thread per loader worker (decode is per-worker)."""
    del worker_id
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["MKL_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:  # the colour jitter's OpenCV pass (transforms.color_jitter_uint8): its own thread pool would oversubscribe
        import cv2

        cv2.setNumThreads(1)
    except ImportError:
        pass


# --------------------------------------------------------------------------------------------
# decoding


def decode_frames(
    path: str | os.PathLike,
    timestamps_s: Sequence[float],
    backend: str = "auto",
    tolerance_s: float = DEFAULT_TOLERANCE_S,
    seek_mode: str = "approximate",
) -> np.ndarray:
    """Frames of the video at ``path`` nearest to ``timestamps_s`` (seconds): uint8 [N, H, W, 3].

    ``seek_mode`` ("approximate" | "exact") is torchcodec's: approximate trusts the container
    header (fast open; right for constant-frame-rate LeRobot mp4s), exact scans the file once.
    Either way the returned frames' timestamps are checked against ``tolerance_s``.
    """
    path = Path(path)
    ts = np.asarray(list(timestamps_s), dtype=np.float64).reshape(-1)
    if not np.all(np.isfinite(ts)):
        raise DataError(f"{path}: timestamps must be finite, got {ts.tolist()}")
    if not path.is_file():
        raise DataError(f"{path}: video file is missing")
    used = resolve_backend(backend)
    if ts.size == 0:
        return np.zeros((0, 0, 0, 3), dtype=np.uint8)
    uniq, inverse = np.unique(ts, return_inverse=True)
    try:
        if used == "torchcodec":
            frames, pts = _decode_torchcodec(path, uniq, seek_mode)
        elif used == "opencv":
            frames, pts = _decode_opencv(path, uniq)
        else:
            frames, pts = _decode_pyav(path, uniq)
    except DataError:
        raise
    except Exception as e:  # FFmpeg / container errors from either backend
        raise DataError(f"{path}: cannot decode video ({used}): {type(e).__name__}: {e}") from e
    err = np.abs(pts - uniq)
    bad = err > tolerance_s
    if bad.any():
        i = int(np.argmax(bad))
        raise DataError(
            f"{path}: no frame within tolerance_s={tolerance_s} of {int(bad.sum())} requested "
            f"timestamp(s); e.g. asked {uniq[i]:.6f}s, nearest frame at {pts[i]:.6f}s "
            "(wrong from_timestamp/fps in the metadata, or a timestamp past the end of the video)"
        )
    return frames[inverse]


def _torchcodec_decoder(path: Path, seek_mode: str):
    from torchcodec.decoders import VideoDecoder

    st = path.stat()
    key = (str(path.resolve()), st.st_mtime_ns, st.st_size, seek_mode, os.getpid())
    cache = getattr(_local, "decoders", None)
    if cache is None:
        cache = _local.decoders = OrderedDict()
    dec = cache.get(key)
    if dec is None:
        dec = VideoDecoder(str(path), seek_mode=seek_mode, dimension_order="NHWC", num_ffmpeg_threads=1)
        cache[key] = dec
        while len(cache) > _DECODER_CACHE_SIZE:
            cache.popitem(last=False)
    else:
        cache.move_to_end(key)
    return dec


def clear_decoder_cache() -> None:
    """Drop this thread's cached torchcodec decoders (closes their files)."""
    cache = getattr(_local, "decoders", None)
    if cache is not None:
        cache.clear()


def _decode_torchcodec(path: Path, ts: np.ndarray, seek_mode: str) -> tuple[np.ndarray, np.ndarray]:
    dec = _torchcodec_decoder(path, seek_mode)
    md = dec.metadata
    fps = md.average_fps
    n = md.num_frames
    if not fps or not n:
        raise DataError(f"{path}: video stream has no frame rate / frame count in its header")
    begin = md.begin_stream_seconds or 0.0
    idx = np.clip(np.rint((ts - begin) * fps).astype(np.int64), 0, n - 1)
    uidx, inv = np.unique(idx, return_inverse=True)
    batch = dec.get_frames_at(indices=uidx.tolist())  # one batched call
    frames = batch.data.numpy()
    pts = batch.pts_seconds.numpy().astype(np.float64)
    if len(uidx) != len(idx) or not np.array_equal(uidx, idx):  # re-expand duplicates / original order
        frames, pts = frames[inv], pts[inv]
    return _rgb_check(path, frames), pts


# Past this gap to the next wanted timestamp, PyAV seeks (decoding from the keyframe before it) instead of decoding on.
PYAV_SEEK_AHEAD_S = 2.0


def _pyav_frames(container, stream):
    """(frame, time) in decode order from the container's current position; frames without a time skipped."""
    for frame in container.decode(stream):
        if frame.time is not None:
            yield frame, frame.time


def _decode_pyav(path: Path, ts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The frame nearest each of the sorted, unique timestamps `ts`. Decodes on through the stream, and seeks to the
    keyframe before a timestamp only to start and to jump more than PYAV_SEEK_AHEAD_S ahead: a whole episode is
    decoded once, not once per frame from its keyframe. The frame chosen is the one a seek to each timestamp finds:
    the first at or after it, or the one before when that is nearer (the last frame past the end)."""
    av = _import_av()
    frames, pts = [], []
    with av.open(str(path)) as container:
        if not container.streams.video:
            raise DataError(f"{path}: no video stream")
        stream = container.streams.video[0]
        tb = stream.time_base
        decoded, prev, cur, ended = None, None, None, False  # prev, cur: the last two (frame, time) decoded
        for t in ts:
            if decoded is None or (not ended and cur is not None and t - cur[1] > PYAV_SEEK_AHEAD_S):
                container.seek(int(max(t, 0.0) / tb), stream=stream, backward=True, any_frame=False)
                decoded, prev, cur, ended = _pyav_frames(container, stream), None, None, False
            while not ended and (cur is None or cur[1] < t - 1e-9):
                nxt = next(decoded, None)
                if nxt is None:
                    ended = True
                else:
                    prev, cur = cur, nxt
            if cur is None:
                raise DataError(f"{path}: no frame could be decoded near {t:.6f}s")
            best = cur
            if cur[1] >= t - 1e-9 and prev is not None and abs(prev[1] - t) < abs(cur[1] - t):
                best = prev
            frames.append(best[0].to_ndarray(format="rgb24"))
            pts.append(best[1])
    return _rgb_check(path, np.stack(frames)), np.asarray(pts, dtype=np.float64)


def _decode_opencv(path: Path, ts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Frame index = round(t * fps) from the container's constant frame rate (LeRobot mp4s are CFR);
    sequential reads, with a seek only where the next requested frame is not just ahead."""
    try:
        import cv2
    except ImportError as e:
        raise DataError(f"video: OpenCV is not installed ({e}); `pip install opencv-python-headless`") from e
    cap = cv2.VideoCapture(str(path))
    try:
        fps, n = cap.get(cv2.CAP_PROP_FPS), int(cap.get(cv2.CAP_PROP_FRAME_COUNT))
        if not cap.isOpened() or not fps or n <= 0:
            raise DataError(f"{path}: OpenCV cannot open this video ({_opencv_cannot(path, cap)})")
        idx = np.clip(np.rint(ts * fps).astype(np.int64), 0, n - 1)
        frames, pos = [], -1
        for i in idx:  # ts is sorted and unique
            if i <= pos or i > pos + 32:  # reading on is cheaper than a seek (which decodes from a keyframe)
                cap.set(cv2.CAP_PROP_POS_FRAMES, int(i))
                pos = int(i) - 1
            while pos < i:
                ok, bgr = cap.read()
                if not ok:
                    raise DataError(f"{path}: OpenCV could not decode frame {pos + 1} of {n} "
                                    f"({_opencv_cannot(path, cap)})")
                pos += 1
            frames.append(cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB))
    finally:
        cap.release()
    return _rgb_check(path, np.stack(frames)), idx / fps


def _opencv_cannot(path: Path, cap) -> str:
    """Why OpenCV may fail on a file, naming its codec: the build decides which codecs OpenCV reads."""
    import cv2

    codec = None
    try:
        import av

        with av.open(str(path)) as container:
            codec = container.streams.video[0].codec_context.name
    except Exception:  # no PyAV (the GPU image) or not a video PyAV reads: ask OpenCV's demuxer
        fourcc = int(cap.get(cv2.CAP_PROP_FOURCC))
        codec = fourcc.to_bytes(4, "little").decode("latin-1").strip("\x00 ") if fourcc > 0 else None
    what = f"codec {codec}" if codec else "its codec is unknown"
    return (f"{what}; this OpenCV build, {cv2.__version__}, cannot decode it: re-encode with --codec h264, or "
            "install PyAV / torchcodec")


def _rgb_check(path: Path, frames: np.ndarray) -> np.ndarray:
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise DataError(f"{path}: decoded frames have shape {frames.shape} {frames.dtype}, want [N,H,W,3] uint8")
    return np.ascontiguousarray(frames)


def video_info(path: str | os.PathLike) -> dict:
    """Header facts of the first video stream via PyAV (OpenCV where PyAV is missing): codec, width, height, fps,
    num_frames, duration_s."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: video file is missing")
    if not _module_available("av") and _module_available("cv2"):
        return _video_info_opencv(path)
    av = _import_av()
    try:
        with av.open(str(path)) as c:
            s = c.streams.video[0]
            dur = float(s.duration * s.time_base) if s.duration is not None else None
            return {
                "codec": s.codec_context.name,
                "width": s.width,
                "height": s.height,
                "pix_fmt": s.pix_fmt,
                "fps": float(s.average_rate) if s.average_rate else None,
                "num_frames": s.frames,
                "duration_s": dur,
            }
    except Exception as e:
        raise DataError(f"{path}: cannot read video header: {type(e).__name__}: {e}") from e


# --------------------------------------------------------------------------------------------
# decoding every frame (`dz data check --deep`)

# FFmpeg's strictest decoding: an error the decoder would conceal is raised instead (err_detect=explode: H.264 and
# most decoders), and dav1d checks every AV1 bitstream rule (strict), so bytes damaged mid-stream stop the decode.
STRICT_DECODE = {"err_detect": "explode", "strict": "strict"}


@dataclass(frozen=True)
class VideoScan:
    """What decoding every frame of a video found."""

    frames: int               # frames decoded, in presentation order: with an error, frame `frames` is the first lost
    error: str | None = None  # why decoding stopped (None: every frame decoded)


def scan_video(path: str | os.PathLike) -> VideoScan:
    """Decode every frame of the first video stream with FFmpeg's strict error detection (PyAV; OpenCV, which
    cannot be made strict, where PyAV is missing). A damaged stream that still decodes without a decoder error is
    not found: an mp4 holds no checksums, so nothing but the original bytes could tell."""
    path = Path(path)
    if not _module_available("av") and _module_available("cv2"):
        return _scan_video_opencv(path)
    av = _import_av()
    import av.logging

    decoded = 0
    with av.logging.Capture() as logs:  # FFmpeg's complaints go into the message, not onto the terminal
        try:
            with av.open(str(path)) as container:
                if not container.streams.video:
                    return VideoScan(0, "no video stream")
                stream = container.streams.video[0]
                stream.codec_context.options = dict(STRICT_DECODE)
                for packet in container.demux(stream):
                    decoded += len(packet.decode())
        except Exception as e:  # FFmpeg errors of any kind: the decode stopped here
            said = next((m for level, _, m in logs if level <= av.logging.ERROR), None)
            reason = f"{type(e).__name__}: {getattr(e, 'strerror', None) or e}" + (f" ({said.strip()})" if said else "")
            return VideoScan(decoded, reason)
    return VideoScan(decoded)


def _scan_video_opencv(path: Path) -> VideoScan:
    import cv2

    cap = cv2.VideoCapture(str(path))
    try:
        if not cap.isOpened():
            return VideoScan(0, "OpenCV cannot open it")
        expected, decoded = int(cap.get(cv2.CAP_PROP_FRAME_COUNT)), 0
        while cap.read()[0]:
            decoded += 1
    finally:
        cap.release()
    if decoded < expected:
        return VideoScan(decoded, f"OpenCV read {decoded} of the {expected} frames its header counts")
    return VideoScan(decoded)


# --------------------------------------------------------------------------------------------
# image bytes (image-in-parquet datasets)


def decode_image_bytes(data: bytes, where: str = "image") -> np.ndarray:
    """PNG/JPEG bytes -> uint8 [H, W, 3] RGB. Uses Pillow if installed, else PyAV's image decoders."""
    try:
        from PIL import Image
    except ImportError:
        Image = None
    try:
        if Image is not None:
            import io

            with Image.open(io.BytesIO(data)) as im:
                return np.asarray(im.convert("RGB"), dtype=np.uint8)
        return _decode_image_pyav(data)
    except DataError:
        raise
    except Exception as e:
        raise DataError(f"{where}: cannot decode image bytes: {type(e).__name__}: {e}") from e


def _decode_image_pyav(data: bytes) -> np.ndarray:
    import io

    av = _import_av()
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        fmt = "png_pipe"
    elif data[:2] == b"\xff\xd8":
        fmt = "jpeg_pipe"
    else:
        fmt = "image2pipe"
    with av.open(io.BytesIO(data), format=fmt) as c:
        for frame in c.decode(video=0):
            return frame.to_ndarray(format="rgb24")
    raise DataError("image bytes hold no frame")


def encode_image_bytes(image: np.ndarray, fmt: str = "png") -> bytes:
    """uint8 [H, W, 3] -> PNG ("png") or JPEG ("jpeg") bytes with PyAV (for tests and synthetic data)."""
    av = _import_av()
    image = np.ascontiguousarray(image, dtype=np.uint8)
    codec = {"png": "png", "jpeg": "mjpeg", "jpg": "mjpeg"}[fmt]
    ctx = av.CodecContext.create(codec, "w")
    ctx.width, ctx.height = image.shape[1], image.shape[0]
    ctx.pix_fmt = "rgb24" if codec == "png" else "yuvj444p"
    ctx.time_base = Fraction(1, 1)
    frame = av.VideoFrame.from_ndarray(image, format="rgb24")
    if codec == "mjpeg":
        frame = frame.reformat(format="yuvj444p")
    packets = list(ctx.encode(frame)) + list(ctx.encode(None))
    return b"".join(bytes(p) for p in packets)


# --------------------------------------------------------------------------------------------
# encoding


def encode_video(
    path: str | os.PathLike,
    frames: np.ndarray,
    fps: float,
    codec: str = "libsvtav1",
    crf: int = 30,
    gop: int = 2,
    preset: str | int | None = None,
    pix_fmt: str = "yuv420p",
    options: dict[str, str] | None = None,
) -> Path:
    """Encode uint8 ``frames`` [T, H, W, 3] to an mp4 at ``path`` with PyAV; atomic (temp + rename).

    ``codec``: "libsvtav1"/"av1" (AV1, lerobot's default) or "libx264"/"h264". ``gop`` is the
    keyframe interval (lerobot uses 2: fast random access). H and W must be even (yuv420p).
    Without PyAV but with OpenCV (the GPU image), "h264" falls back to `_encode_video_opencv`.
    """
    path = Path(path)
    if not _module_available("av") and _module_available("cv2") and CODEC_ALIASES.get(codec) == "libx264":
        return _encode_video_opencv(path, np.asarray(frames), fps)
    av = _import_av()
    if codec not in CODEC_ALIASES:
        raise DataError(f"codec: {codec!r} is not one of {sorted(CODEC_ALIASES)}")
    vcodec = CODEC_ALIASES[codec]
    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8 or frames.shape[0] == 0:
        raise DataError(f"{path}: frames must be non-empty uint8 [T,H,W,3], got {frames.shape} {frames.dtype}")
    t, h, w, _ = frames.shape
    if pix_fmt == "yuv420p" and (h % 2 or w % 2):
        raise DataError(f"{path}: yuv420p needs even height and width, got {h}x{w}")
    rate = Fraction(fps).limit_denominator(1001) if not isinstance(fps, int) else fps
    opts = {"g": str(gop), "crf": str(crf)}
    if vcodec == "libsvtav1":
        opts["preset"] = str(10 if preset is None else preset)
    else:
        opts["preset"] = str("veryfast" if preset is None else preset)
        opts["bf"] = "0"  # no B-frames: pts == decode order, cheaper seeks
    opts.update(options or {})
    if vcodec == "libsvtav1":
        os.environ.setdefault("SVT_LOG", "1")  # SVT-AV1 prints its whole config at info level
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp-{uuid.uuid4().hex[:8]}{path.suffix or '.mp4'}")
    try:
        with av.open(str(tmp), "w", format="mp4") as out:
            stream = out.add_stream(vcodec, rate=rate, options=opts)
            stream.width, stream.height, stream.pix_fmt = w, h, pix_fmt
            for i in range(t):
                for packet in stream.encode(av.VideoFrame.from_ndarray(frames[i], format="rgb24")):
                    out.mux(packet)
            for packet in stream.encode():
                out.mux(packet)
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, Exception) and not isinstance(e, DataError):
            raise DataError(f"{path}: cannot encode video with {vcodec}: {type(e).__name__}: {e}") from e
        raise
    return path


# --------------------------------------------------------------------------------------------
# OpenCV fallbacks (machines with opencv-python but no PyAV, such as the GPU image)

_FOURCC_CODECS = {"mp4v": "mpeg4", "fmp4": "mpeg4", "avc1": "h264", "h264": "h264", "av01": "av1", "hev1": "hevc", "hvc1": "hevc"}


def _encode_video_opencv(path: Path, frames: np.ndarray, fps: float) -> Path:
    """MPEG-4 Part 2 ('mp4v') in an mp4, the one mp4 codec the opencv-python wheels encode (no H.264: they ship
    no OpenH264; no AV1). For synthetic data where PyAV is missing; OpenCV, PyAV and torchcodec decode it. No GOP or
    CRF control (OpenCV's defaults); atomic like `encode_video`."""
    import cv2

    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8 or frames.shape[0] == 0:
        raise DataError(f"{path}: frames must be non-empty uint8 [T,H,W,3], got {frames.shape} {frames.dtype}")
    t, h, w, _ = frames.shape
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp-{uuid.uuid4().hex[:8]}.mp4")
    writer = cv2.VideoWriter(str(tmp), cv2.VideoWriter_fourcc(*"mp4v"), float(fps), (w, h))
    try:
        if not writer.isOpened():
            raise DataError(f"{path}: OpenCV cannot write mp4v video (and PyAV is not installed)")
        for i in range(t):
            writer.write(cv2.cvtColor(frames[i], cv2.COLOR_RGB2BGR))
        writer.release()
        os.replace(tmp, path)
    except BaseException:
        writer.release()
        tmp.unlink(missing_ok=True)
        raise
    return path


def _video_info_opencv(path: Path) -> dict:
    import cv2

    cap = cv2.VideoCapture(str(path))
    try:
        if not cap.isOpened():
            raise DataError(f"{path}: cannot read video header (OpenCV)")
        code = int(cap.get(cv2.CAP_PROP_FOURCC))
        fourcc = "".join(chr((code >> 8 * i) & 0xFF) for i in range(4)).strip().lower()
        fps = cap.get(cv2.CAP_PROP_FPS) or None
        n = int(cap.get(cv2.CAP_PROP_FRAME_COUNT)) or None
        return {"codec": _FOURCC_CODECS.get(fourcc, fourcc), "width": int(cap.get(cv2.CAP_PROP_FRAME_WIDTH)),
                "height": int(cap.get(cv2.CAP_PROP_FRAME_HEIGHT)), "pix_fmt": "yuv420p", "fps": fps,
                "num_frames": n, "duration_s": n / fps if n and fps else None}
    finally:
        cap.release()
