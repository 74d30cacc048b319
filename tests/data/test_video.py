"""Video decode (torchcodec batched / PyAV seek) and encode (PyAV), AV1 and H.264."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("av")

from dzmodel.data import video as V  # noqa: E402
from dzmodel.data.errors import DataError  # noqa: E402
from tests.data.lerobot_writers import frame_id, frame_rgb  # noqa: E402

HAS_TC = V.torchcodec_available()
BACKENDS = ["pyav"] + (["torchcodec"] if HAS_TC else [])
CODECS = ["libsvtav1", "libx264"]
N = 20
FPS = 10


@pytest.fixture(scope="module")
def videos(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("videos")
    frames = np.stack([frame_rgb(1, i) for i in range(N)])
    return {c: V.encode_video(base / f"{c}.mp4", frames, FPS, codec=c) for c in CODECS}


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_right_frames(videos, codec, backend):
    want = [5, 0, 19, 5, 7, 1, 19]  # unsorted, duplicates, last frame
    out = V.decode_frames(videos[codec], [i / FPS for i in want], backend=backend)
    assert out.dtype == np.uint8 and out.shape == (len(want), 48, 64, 3) and out.flags.c_contiguous
    assert [frame_id(f) for f in out] == [(1, i) for i in want]
    ref = np.stack([frame_rgb(1, i) for i in want]).astype(int)
    assert np.abs(out.astype(int) - ref).max() <= 6  # codec + colour conversion error


@pytest.mark.skipif(not HAS_TC, reason="torchcodec cannot be loaded here")
@pytest.mark.parametrize("codec", CODECS)
def test_torchcodec_matches_pyav(videos, codec):
    ts = [i / FPS for i in range(N)]
    a = V.decode_frames(videos[codec], ts, backend="torchcodec").astype(int)
    b = V.decode_frames(videos[codec], ts, backend="pyav").astype(int)
    assert np.abs(a - b).max() <= 2


@pytest.mark.skipif(not HAS_TC, reason="torchcodec cannot be loaded here")
@pytest.mark.parametrize("seek_mode", ["exact", "approximate"])
def test_torchcodec_seek_modes(videos, seek_mode):
    out = V.decode_frames(videos["libsvtav1"], [0.3, 0.1], backend="torchcodec", seek_mode=seek_mode)
    assert [frame_id(f) for f in out] == [(1, 3), (1, 1)]


@pytest.mark.skipif(not HAS_TC, reason="torchcodec cannot be loaded here")
def test_torchcodec_uses_one_batched_call(videos, monkeypatch):
    V.clear_decoder_cache()
    dec = V._torchcodec_decoder(Path(videos["libx264"]), "approximate")
    calls = []
    real = dec.get_frames_at

    class Spy:
        metadata = dec.metadata

        def get_frames_at(self, indices):
            calls.append(list(indices))
            return real(indices=indices)

    monkeypatch.setattr(V, "_torchcodec_decoder", lambda path, mode: Spy())
    V.decode_frames(videos["libx264"], [0.9, 0.2, 0.9, 0.0], backend="torchcodec")
    assert calls == [[0, 2, 9]]


def test_nearest_frame_and_tolerance(videos):
    for backend in BACKENDS:
        out = V.decode_frames(videos["libx264"], [0.3004], backend=backend)  # within 1 ms of frame 3
        assert frame_id(out[0]) == (1, 3)
        out = V.decode_frames(videos["libx264"], [0.34], backend=backend, tolerance_s=0.05)
        assert frame_id(out[0]) == (1, 3)
        with pytest.raises(DataError, match="tolerance"):
            V.decode_frames(videos["libx264"], [0.34], backend=backend)
        with pytest.raises(DataError, match="past the end"):
            V.decode_frames(videos["libx264"], [N / FPS + 0.5], backend=backend)


def test_empty_request(videos):
    assert V.decode_frames(videos["libx264"], [], backend="pyav").shape[0] == 0


def test_missing_video(tmp_path):
    p = tmp_path / "nope.mp4"
    for backend in BACKENDS:
        with pytest.raises(DataError, match="missing") as ei:
            V.decode_frames(p, [0.0], backend=backend)
        assert str(p) in str(ei.value)


@pytest.mark.parametrize("how", ["garbage", "truncated"])
def test_corrupt_video(videos, tmp_path, how):
    p = tmp_path / "bad.mp4"
    data = Path(videos["libsvtav1"]).read_bytes()
    p.write_bytes(os.urandom(4096) if how == "garbage" else data[: len(data) // 3])
    for backend in BACKENDS:
        with pytest.raises(DataError) as ei:
            V.decode_frames(p, [0.0, 1.5], backend=backend)
        assert str(p) in str(ei.value)


def test_backend_selection():
    assert V.resolve_backend("auto") == ("torchcodec" if HAS_TC else "pyav")
    assert V.resolve_backend("pyav") == "pyav"
    with pytest.raises(DataError, match="not one of"):
        V.resolve_backend("ffmpeg")


HAS_CV2 = V._module_available("cv2")


@pytest.mark.skipif(not HAS_CV2, reason="OpenCV is not installed")
def test_opencv_matches_pyav_on_h264(videos):
    want = [5, 0, 19, 5, 7, 1, 19, 12, 13]  # unsorted, duplicates, a seek back and a short skip ahead
    a = V.decode_frames(videos["libx264"], [i / FPS for i in want], backend="opencv")
    b = V.decode_frames(videos["libx264"], [i / FPS for i in want], backend="pyav")
    assert [frame_id(f) for f in a] == [(1, i) for i in want]
    assert np.abs(a.astype(int) - b).max() <= 2


def _opencv_reads(path: Path) -> bool:
    """Whether this OpenCV build decodes the file: which codecs it reads depends on the build (opencv-python 5.1's
    wheels read AV1, earlier ones did not), so the tests ask it instead of assuming."""
    import cv2

    cap = cv2.VideoCapture(str(path))
    try:
        return bool(cap.isOpened() and cap.read()[0])
    finally:
        cap.release()


@pytest.mark.skipif(not HAS_CV2, reason="OpenCV is not installed")
@pytest.mark.parametrize("codec", CODECS)
def test_opencv_reads_what_its_build_decodes_and_names_the_codec_it_cannot(videos, codec):
    if _opencv_reads(videos[codec]):
        out = V.decode_frames(videos[codec], [0.4, 0.0], backend="opencv")
        assert [frame_id(f) for f in out] == [(1, 4), (1, 0)]
    else:
        with pytest.raises(DataError, match=f"codec {V.video_info(videos[codec])['codec']}; this OpenCV build"):
            V.decode_frames(videos[codec], [0.0], backend="opencv")


@pytest.mark.skipif(not HAS_CV2, reason="OpenCV is not installed")
def test_opencv_refusal_names_the_codec_and_the_build(videos):
    """The refusal's reason on a file of a known codec, whatever this build reads."""
    import cv2

    cap = cv2.VideoCapture(str(videos["libsvtav1"]))
    try:
        why = V._opencv_cannot(videos["libsvtav1"], cap)
    finally:
        cap.release()
    assert f"codec {V.video_info(videos['libsvtav1'])['codec']}" in why
    assert f"this OpenCV build, {cv2.__version__}, cannot decode it" in why and "--codec h264" in why


