"""CI's smoke evaluation: a tiny-preset run trained on the embedded LIBERO-like data, evaluated in the real
LIBERO simulator across its two checkpoint steps (2 tasks x 1 episode x 16 steps), through `dz eval libero`."""

import csv
import json

import pytest

from dzmodel.cli import main
from dzmodel.data.dataset import embodiment_metadata
from dzmodel.data.embodiments import get_embodiment
from dzmodel.data.synth import make_synthetic_dataset
from dzmodel.train.config import TrainConfig
from dzmodel.train.trainer import train


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("smoke")
    ds = make_synthetic_dataset(root / "ds", num_episodes=2, episode_length=40)
    embodiment_metadata(ds, get_embodiment("libero_sim_tiny"), root / "meta.json")
    train(TrainConfig(preset="tiny", model_overrides={"num_action_per_block": 16}, datasets=[str(ds)],
                      embodiment="libero_sim_tiny", metadata=str(root / "meta.json"), steps=2, save_every=1,
                      out_dir=str(root / "run"), lr=1e-3, progress=False))
    return root


def test_smoke_eval_across_checkpoint_steps(run, capsys):
    out = run / "eval"
    rc = main(["eval", "libero", str(run / "run"), "--out", str(out), "--tasks", "0,1", "--episodes", "1",
               "--max-steps", "40", "--workers", "2", "--solver-steps", "2", "--cfg-scale", "1", "--videos", "1",
               "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert [(r["step"], r["task"]) for r in rows] == [(s, t) for s in ("1", "2") for t in ("0", "1", "all")]
    assert all(r["episodes"] == "1" or r["task"] == "all" for r in rows)
    episodes = list(csv.DictReader((out / "episodes.csv").open()))
    assert len(episodes) == 4 and all(int(e["steps"]) <= 40 for e in episodes)
    assert {e["note"] for e in episodes} == {""}  # no worker crashed
    per_episode = list(csv.DictReader((out / "per_episode.csv").open()))
    assert [(p["seed"], p["task"], p["init_state"], p["checkpoint_step"]) for p in per_episode] == \
        [("0", t, "0", s) for s in ("1", "2") for t in ("0", "1")]
    assert (out / "success_vs_step.png").read_bytes()[:4] == b"\x89PNG"
    assert len(list((out / "videos").glob("*.mp4"))) == 2  # one per step
    assert json.loads((out / "summary.json").read_text())["best"]["task"] == "all"
    assert (out / "converted" / "step_0000001" / "model.safetensors").is_file()
    timing = json.loads((out / "timing.json").read_text())
    assert [t["step"] for t in timing] == [1, 2] and all(t["chunks"] >= t["forwards"] >= 1 for t in timing)
    assert all(t["graph_captures"] == 0 for t in timing)  # CUDA graphs only on CUDA
    # one pool of env workers for both steps: the second step starts none (no process start, no env rebuilt)
    assert [t["env_workers_started"] for t in timing] == [2, 0]


def test_eval_errors_are_one_clear_line(run, tmp_path, capsys):
    assert main(["eval", "libero", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "neither a converted model" in capsys.readouterr().err
    assert main(["eval", "libero", str(run / "run"), "--out", str(tmp_path / "o"), "--steps", "7"]) == 2
    assert "no complete checkpoint for step(s) [7]" in capsys.readouterr().err
    assert main(["eval", "libero", str(run / "run"), "--out", str(tmp_path / "o"), "--embodiment", "libero_sim"]) == 2
    assert "trained for embodiment 'libero_sim_tiny', not 'libero_sim'" in capsys.readouterr().err
