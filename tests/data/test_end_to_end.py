"""A robot defined in YAML alone trains one step on a LeRobot v3.0 dataset, through the real loader."""

import json

import numpy as np
import pytest
import torch

from dzmodel.data.collate import Collator
from dzmodel.data.dataset import MixtureDataset, StreamSampler, WindowDataset, embodiment_metadata, load_statistics
from dzmodel.data.embodiments import get_embodiment, load_embodiments
from dzmodel.data.errors import DataError
from dzmodel.data.lerobot_format import open_dataset
from dzmodel.data.sampling import SampleStream, WindowSpec
from dzmodel.data.synth import make_synthetic_dataset
from dzmodel.data.video import worker_init_fn
from dzmodel.model.args import preset
from dzmodel.model.components import build_encoders
from dzmodel.model.tokenizer import build_tiny_tokenizer, load_tokenizer
from dzmodel.model.wam import DreamZeroWAM
from dzmodel.train.step import TrainStep

YAML = """
tabletop_pusher:            # a robot this code has never seen: defined here only
  tag_id: 99
  views: {front: observation.images.image, hand: observation.images.wrist_image}
  view_size: [32, 32]
  layout: [[front, hand]]
  state: {block_xy: {column: observation.state, slice: [0, 2]}, rest: {column: observation.state, slice: [2, 8]}}
  action: {block_xy: {column: action, slice: [0, 2]}, rest: {column: action, slice: [2, 7]}}
  action_horizon: 4
  relative_action_keys: []
  prompt_template: "A robot arm will {instruction}."
  crop_scale: 0.9
  color_jitter: {brightness: 0.2}
  sampling: fixed_window
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    dataset = make_synthetic_dataset(root / "ds", num_episodes=3, episode_length=40, image_size=32, seed=1)
    yaml_path = root / "robots.yaml"
    yaml_path.write_text(YAML)
    emb = get_embodiment("tabletop_pusher", load_embodiments([yaml_path]))
    embodiment_metadata(dataset, emb, root / "metadata.json")
    tok = load_tokenizer(build_tiny_tokenizer(root / "tok"))
    return dataset, emb, root / "metadata.json", tok


def test_yaml_only_embodiment_trains_one_step(setup):
    dataset, emb, meta, tok = setup
    args = preset("tiny")
    spec = WindowSpec(args.max_chunk_size, emb.action_horizon, 4 * args.num_frame_per_block, emb.sampling)
    ds = WindowDataset(open_dataset(dataset), emb, spec, load_statistics(meta, emb.tag), train=True, seed=0)
    stream = SampleStream([len(ds)], seed=0)
    loader = torch.utils.data.DataLoader(MixtureDataset([ds]), batch_size=2, sampler=StreamSampler(stream, 4),
                                         collate_fn=Collator(tok, args.text_len, args.max_state_dim, args.action_dim),
                                         num_workers=1, worker_init_fn=worker_init_fn)
    batch = next(iter(loader))
    assert batch["images"].shape == (2, 1 + 8 * args.max_chunk_size, 32, 64, 3)
    assert batch["action"].shape == (2, args.max_chunk_size * 4, args.action_dim)
    assert batch["action"][batch["action_mask"]].abs().max() <= 1.0
    torch.manual_seed(0)
    model = DreamZeroWAM(args).train()
    enc = build_encoders("tiny")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.95, 0.999), weight_decay=1e-5)
    losses = TrainStep(model, encoders=enc, attn_backend="sdpa").losses(batch)
    losses.loss.backward()
    before = model.blocks[0].self_attn.q.weight.detach().clone()
    opt.step()
    assert torch.isfinite(losses.loss) and losses.action_loss > 0 and losses.dynamics_loss > 0
    assert not torch.equal(before, model.blocks[0].self_attn.q.weight)
    assert all(p.grad is None for p in enc.vae.parameters())  # frozen encoders get no grads


def test_samples_are_reproducible_by_position(setup):
    dataset, emb, meta, _ = setup
    spec = WindowSpec(2, 4, 8, emb.sampling)
    ds = WindowDataset(open_dataset(dataset), emb, spec, load_statistics(meta, emb.tag), train=True, seed=5)
    a, b, c = ds.sample(10, position=7), ds.sample(10, position=7), ds.sample(10, position=8)
    assert torch.equal(a["images"], b["images"]) and not torch.equal(a["images"], c["images"])
    torch.testing.assert_close(a["action"], c["action"])  # augmentation touches images only
    assert a["prompt"].startswith("A robot arm will ")


def test_decoded_episode_cache_gives_the_per_window_frames(setup):
    """frame_cache_mib keeps whole decoded episodes: the same samples, one decode per (episode, camera)."""
    dataset, emb, meta, _ = setup
    spec = WindowSpec(2, 4, 8, emb.sampling)
    stats = load_statistics(meta, emb.tag)
    plain = WindowDataset(open_dataset(dataset), emb, spec, stats, train=True, seed=5)
    cached = WindowDataset(open_dataset(dataset), emb, spec, stats, train=True, seed=5, frame_cache_mib=64)
    anchors = list(range(0, len(plain), 7))
    for position, anchor in enumerate(anchors + anchors):
        assert torch.equal(plain.sample(anchor, position)["images"], cached.sample(anchor, position)["images"])
    episodes = {plain.index.window(a).episode for a in anchors}
    assert cached.frame_cache.decodes == len(episodes) * len(emb.views)  # the second pass decodes nothing
    # a budget of one episode: least recently used out, still the same frames
    one = cached.frame_cache._items[next(iter(cached.frame_cache._items))].nbytes
    small = WindowDataset(open_dataset(dataset), emb, spec, stats, train=True, seed=5, frame_cache_mib=1)
    small.frame_cache.budget = one
    for position, anchor in enumerate(anchors):
        assert torch.equal(plain.sample(anchor, position)["images"], small.sample(anchor, position)["images"])
    assert small.frame_cache.used <= one and len(small.frame_cache._items) == 1
    with pytest.raises(ValueError, match="frame_cache_mib"):
        WindowDataset(open_dataset(dataset), emb, spec, stats, frame_cache_mib=-1)


def test_dims_that_disagree_with_the_config_are_refused(setup, tmp_path):
    dataset, emb, meta, _ = setup
    bad = tmp_path / "bad.yaml"
    bad.write_text(YAML.replace("slice: [2, 8]}", "slice: [2, 12]}"))
    emb_bad = get_embodiment("tabletop_pusher", load_embodiments([bad]))
    with pytest.raises(DataError, match=r"'rest' slices \[2:12\].*observation.state.*8 dims"):
        WindowDataset(open_dataset(dataset), emb_bad, WindowSpec(2, 4), None)
    bad.write_text(YAML.replace("observation.images.image", "observation.images.top"))
    emb_bad = get_embodiment("tabletop_pusher", load_embodiments([bad]))
    with pytest.raises(DataError, match="observation.images.top"):
        WindowDataset(open_dataset(dataset), emb_bad, WindowSpec(2, 4), None)


def test_metadata_for_the_embodiment_has_its_keys(setup):
    _, emb, meta, _ = setup
    doc = json.loads(meta.read_text())
    st = doc["tabletop_pusher"]["statistics"]
    assert set(st["state"]) == {"block_xy", "rest"} and len(st["action"]["rest"]["q99"]) == 5
    assert np.all(np.array(st["state"]["block_xy"]["q01"]) <= np.array(st["state"]["block_xy"]["q99"]))


def test_v21_av1_dataset_with_missing_videos_fails_clearly_or_skips(tmp_path):
    """A v2.1 AV1 dataset, an embodiment from YAML alone, some episodes' mp4s missing."""
    from dzmodel.cli import main
    from tests.data.lerobot_writers import CAMERAS, write_test_arm_yaml, write_v21

    root = write_v21(tmp_path / "v21", lengths=(12, 11, 13), codec="libsvtav1")
    reader = open_dataset(root)
    yaml_path = write_test_arm_yaml(tmp_path / "arm.yaml", sampling="fixed_window")
    emb = get_embodiment("test_arm", load_embodiments([yaml_path]))
    WindowDataset(reader, emb, WindowSpec(2, 4), None).sample(0)  # complete: works
    victim = reader.video_file(1, CAMERAS[-1])
    victim.unlink()
    with pytest.raises(DataError, match=r"1 video files of the views in use are missing:\n  episode 1: .*episode_000001"):
        WindowDataset(open_dataset(root), emb, WindowSpec(2, 4), None)
    assert main(["data", "check", str(root)]) == 2
    ds = WindowDataset(open_dataset(root), emb, WindowSpec(2, 4), None, skip_missing=True)
    assert {ep for ep, _ in ds.missing} == {1}
    assert {seg.episode for seg in ds.index.segments} == {0, 2}
    assert ds.sample(len(ds) - 1)["images"].shape[0] == 17

    # and `dz train` on it: refused with a pointer to skip_missing, then trained with --skip-missing
    from dzmodel.data.dataset import embodiment_metadata

    embodiment_metadata(root, emb, tmp_path / "meta.json")
    args = ["train", "--preset", "tiny", "--dataset", str(root), "--embodiment", "test_arm", "--metadata",
            str(tmp_path / "meta.json"), "--steps", "2", "--out", str(tmp_path / "run"),
            "--set", f'embodiment_files=["{yaml_path}"]', "--set", "save_every=2", "--set", "progress=false"]
    assert main(args) == 2
    assert main(args + ["--skip-missing"]) == 0
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 2 and (tmp_path / "run" / "checkpoints").is_dir()
