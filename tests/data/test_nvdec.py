"""GPU video decoding for the CPU loader (dzmodel/data/nvdec.py): the workers name each window's frames, the
training process decodes them. NVIDIA's PyNvVideoCodec needs an NVIDIA GPU; here a stand-in module with its API
(`SimpleDecoder(path, gpu_id=..., use_device_memory=..., output_color_type=...)`, `len`,
`get_batch_frames_by_index` over sorted unique indices, frames that export DLPack) decodes on the CPU with the
project's own decoder, so the requests, the index arithmetic and the augmentation are checked against the CPU
loader."""

import sys
import types
from dataclasses import replace

import numpy as np
import pytest
import torch

from dzmodel.data.collate import Collator
from dzmodel.data.dataset import MixtureDataset
from dzmodel.data.errors import DataError
from dzmodel.data.sampling import SampleStream

from . import test_device_dataset
from .test_device_dataset import MAX_ACTION, MAX_STATE, TEXT_LEN, _windows

setup = test_device_dataset.setup  # the recording and robots of the device-resident path's tests (a fixture)


def _native_planes(planes: np.ndarray, layout: str) -> np.ndarray:
    """PyAV's yuv420p planes [3H/2, W] as NVDEC's native output: NV12 (Y, then U and V interleaved) or, for
    "yuv444", planar 4:4:4."""
    h, w = planes.shape[0] * 2 // 3, planes.shape[1]
    y, rest = planes[:h], planes[h:].reshape(2, h // 2, w // 2)
    if layout == "yuv444":
        return np.concatenate([y] + [p.repeat(2, 0).repeat(2, 1) for p in rest])
    return np.concatenate([y, np.stack(list(rest), -1).reshape(h // 2, w)])


class _FakeSimpleDecoder:
    """NVDEC's decoder as the project's tests need it: RGB frames as PyAV's rgb24, NATIVE frames as NV12 built from
    PyAV's yuv420p planes (`native_layout = "yuv444"`: planar 4:4:4 instead, a layout the library may give)."""
    opened: list = []
    native_layout = "nv12"

    def __init__(self, path, gpu_id=0, use_device_memory=True, output_color_type=None, cuda_stream=0, **_):
        import av

        assert use_device_memory and output_color_type in ("RGB", "NATIVE") and cuda_stream == 0  # no stream on a CPU
        self.path, self.output = path, output_color_type
        with av.open(str(path)) as c:  # every frame, in order
            decoded = list(c.decode(c.streams.video[0]))
            self.frames = np.stack([f.to_ndarray(format="rgb24") for f in decoded])
            self.native = np.stack([_native_planes(f.to_ndarray(format="yuv420p"), self.native_layout)
                                    for f in decoded])
        _FakeSimpleDecoder.opened.append((path, output_color_type))

    def __len__(self):
        return len(self.frames)

    def get_stream_metadata(self):
        return types.SimpleNamespace(height=self.frames.shape[1], width=self.frames.shape[2])

    def get_batch_frames_by_index(self, indices):
        assert list(indices) == sorted(set(indices)), "the library asks sorted unique indices"
        frames = self.frames if self.output == "RGB" else self.native
        return [torch.from_numpy(frames[i].copy()) for i in indices]  # tensors export DLPack


class _FakeDemuxer:
    colour = ("UNSPEC", "UDEF")  # (space, range), the library's names for untagged, as LeRobot's encoders leave it
    opened: list = []

    def __init__(self, filename):
        self.filename = filename
        _FakeDemuxer.opened.append(filename)

    def ColorSpace(self):  # noqa: N802 (the library's names)
        return types.SimpleNamespace(name=self.colour[0])

    def ColorRange(self):  # noqa: N802
        return types.SimpleNamespace(name=self.colour[1])


@pytest.fixture
def fake_nvc(monkeypatch):
    module = types.SimpleNamespace(SimpleDecoder=_FakeSimpleDecoder, CreateDemuxer=_FakeDemuxer,
                                   OutputColorType=types.SimpleNamespace(RGB="RGB", NATIVE="NATIVE"))
    monkeypatch.setitem(sys.modules, "PyNvVideoCodec", module)
    monkeypatch.setattr(_FakeDemuxer, "colour", ("UNSPEC", "UDEF"))
    monkeypatch.setattr(_FakeSimpleDecoder, "native_layout", "nv12")
    _FakeSimpleDecoder.opened = []
    _FakeDemuxer.opened = []
    return module


def _paths(opened):
    return [path for path, _ in opened]


def _loaders(setup, tag, train):
    from dzmodel.data.nvdec import VideoImages

    tok = setup[3]
    host = _windows(setup, tag, train=train)
    named = _windows(setup, tag, train=train)
    video = VideoImages.attach([named], "cpu", train=train, seed=3)
    assert not named.decode_on_host
    collate = Collator(tok, TEXT_LEN, MAX_STATE, MAX_ACTION)
    return host, named, collate, video


@pytest.mark.parametrize("tag", ["plain", "relative"])
@pytest.mark.parametrize("colour", [("BT_709", "MPEG"), ("UNSPEC", "UDEF"), ("BT_601", "JPEG")])
def test_without_augmentation_the_decoded_batch_is_the_cpu_loaders(setup, fake_nvc, tag, colour, monkeypatch):
    """BT.709 or full-range video keeps the library's RGB: the batch equals the CPU loader's. Untagged video comes
    out as NV12 and is converted here: the images within 2 levels of the CPU decoder's (FFmpeg's fixed-point
    rounding), the rest equal."""
    monkeypatch.setattr(_FakeDemuxer, "colour", colour)
    host, named, collate, video = _loaders(setup, tag, train=False)
    stream = SampleStream([len(host)], seed=3)
    for start in (0, len(host) - 2):
        items = [stream.peek(start + i) for i in range(4)]
        cpu = collate([MixtureDataset([host])[item] for item in items])
        refs = collate([MixtureDataset([named])[item] for item in items])
        assert "images" not in refs and len(refs["frame_refs"]) == 4 and refs["dataset"] == [0] * 4
        gpu = video.fill(refs)
        assert set(gpu) == set(cpu)
        for key in cpu:
            assert gpu[key].dtype == cpu[key].dtype and gpu[key].shape == cpu[key].shape, key
            if key == "images" and colour == ("UNSPEC", "UDEF"):
                assert (gpu[key].int() - cpu[key].int()).abs().max() <= 2
            else:
                assert torch.equal(gpu[key], cpu[key]), key
    outputs = {output for _, output in _FakeSimpleDecoder.opened}
    native = colour == ("UNSPEC", "UDEF")  # BT.709 or full range: the library's RGB
    assert outputs == ({"NATIVE"} if native else {"RGB"})
    assert video.decoder.native_files == (video.decoder.opened if native else 0)


def test_nv12_frames_convert_as_the_cpu_decoder_does(tmp_path):
    """`nv12_to_rgb` on the NV12 planes of real H.264 frames against PyAV's own RGB (FFmpeg's converter): within
    2 levels everywhere and under 1 on average (FFmpeg rounds in fixed point); chroma read in the wrong order is
    far outside that."""
    import av

    from dzmodel.data.lerobot_writer import encode_mp4
    from dzmodel.data.nvdec import nv12_to_rgb

    rng = np.random.default_rng(0)
    base = rng.integers(0, 256, (8, 24, 40, 3), dtype=np.uint8).repeat(2, 1).repeat(2, 2)  # colour in 2x2 blocks
    encode_mp4(tmp_path / "v.mp4", base, fps=10, codec="libx264", crf=18)
    with av.open(str(tmp_path / "v.mp4")) as c:
        decoded = list(c.decode(c.streams.video[0]))
        rgb = torch.from_numpy(np.stack([f.to_ndarray(format="rgb24") for f in decoded])).int()
        nv12 = torch.from_numpy(np.stack([_native_planes(f.to_ndarray(format="yuv420p"), "nv12") for f in decoded]))
    assert nv12.shape == (8, 72, 80)
    ours = nv12_to_rgb(nv12)
    assert ours.shape == (8, 48, 80, 3) and ours.dtype == torch.uint8
    diff = (ours.int() - rgb).abs()
    assert diff.max() <= 2 and diff.float().mean() < 1.0
    assert torch.equal(nv12_to_rgb(nv12[..., None]), ours)  # the library's trailing dimension of 1
    swapped = nv12.clone()  # V before U: the conversion must read NV12's order
    swapped[:, 48:] = nv12[:, 48:].reshape(8, 24, 40, 2).flip(-1).reshape(8, 24, 80)
    assert (nv12_to_rgb(swapped).int() - rgb).abs().float().mean() > 5


def test_a_native_layout_other_than_nv12_falls_back_to_the_librarys_rgb(setup, fake_nvc, monkeypatch):
    monkeypatch.setattr(_FakeSimpleDecoder, "native_layout", "yuv444")
    host, named, collate, video = _loaders(setup, "plain", train=False)
    items = [SampleStream([len(host)], seed=3).peek(i) for i in range(2)]
    cpu = collate([MixtureDataset([host])[item] for item in items])
    gpu = video.fill(collate([MixtureDataset([named])[item] for item in items]))
    assert torch.equal(gpu["images"], cpu["images"])
    files = set(_paths(_FakeSimpleDecoder.opened))
    assert len(files) == 2 and set(_FakeSimpleDecoder.opened) == {(p, o) for p in files for o in ("NATIVE", "RGB")}
    assert video.decoder.native_files == 0 and video.decoder.opened == len(_FakeSimpleDecoder.opened)


def test_a_file_found_not_nv12_opens_with_rgb_next_time(tmp_path, fake_nvc, monkeypatch):
    from dzmodel.data.lerobot_writer import encode_mp4
    from dzmodel.data.nvdec import NvdecDecoder

    monkeypatch.setattr(_FakeSimpleDecoder, "native_layout", "yuv444")
    paths = []
    for k in range(3):
        encode_mp4(tmp_path / f"v{k}.mp4", np.full((4, 16, 16, 3), 40 * (k + 1), dtype=np.uint8), fps=10,
                   codec="libx264", crf=0)
        paths.append(str(tmp_path / f"v{k}.mp4"))
    decoder = NvdecDecoder("cpu", cache_size=2, threads=1)
    first = decoder.read(paths[0], [1])
    for path in paths[1:]:  # v0's decoder is evicted
        decoder.read(path, [0])
    assert torch.equal(decoder.read(paths[0], [1]), first)
    assert [o for p, o in _FakeSimpleDecoder.opened if p == paths[0]] == ["NATIVE", "RGB", "RGB"]


def test_a_file_is_opened_once_and_frames_come_back_in_the_order_asked(setup, fake_nvc, monkeypatch):
    from dzmodel.data.nvdec import NvdecDecoder

    monkeypatch.setattr(_FakeDemuxer, "colour", ("BT_709", "MPEG"))  # the library's RGB: equal to the CPU decoder's

    ds = _windows(setup, "plain", train=False)
    path, first = ds.reader.video_frames(1, "observation.images.image", [5, 2, 5, 0])
    dec = NvdecDecoder("cpu")
    frames = dec.read(path, first)
    want = ds.reader.read_frames(1, "observation.images.image", [5, 2, 5, 0])
    assert frames.shape == want.shape and torch.equal(frames, torch.from_numpy(want))
    dec.read(path, first[:2])
    assert dec.opened == 1 and _paths(_FakeSimpleDecoder.opened) == [path]
    with pytest.raises(DataError, match="out of range"):
        dec.read(path, [10_000])


def test_augmented_batches_follow_each_samples_position(setup, fake_nvc):
    host, named, collate, video = _loaders(setup, "plain", train=True)
    stream = SampleStream([len(host)], seed=3)
    items = [stream.peek(i) for i in range(4)]

    def images(batch_items):
        return video.fill(collate([MixtureDataset([named])[item] for item in batch_items]))["images"]

    first = images(items)
    cpu = collate([MixtureDataset([host])[item] for item in items])["images"]
    assert first.shape == cpu.shape and first.dtype == torch.uint8
    assert torch.equal(images(items[2:]), first[2:])  # a sample's crop and jitter do not depend on its batch
    plain = _loaders(setup, "plain", train=False)[3].fill(collate([MixtureDataset([named])[i] for i in items]))
    assert not torch.equal(first, plain["images"])  # augmentation on changes the images


def test_without_the_library_the_error_says_how_to_get_it(monkeypatch):
    from dzmodel.data.nvdec import NvdecDecoder

    monkeypatch.setitem(sys.modules, "PyNvVideoCodec", None)  # import fails
    with pytest.raises(DataError, match="pip install pynvvideocodec.*video_decode: cpu"):
        NvdecDecoder("cpu")


def test_image_views_are_refused_with_the_setting_to_change(setup):
    ds = _windows(setup, "plain", train=False)
    reader = ds.reader
    key = "observation.images.image"
    real = reader.features[key]
    reader.features[key] = replace(real, dtype="image")
    try:
        with pytest.raises(DataError, match="stored as images.*video_decode: cpu"):
            reader.video_frames(0, key, [0])
    finally:
        reader.features[key] = real


def test_the_config_refuses_nvdec_where_the_loader_is_not_used():
    from dzmodel.train.config import TrainConfig

    for other in ({"data_on_device": True}, {"cache": "some/cache"}, {"packing": True}):
        with pytest.raises(ValueError, match="video_decode: nvdec"):
            TrainConfig(video_decode="nvdec", **other)
    with pytest.raises(ValueError, match="video_decode must be one of"):
        TrainConfig(video_decode="gpu")


def test_the_loader_bench_measures_the_nvdec_path(tmp_path, fake_nvc):
    """`dz bench data --trainer-loader --video-decode nvdec`: the DROID-shaped windows through the same path."""
    from dzmodel.bench.loader_bench import run_loader_bench

    rows = run_loader_bench(tmp_path, workers=(0,), batches=1, micro_batch=1, episodes=1, video_decode="nvdec",
                            device="cpu", decode_threads=(1, 3))
    assert [r["decode_threads"] for r in rows] == [1, 3]
    for row in rows:
        assert row["video_decode"] == "nvdec" and row["images"] == [1, 33, 352, 640, 3] and row["samples_per_s"] > 0
        assert row["decoders"] == row["nv12_decoders"] == 3  # untagged video: NV12, converted here
    assert len(_FakeSimpleDecoder.opened) == 2 * 3  # one file per camera, in each row


def test_prefetch_yields_the_filled_batches_in_order_and_raises_the_threads_error():
    from dzmodel.data.nvdec import Prefetch

    seen = []

    def fill(batch):
        seen.append(batch["i"])
        if batch["i"] == 5:
            raise DataError("episode 5: broken video")
        return {"i": batch["i"], "images": torch.full((2,), batch["i"])}

    batches = ({"i": i} for i in range(8))
    prefetch = Prefetch(batches, fill, "cpu", depth=2)
    got = [next(prefetch)["i"] for _ in range(5)]
    assert got == [0, 1, 2, 3, 4]
    with pytest.raises(DataError, match="episode 5"):
        next(prefetch)
    prefetch.close()
    assert not prefetch._thread.is_alive()

    finite = Prefetch(({"i": i} for i in range(3)), fill, "cpu")
    assert [b["i"] for b in finite] == [0, 1, 2]  # and then StopIteration
    stopped = Prefetch(({"i": i} for i in range(100)), fill, "cpu", depth=1)
    next(stopped)
    stopped.close()  # a thread blocked on a full queue stops too
    assert not stopped._thread.is_alive()


def test_the_decoder_keeps_the_most_recently_used_files_open_and_names_a_file_it_cannot_open(tmp_path, fake_nvc):
    from dzmodel.data.lerobot_writer import encode_mp4
    from dzmodel.data.nvdec import NvdecDecoder

    paths = []
    for k in range(3):
        frames = np.full((4, 16, 16, 3), 40 * (k + 1), dtype=np.uint8)
        encode_mp4(tmp_path / f"v{k}.mp4", frames, fps=10, codec="libx264", crf=0)
        paths.append(str(tmp_path / f"v{k}.mp4"))
    decoder = NvdecDecoder("cpu", cache_size=2, threads=1)
    for path in (paths[0], paths[1], paths[0], paths[2]):  # v1 is now the least recently used
        decoder.read(path, [0])
    assert decoder.opened == 3 and list(decoder._decoders) == [paths[0], paths[2]]
    decoder.read(paths[1], [3, 1])  # evicted, so opened again; v0 goes
    assert decoder.opened == 4 and list(decoder._decoders) == [paths[2], paths[1]]
    assert _FakeDemuxer.opened == paths  # each file's colour read once, not again when its decoder is reopened
    with pytest.raises(DataError, match=r"missing\.mp4: NVDEC cannot open this video .*video_decode: cpu"):
        decoder.read(str(tmp_path / "missing.mp4"), [0])
    with pytest.raises(DataError, match="frame index out of range"):
        decoder.read(paths[1], [4])


def test_the_files_of_a_batch_decode_side_by_side_each_on_one_lane(tmp_path, fake_nvc):
    import threading
    import time

    from dzmodel.data.lerobot_writer import encode_mp4
    from dzmodel.data.nvdec import NvdecDecoder

    paths = []
    for k in range(6):
        encode_mp4(tmp_path / f"v{k}.mp4", np.full((4, 16, 16, 3), 30 * (k + 1), dtype=np.uint8), fps=10,
                   codec="libx264", crf=0)
        paths.append(str(tmp_path / f"v{k}.mp4"))
    running, most, threads_of = [0], [0], {}
    lock = threading.Lock()
    real = _FakeSimpleDecoder.get_batch_frames_by_index

    def slow(self, indices):  # a decode that takes a while, as NVDEC's does: who runs it, and how many at once
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
            threads_of.setdefault(self.path, set()).add(threading.get_ident())
        time.sleep(0.05)
        with lock:
            running[0] -= 1
        return real(self, indices)

    fake_nvc.SimpleDecoder.get_batch_frames_by_index = slow
    try:
        decoder = NvdecDecoder("cpu", threads=3)
        requests = [(p, [3, 0, 3]) for p in paths] * 2
        frames = decoder.read_many(requests)
        one_lane = NvdecDecoder("cpu", threads=1)
        assert all(torch.equal(a, one_lane.read(*r)) for a, r in zip(frames, requests))  # in request order
        assert [int(f[0, 0, 0, 0]) for f in frames[:6]] == [int(f[1, 0, 0, 0]) for f in frames[6:]]
        assert most[0] >= 2  # lanes decoded at the same time
        assert all(len(idents) == 2 for idents in threads_of.values())  # one lane thread each (and one_lane's)
        assert decoder.opened == len(paths)  # each file opened once, by its lane
        decoder.close()
        one_lane.close()
    finally:
        fake_nvc.SimpleDecoder.get_batch_frames_by_index = real
    with pytest.raises(ValueError, match="threads must be >= 1"):
        NvdecDecoder("cpu", threads=0)


def test_a_batchs_reads_are_spread_over_the_lanes_and_stay_where_their_decoders_are(tmp_path, fake_nvc):
    """Four files whose paths hash to one lane of four (as a lane per path hash would place them) still decode on
    four lanes; the next batch keeps each file on its lane (no decoder opened again). A LeRobot v3 recording holds
    a camera's episodes in one file: eight windows of one file decode on four lanes, not one, each lane opening the
    file once. Three files' 63 reads over 16 lanes: 3-5 reads a lane, at most two files each."""
    import threading
    import zlib

    from dzmodel.data.lerobot_writer import encode_mp4
    from dzmodel.data.nvdec import NvdecDecoder

    names = [f"v{k}.mp4" for k in range(200)]
    lane_of = lambda name: zlib.crc32(str(tmp_path / name).encode()) % 4  # noqa: E731
    same = [n for n in names if lane_of(n) == lane_of(names[0])][:4]
    paths = []
    for k, name in enumerate(same):
        encode_mp4(tmp_path / name, np.full((8, 16, 16, 3), 30 * (k + 1), dtype=np.uint8), fps=10, codec="libx264",
                   crf=0)
        paths.append(str(tmp_path / name))
    thread_of = {}
    real = _FakeSimpleDecoder.get_batch_frames_by_index

    def record(self, indices):
        thread_of.setdefault(self.path, set()).add(threading.get_ident())
        return real(self, indices)

    fake_nvc.SimpleDecoder.get_batch_frames_by_index = record
    try:
        decoder = NvdecDecoder("cpu", threads=4)
        decoder.read_many([(p, [0]) for p in paths])
        first = {p: next(iter(t)) for p, t in thread_of.items()}
        assert len(set(first.values())) == 4  # four lanes, not one
        decoder.read_many([(p, [1]) for p in reversed(paths)])
        assert {p: t for p, t in thread_of.items()} == {p: {first[p]} for p in paths} and decoder.opened == 4
        decoder.close()

        thread_of.clear()
        one_file = NvdecDecoder("cpu", threads=4)
        frames = one_file.read_many([(paths[0], [k]) for k in range(8)])
        assert [int(f[0, 0, 0, 0]) for f in frames] == [30] * 8
        assert len(thread_of[paths[0]]) == 4 and one_file.opened == 4  # four lanes, each with its own decoder
        one_file.read_many([(paths[0], [k]) for k in range(8)])
        assert one_file.opened == 4
        one_file.close()

        lanes16 = NvdecDecoder("cpu", threads=16)  # a micro-batch of 21 samples from three files, one per camera
        batch = [(paths[c], list(range(k, k + 5))) for k in range(21) for c in range(3)]
        lanes = lanes16._assign(batch)
        reads = [lanes.count(k) for k in range(16)]
        assert min(reads) >= 3 and max(reads) <= 5  # 63 reads over 16 lanes
        assert all(len({batch[i][0] for i in range(63) if lanes[i] == k}) <= 2 for k in range(16))
        assert all(len({lanes[i] for i in range(63) if batch[i][0] == paths[c]}) >= 5 for c in range(3))
        assert lanes16._assign(batch[::-1]) == lanes[::-1]  # the same files on the same lanes, whatever the order
        assert lanes16._assign([(paths[0], [0, 1, 2])]) == [8]  # one read: the lane at its middle
        lanes16.close()
    finally:
        fake_nvc.SimpleDecoder.get_batch_frames_by_index = real


def test_the_librarys_thread_defaults_follow_the_training_setting():
    """`NvdecDecoder`, `VideoImages.attach` and `dz bench data` decode on as many threads as `train.nvdec_threads`
    defaults to, so a caller that leaves the count out measures what training runs."""
    import inspect

    from dzmodel.bench.loader_bench import loader_rate, run_loader_bench
    from dzmodel.data.nvdec import NvdecDecoder, VideoImages
    from dzmodel.train.config import TrainConfig

    setting = TrainConfig().nvdec_threads
    assert inspect.signature(NvdecDecoder).parameters["threads"].default == setting
    assert inspect.signature(VideoImages.attach).parameters["threads"].default == setting
    assert inspect.signature(loader_rate).parameters["decode_threads"].default == setting
    assert inspect.signature(run_loader_bench).parameters["decode_threads"].default == (setting,)
