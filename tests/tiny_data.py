"""A small training set for the tiny preset: the embedded synthetic dataset seen through a YAML-only embodiment
(`tabletop_pusher`, action horizon 4 = the tiny preset's chunk), with its metadata.json."""

from pathlib import Path

from dzmodel.data.dataset import embodiment_metadata
from dzmodel.data.embodiments import get_embodiment, load_embodiments
from dzmodel.data.synth import make_synthetic_dataset

TABLETOP_EMBODIMENT = """
tabletop_pusher:
  views: {front: observation.images.image, hand: observation.images.wrist_image}
  view_size: [32, 32]
  layout: [[front, hand]]
  state: {state: {column: observation.state}}
  action: {actions: {column: action}}
  action_horizon: 4
  color_jitter: {brightness: 0.2, hue: 0.05}
  sampling: multi_anchor
"""


def make_tabletop_data(root: Path, num_episodes: int = 3, episode_length: int = 40) -> Path:
    """root/ds (dataset), root/emb.yaml, root/meta.json; returns root."""
    ds = make_synthetic_dataset(root / "ds", num_episodes=num_episodes, episode_length=episode_length,
                                image_size=32, codec="libx264")
    (root / "emb.yaml").write_text(TABLETOP_EMBODIMENT)
    emb = get_embodiment("tabletop_pusher", load_embodiments([root / "emb.yaml"]))
    embodiment_metadata(ds, emb, root / "meta.json")
    return root


def make_one_step_run(root: Path) -> Path:
    """make_tabletop_data (2 episodes of 30 frames) and a one-step tiny training run with its DCP checkpoint at
    root/run; returns root."""
    from dzmodel.train.config import TrainConfig
    from dzmodel.train.trainer import train

    make_tabletop_data(root, num_episodes=2, episode_length=30)
    train(TrainConfig(preset="tiny", datasets=[str(root / "ds")], embodiment="tabletop_pusher",
                      embodiment_files=[str(root / "emb.yaml")], metadata=str(root / "meta.json"), steps=1,
                      save_every=1, out_dir=str(root / "run"), progress=False))
    return root


# libero_sim at 32 px per view (LIBERO's 8-dim state and horizon 16): the vision stage's and the probe's tests, on
# orbit scenes, where the block's position (state[0:3]) moves with the frames along the same circle every episode
LIBERO32_EMBODIMENT = """
libero_sim_32:
  tag_id: 21
  views: {image: observation.images.image, wrist_image: observation.images.wrist_image}
  view_size: [32, 32]
  layout: [[image, wrist_image]]
  state: {state: {column: observation.state, dim: 8}}
  action: {actions: {column: action, dim: 7}}
  action_horizon: 16
  color_jitter: {brightness: 0.2, hue: 0.05}
  sampling: multi_anchor
"""


def make_libero32_data(root: Path, num_episodes: int = 6, episode_length: int = 40) -> Path:
    """root/ds (orbit scenes at 32 px), root/emb.yaml (libero_sim_32), root/meta.json; returns root."""
    ds = make_synthetic_dataset(root / "ds", num_episodes=num_episodes, episode_length=episode_length,
                                image_size=32, codec="libx264", motion="orbit")
    (root / "emb.yaml").write_text(LIBERO32_EMBODIMENT)
    emb = get_embodiment("libero_sim_32", load_embodiments([root / "emb.yaml"]))
    embodiment_metadata(ds, emb, root / "meta.json")
    return root