@pytest.mark.skipif(not HAS_CV2, reason="OpenCV is not installed")
def test_opencv_names_a_file_it_cannot_open(tmp_path):
    bad = tmp_path / "not_a_video.mp4"
    bad.write_bytes(b"\0" * 256)  # no build opens this
    with pytest.raises(DataError, match="not_a_video.mp4: OpenCV cannot open this video \\(its codec is unknown"):
        V.decode_frames(bad, [0.0], backend="opencv")


def test_auto_uses_opencv_without_torchcodec_and_pyav(monkeypatch):
    monkeypatch.setattr(V, "_torchcodec_checked", True)
    monkeypatch.setattr(V, "_torchcodec_error", "RuntimeError: no libavutil")
    monkeypatch.setattr(V, "_module_available", lambda name: name == "cv2")
    assert V.resolve_backend("auto") == "opencv"


def test_auto_falls_back_to_pyav(videos, monkeypatch):
    monkeypatch.setattr(V, "_torchcodec_checked", True)
    monkeypatch.setattr(V, "_torchcodec_error", "RuntimeError: no libavutil")
    assert V.resolve_backend("auto") == "pyav"
    with pytest.raises(DataError, match="torchcodec cannot be loaded.*no libavutil"):
        V.resolve_backend("torchcodec")
    out = V.decode_frames(videos["libx264"], [0.4], backend="auto")
    assert frame_id(out[0]) == (1, 4)


@pytest.mark.parametrize("codec,name", [("av1", "libdav1d"), ("h264", "h264")])
def test_encode_codecs_and_atomic(tmp_path, codec, name):
    frames = np.stack([frame_rgb(0, i) for i in range(4)])
    p = V.encode_video(tmp_path / "sub" / "v.mp4", frames, 15, codec=codec)
    info = V.video_info(p)
    assert info["codec"] in (name, {"libdav1d": "av1"}.get(name, name), "libaom-av1")
    assert (info["width"], info["height"], info["pix_fmt"], info["num_frames"]) == (64, 48, "yuv420p", 4)
    assert info["fps"] == 15
    assert sorted(x.name for x in p.parent.iterdir()) == ["v.mp4"]  # no temp file left


def test_encode_fractional_fps(tmp_path):
    frames = np.stack([frame_rgb(0, i) for i in range(3)])
    p = V.encode_video(tmp_path / "v.mp4", frames, 29.97, codec="h264")
    assert V.video_info(p)["fps"] == pytest.approx(29.97, abs=1e-3)


