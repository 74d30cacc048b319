"""No train/serve skew: a training sample and a served request for the same recorded frame reach the model as the
same input (the laid-out views, the prompt and the normalised state), because the loader and the policy compose
one pipeline (`dzmodel.data.transforms.EmbodimentIO`). CPU, tiny preset with random weights."""

from pathlib import Path

import numpy as np
import pytest
import torch

from dzmodel.data.dataset import WindowDataset, embodiment_metadata, load_statistics
from dzmodel.data.embodiments import get_embodiment
from dzmodel.data.lerobot_format import open_dataset
from dzmodel.data.sampling import WindowSpec
from dzmodel.data.synth import make_synthetic_dataset
from dzmodel.model.args import preset
from dzmodel.model.components import build_encoders
from dzmodel.model.conditioning import video_to_unit_range
from dzmodel.model.sampler import SolverConfig
from dzmodel.model.tokenizer import build_tiny_tokenizer, load_tokenizer
from dzmodel.model.wam import DreamZeroWAM
from dzmodel.policy.policy import EmbodiedPolicy, policy_statistics
from dzmodel.policy.sessions import build_policy
from dzmodel.serve.protocol import parse_request
from dzmodel.serve.server import BundlePolicy

EMBODIMENT = "libero_sim_tiny"  # two views side by side, served under openpi's LIBERO keys
ANCHOR = 5


@pytest.fixture(scope="module")
def recording(tmp_path_factory):
    root = tmp_path_factory.mktemp("skew")
    # 80 px frames for a 64 px view: the centre crop and the resize both do something
    ds = make_synthetic_dataset(root / "ds", num_episodes=1, episode_length=40, image_size=80, codec="libx264",
                                embodiment="libero_sim")
    emb = get_embodiment(EMBODIMENT)
    embodiment_metadata(ds, emb, root / "meta.json")
    return root, ds, emb


@pytest.fixture(scope="module")
def served(recording):
    """The embodiment's policy as `dz serve` runs it (BundlePolicy around EmbodiedPolicy), with the recording's
    statistics; every model input its sessions parse is kept in `inputs`."""
    root, _, emb = recording
    state_stats, action_stats, pairs, state_dims = policy_statistics(emb, root / "meta.json")
    torch.manual_seed(0)
    model = DreamZeroWAM(preset("tiny", num_action_per_block=emb.action_horizon))
    sessions = build_policy(model, build_encoders("tiny"), load_tokenizer(build_tiny_tokenizer(root / "tok")),
                            action_stats, state_stats, solver=SolverConfig(num_steps=1, cfg_scale=1.0),
                            image_size=emb.image_size)
    inputs = []
    parse = sessions._parse

    def keep(obs):
        out = parse(obs)
        inputs.append(out)
        return out

    sessions._parse = keep
    policy = BundlePolicy(EmbodiedPolicy(sessions, emb, pairs, None, Path(root), state_dims=state_dims))
    return policy, inputs


def training_sample(recording):
    root, ds, emb = recording
    reader = open_dataset(ds)
    spec = WindowSpec(2, emb.action_horizon, 4, emb.sampling)
    loader = WindowDataset(reader, emb, spec, load_statistics(root / "meta.json", emb.tag), train=False)
    window = loader.index.window(ANCHOR)
    assert window.frames[0] == window.state_rows[0]  # the window's first frame is its first chunk's anchor
    return reader, window, loader.sample(ANCHOR)


def served_request(reader, window, emb) -> dict:
    """The frame and state at the window's first anchor, as a robot sends them (openpi's LIBERO keys)."""
    row = int(window.frames[0])
    state = reader.read_columns(window.episode, ["observation.state"])["observation.state"]
    msg = {"observation/state": np.asarray(state[row], dtype=np.float64).reshape(-1),
           "prompt": reader.task_per_frame(window.episode)[row]}
    for proto, view in emb.wire.images.items():
        frames = reader.read_frames(window.episode, emb.views[view], [row])
        msg[proto] = np.asarray(frames[0])  # one uint8 [H, W, 3] camera frame
    return msg


def test_a_training_sample_and_a_served_request_give_the_model_the_same_input(recording, served):
    _, _, emb = recording
    policy, inputs = served
    reader, window, sample = training_sample(recording)
    request = parse_request(served_request(reader, window, emb), policy.spec, policy.state_dims)
    policy.check_request(request)
    chunk = policy.infer(request, "robot-1")
    assert chunk.shape == (emb.action_horizon, 7) and np.isfinite(chunk).all()

    (_, prompt, frames, state), = inputs
    # the prompt: the embodiment's template around the frame's task
    assert prompt == sample["prompt"]
    # the views: cropped, resized and laid out alike (uint8, bit for bit), then the model's [-1, 1] frames
    laid_out = policy.embodied.frame(request.images)
    assert laid_out.shape == (1, *emb.image_size, 3)
    np.testing.assert_array_equal(laid_out, sample["images"][:1].numpy())
    torch.testing.assert_close(frames, video_to_unit_range(sample["images"][None, :1], emb.image_size),
                               rtol=0, atol=0)
    # the state: q99-normalised with the same statistics, then padded to the model's width as the collate pads it
    width = sample["state"].shape[1]
    assert state.dtype == sample["state"].dtype == torch.float32
    torch.testing.assert_close(state[0, 0, :width], sample["state"][0], rtol=0, atol=0)
    assert not state[0, :, width:].any()
    assert not torch.equal(sample["state"][0], torch.as_tensor(request.state["state"], dtype=torch.float32))


def test_training_mode_changes_the_views_only(recording):
    """The same window in training mode differs in its views alone (random crop and colour jitter); the check above
    compares the eval-mode pipeline, which is what a served request gets."""
    root, ds, emb = recording
    spec = WindowSpec(2, emb.action_horizon, 4, emb.sampling)
    stats = load_statistics(root / "meta.json", emb.tag)
    train, plain = (WindowDataset(open_dataset(ds), emb, spec, stats, train=mode).sample(ANCHOR)
                    for mode in (True, False))
    assert not torch.equal(train["images"], plain["images"])
    torch.testing.assert_close(train["state"], plain["state"], rtol=0, atol=0)
    torch.testing.assert_close(train["action"], plain["action"], rtol=0, atol=0)
