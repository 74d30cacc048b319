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


class _FakeSimpleDecoder:
    opened: list = []

    def __init__(self, path, gpu_id=0, use_device_memory=True, output_color_type=None, **_):
        import av

        assert use_device_memory and output_color_type == "RGB"
        self.path = path
        with av.open(str(path)) as c:  # every frame, in order
            self.frames = np.stack([f.to_ndarray(format="rgb24") for f in c.decode(c.streams.video[0])])
        _FakeSimpleDecoder.opened.append(path)

    def __len__(self):
        return len(self.frames)

    def get_batch_frames_by_index(self, indices):
        assert list(indices) == sorted(set(indices)), "the library asks sorted unique indices"
        return [torch.from_numpy(self.frames[i].copy()) for i in indices]  # tensors export DLPack


@pytest.fixture
def fake_nvc(monkeypatch):
    module = types.SimpleNamespace(SimpleDecoder=_FakeSimpleDecoder, OutputColorType=types.SimpleNamespace(RGB="RGB"))
    monkeypatch.setitem(sys.modules, "PyNvVideoCodec", module)
    _FakeSimpleDecoder.opened = []
    return module


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
def test_without_augmentation_the_decoded_batch_is_the_cpu_loaders(setup, fake_nvc, tag):
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
            assert gpu[key].dtype == cpu[key].dtype and torch.equal(gpu[key], cpu[key]), key


def test_a_file_is_opened_once_and_frames_come_back_in_the_order_asked(setup, fake_nvc):
    from dzmodel.data.nvdec import NvdecDecoder

    ds = _windows(setup, "plain", train=False)
    path, first = ds.reader.video_frames(1, "observation.images.image", [5, 2, 5, 0])
    dec = NvdecDecoder("cpu")
    frames = dec.read(path, first)
    want = ds.reader.read_frames(1, "observation.images.image", [5, 2, 5, 0])
    assert frames.shape == want.shape and torch.equal(frames, torch.from_numpy(want))
    dec.read(path, first[:2])
    assert dec.opened == 1 and _FakeSimpleDecoder.opened == [path]
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