@pytest.mark.parametrize(
    "frames,match",
    [
        (np.zeros((0, 48, 64, 3), np.uint8), "non-empty"),
        (np.zeros((2, 48, 64, 3), np.float32), "uint8"),
        (np.zeros((2, 48, 64), np.uint8), r"\[T,H,W,3\]"),
        (np.zeros((2, 47, 64, 3), np.uint8), "even"),
    ],
)
def test_encode_rejects_bad_frames(tmp_path, frames, match):
    with pytest.raises(DataError, match=match):
        V.encode_video(tmp_path / "v.mp4", frames, 10)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(DataError, match="codec"):
        V.encode_video(tmp_path / "v.mp4", np.zeros((1, 2, 2, 3), np.uint8), 10, codec="vp9")


@pytest.mark.parametrize("fmt", ["png", "jpeg"])
def test_image_bytes_roundtrip(fmt):
    img = frame_rgb(2, 7, 1)
    data = V.encode_image_bytes(img, fmt)
    out = V.decode_image_bytes(data)
    assert out.shape == img.shape and out.dtype == np.uint8
    assert np.abs(out.astype(int) - img.astype(int)).max() <= (0 if fmt == "png" else 4)
    with pytest.raises(DataError, match="my column"):
        V.decode_image_bytes(b"\x89PNG\r\n\x1a\nbroken", "my column")


def test_worker_init_fn(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    monkeypatch.setenv("MKL_NUM_THREADS", "8")
    try:
        V.worker_init_fn(0)
        assert torch.get_num_threads() == 1
        assert os.environ["OMP_NUM_THREADS"] == "1"
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not HAS_CV2, reason="OpenCV is not installed")
def test_opencv_encodes_where_pyav_is_missing(tmp_path, monkeypatch):
    """The GPU image has OpenCV but no PyAV: `dz data synth --codec h264` writes MPEG-4 Part 2 (mp4v) there, which
    OpenCV decodes; the synthetic dataset reads back through the OpenCV backend."""
    import sys

    from dzmodel.data.lerobot_format import open_dataset
    from dzmodel.data.synth import make_synthetic_dataset

    monkeypatch.setattr(V, "_module_available", lambda name: name == "cv2")
    monkeypatch.setitem(sys.modules, "av", None)  # `import av` fails
    frames = np.stack([frame_rgb(0, i, size=(32, 48)) for i in range(6)])
    p = V.encode_video(tmp_path / "v.mp4", frames, 15, codec="h264")
    info = V.video_info(p)
    assert (info["codec"], info["width"], info["height"], info["num_frames"]) == ("mpeg4", 48, 32, 6)
    out = V.decode_frames(p, [i / 15 for i in (4, 0, 5)], backend="opencv")
    assert [frame_id(f) for f in out] == [(0, 4), (0, 0), (0, 5)]
    with pytest.raises(DataError, match="PyAV is not installed"):
        V.encode_video(tmp_path / "a.mp4", frames, 15, codec="av1")  # no AV1 encoder in OpenCV
    ds = open_dataset(make_synthetic_dataset(tmp_path / "ds", num_episodes=2, episode_length=20, image_size=32,
                                             codec="libx264"))
    assert ds.features["observation.images.image"].dtype == "video"
    assert ds.read_frames(1, "observation.images.wrist_image", range(20), backend="opencv").shape == (20, 32, 32, 3)


@pytest.mark.parametrize("codec", CODECS)
def test_pyav_decodes_a_whole_episode_once_with_the_frames_a_seek_per_frame_finds(tmp_path, codec, monkeypatch):
    """Reading every frame decodes each once (it decoded from the keyframe before every frame: gop/2 times the work
    at gop 16), and gives what one seek per timestamp gives, also across a jump past PYAV_SEEK_AHEAD_S."""
    n = 48
    path = V.encode_video(tmp_path / "v.mp4", np.stack([frame_rgb(2, i) for i in range(n)]), FPS, codec=codec, gop=16)
    counted = []
    real = V._pyav_frames

    def counting(container, stream):
        for item in real(container, stream):
            counted.append(item[1])
            yield item

    monkeypatch.setattr(V, "_pyav_frames", counting)
    whole = V.decode_frames(path, [i / FPS for i in range(n)], backend="pyav")
    assert [frame_id(f) for f in whole] == [(2, i % 23) for i in range(n)]  # frame ids wrap at 23
    assert len(counted) <= n + 1, len(counted)  # a decoder may hand over one frame beyond the last wanted
    one_by_one = np.stack([V.decode_frames(path, [i / FPS], backend="pyav")[0] for i in range(n)])
    assert np.array_equal(whole, one_by_one)
    jump = [0.0, 0.1, 4.5, 4.6]  # 4.4 s ahead: a seek
    assert np.array_equal(V.decode_frames(path, jump, backend="pyav"), one_by_one[[0, 1, 45, 46]])
