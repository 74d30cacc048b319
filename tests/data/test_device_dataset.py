"""The device-resident data path (dzmodel/data/device_dataset.py) against the CPU loader: with augmentation off the
same batches for the same stream positions (keys, shapes, dtypes, values), each (episode, view) decoded once."""

from dataclasses import replace

import pytest
import torch

from dzmodel.data.collate import Collator
from dzmodel.data.dataset import MixtureDataset, WindowDataset, embodiment_metadata, load_statistics
from dzmodel.data.device_dataset import DeviceData
from dzmodel.data.embodiments import load_embodiments
from dzmodel.data.lerobot_format import LeRobotReader, open_dataset
from dzmodel.data.sampling import SampleStream, WindowSpec
from dzmodel.data.synth import make_synthetic_dataset
from dzmodel.model.tokenizer import build_tiny_tokenizer, load_tokenizer

# Two robots on the same recording: the plain two-view layout, and one with a relative action key (the block's
# position relative to the state at each chunk's anchor), sliced keys, a view stretched over a row and fixed windows.
YAML = """
plain:
  views: {front: observation.images.image, hand: observation.images.wrist_image}
  view_size: [32, 32]
  layout: [[front, hand]]
  state: {state: {column: observation.state}}
  action: {actions: {column: action}}
  action_horizon: 4
  prompt_template: "the robot will {instruction}."
  crop_scale: 0.9
  color_jitter: {brightness: 0.3, contrast: 0.4, saturation: 0.5, hue: 0.08}
relative:
  tag_id: 7
  views: {front: observation.images.image, hand: observation.images.wrist_image}
  view_size: [32, 32]
  layout: [["hand*2"], [front, hand]]
  state: {xy: {column: observation.state, slice: [0, 2]}, rest: {column: observation.state, slice: [2, 8]}}
  action: {xy: {column: action, slice: [0, 2]}, rest: {column: action, slice: [2, 7]}}
  relative_action_keys: [xy]
  action_horizon: 4
  crop_scale: 0.95
  sampling: fixed_window
"""
TEXT_LEN, MAX_STATE, MAX_ACTION = 16, 10, 9


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("device_data")
    dataset = make_synthetic_dataset(root / "ds", num_episodes=3, episode_length=40, image_size=32, codec="libx264",
                                     seed=2)
    (root / "robots.yaml").write_text(YAML)
    registry = load_embodiments([root / "robots.yaml"])
    for tag in ("plain", "relative"):
        embodiment_metadata(dataset, registry[tag], root / "meta.json", merge=tag != "plain")
    tok = load_tokenizer(build_tiny_tokenizer(root / "tok"))
    return dataset, registry, root / "meta.json", tok


def _windows(setup, tag, train, episodes=None, **changes):
    dataset, registry, meta, _ = setup
    emb = replace(registry[tag], **changes)
    spec = WindowSpec(2, emb.action_horizon, 8, emb.sampling)
    return WindowDataset(open_dataset(dataset), emb, spec, load_statistics(meta, emb.tag), train=train, seed=3,
                         episodes=episodes)


@pytest.mark.parametrize("tag", ["plain", "relative"])
def test_without_augmentation_a_batch_is_the_cpu_loaders(setup, tag):
    tok = setup[3]
    ds = _windows(setup, tag, train=False)
    collate = Collator(tok, TEXT_LEN, MAX_STATE, MAX_ACTION)
    device = DeviceData([ds], "cpu", tok, TEXT_LEN, MAX_STATE, MAX_ACTION, train=False, seed=3)
    stream = SampleStream([len(ds)], seed=3)
    mixture = MixtureDataset([ds])
    for start in (0, len(ds) - 2, 5 * len(ds) + 1):  # into the second and the sixth epoch too
        items = [stream.peek(start + i) for i in range(4)]
        cpu = collate([mixture[item] for item in items])
        dev = device.batch(items)
        assert set(dev) == set(cpu)
        for key in cpu:
            assert dev[key].dtype == cpu[key].dtype and dev[key].shape == cpu[key].shape, key
            assert torch.equal(dev[key], cpu[key]), key
        assert dev["position"].device.type == "cpu"


def test_the_batches_follow_the_stream_and_augment_per_position(setup):
    tok = setup[3]
    ds = _windows(setup, "plain", train=True)
    device = DeviceData([ds], "cpu", tok, TEXT_LEN, MAX_STATE, MAX_ACTION, train=True, seed=3)
    stream = SampleStream([len(ds)], seed=3)
    stream.position = 6
    it = device.batches(stream, 3)
    first, second = next(it), next(it)
    assert first["position"].tolist() == [6, 7, 8] and second["position"].tolist() == [9, 10, 11]
    again = device.batch([stream.peek(7)])  # one sample alone: the same augmentation as inside the batch
    assert torch.equal(again["images"][0], first["images"][1])
    plain = DeviceData([_windows(setup, "plain", train=False)], "cpu", tok, TEXT_LEN, MAX_STATE, MAX_ACTION,
                       train=False, seed=3).batch([stream.peek(i) for i in range(6, 9)])
    assert not torch.equal(plain["images"], first["images"])  # augmented
    for key in ("state", "action", "text", "action_mask"):
        assert torch.equal(plain[key], first[key])  # only the images are augmented


def test_a_mixture_batch_keeps_the_stream_order(setup):
    tok = setup[3]
    a, b = _windows(setup, "plain", False, episodes=[0, 1]), _windows(setup, "plain", False, episodes=[2])
    device = DeviceData([a, b], "cpu", tok, TEXT_LEN, MAX_STATE, MAX_ACTION, train=False, seed=3)
    stream = SampleStream([len(a), len(b)], [1.0, 1.0], seed=3)
    items = [stream.peek(i) for i in range(8)]
    assert len({ds for ds, _, _ in items}) == 2
    mixed = device.batch(items)
    for i, item in enumerate(items):
        one = device.batch([item])
        assert all(torch.equal(mixed[k][i], one[k][0]) for k in one), i


def test_each_episode_and_view_is_decoded_once(setup, monkeypatch):
    tok = setup[3]
    calls = []
    read = LeRobotReader.read_frames
    monkeypatch.setattr(LeRobotReader, "read_frames", lambda self, *a, **k: calls.append(a[:2]) or read(self, *a, **k))
    ds = _windows(setup, "plain", train=True)
    device = DeviceData([ds], "cpu", tok, TEXT_LEN, MAX_STATE, MAX_ACTION, train=True, seed=3, decode_workers=2)
    stream = SampleStream([len(ds)], seed=3)
    batches = device.batches(stream, 4)
    for _ in range(10):
        next(batches)
    expected = {(e, k) for e in range(3) for k in ds.emb.views.values()}
    assert sorted(calls) == sorted(expected) and device.decodes == len(expected)  # none per sample
    assert device.nbytes == 3 * 40 * 32 * 32 * 3 * 2


def test_a_recording_larger_than_the_crop_needs_is_kept_smaller(setup):
    """32 px frames for 16 px views at crop 0.95 are kept at ceil(16 / 0.95) = 17 px (a quarter of the memory): the
    images are the CPU transforms of the frames downscaled once (the crop margin kept)."""
    from dzmodel.data.device_dataset import _resize_uint8
    from dzmodel.data.transforms import transform_view

    tok = setup[3]
    ds = _windows(setup, "plain", train=False, view_size=(16, 16), crop_scale=0.95)
    device = DeviceData([ds], "cpu", tok, TEXT_LEN, MAX_STATE, MAX_ACTION, train=False, seed=3)
    assert device.nbytes == 3 * 40 * 17 * 17 * 3 * 2
    items = [SampleStream([len(ds)], seed=3).peek(i) for i in range(4)]
    dev = device.batch(items)
    assert dev["images"].shape == (4, 17, 16, 32, 3)
    for b, (_, anchor, _) in enumerate(items):
        w = ds.index.window(anchor)
        for j, key in enumerate(ds.emb.views.values()):
            frames = _resize_uint8(ds.reader.read_frames(w.episode, key, w.frames.tolist()), (17, 17))
            want = transform_view(frames, (16, 16), False, None, 0.95)
            assert torch.equal(dev["images"][b, :, :, 16 * j:16 * (j + 1)], want)


def _fake_encode(calls):
    """A stand-in for the frozen encoders: latents that identify the images, the text as its context."""
    from dzmodel.model.conditioning import EncodedBatch

    def encode(batch):
        calls.append(batch["images"].shape[0])
        images = batch["images"].float()
        return EncodedBatch(clean_latents=images.flatten(1)[:, ::97][:, :64].reshape(-1, 4, 1, 4, 4),
                            context=batch["text"].float()[:, :, None], clip_feature=images.flatten(1)[:, -8:, None],
                            y=None)
    return encode


def test_encoded_copies_replace_the_images_and_cycle_with_each_pass(setup):
    tok = setup[3]
    ds = _windows(setup, "plain", train=True)
    N = len(ds)
    live = DeviceData([ds], "cpu", tok, TEXT_LEN, MAX_STATE, MAX_ACTION, train=True, seed=3)
    encoded = DeviceData([ds], "cpu", tok, TEXT_LEN, MAX_STATE, MAX_ACTION, train=True, seed=3)
    calls = []
    encoded.encode_variants(_fake_encode(calls), variants=2, batch_size=5)
    assert sum(calls) == 2 * N and max(calls) == 5  # every window twice, in batches, and never again
    stream = SampleStream([N], seed=3)
    passes = {}
    for e in range(3):
        items = [stream.peek(e * N + i) for i in range(4)]
        batch = encoded.batch(items)
        assert "images" not in batch and batch["position"].tolist() == [e * N + i for i in range(4)]
        copy = e % 2
        for i, (d, anchor, _) in enumerate(items):
            # copy v of a window is that window augmented as stream position v·N + anchor is
            one = live.batch([(d, anchor, copy * N + anchor)])
            expect = _fake_encode([])(one)
            assert torch.equal(batch["clean_latents"][i], expect.clean_latents[0]), (e, i)
            assert torch.equal(batch["clip_feature"][i], expect.clip_feature[0])
            assert torch.equal(batch["context"][i], expect.context[0])
            for key in ("state", "action", "action_mask", "has_real_action"):
                assert torch.equal(batch[key][i], live.batch([items[i]])[key][0]), key
        passes[e] = {a: batch["clean_latents"][i] for i, (_, a, _) in enumerate(items)}
    shared = set(passes[0]) & set(passes[1])
    assert shared and all(not torch.equal(passes[0][a], passes[1][a]) for a in shared)  # pass 1: the other copy
    assert all(torch.equal(passes[0][a], passes[2][a]) for a in set(passes[0]) & set(passes[2]))  # pass 2: copy 0
