"""The new-robot example of docs/training.md stays valid: its embodiment parses and its train config loads."""

import re
from pathlib import Path

import yaml

from dzmodel.data.embodiments import parse_embodiment
from dzmodel.model.args import preset
from dzmodel.train.config import TrainConfig

DOC = Path(__file__).resolve().parents[2] / "docs" / "training.md"


def _blocks() -> dict[str, dict]:
    found = {}
    for block in re.findall(r"```yaml\n(.*?)```", DOC.read_text(), flags=re.S):
        first = block.splitlines()[0]
        found[first] = yaml.safe_load(block)
    return found


def test_the_humanoid_example_parses():
    blocks = _blocks()
    emb_doc = next(v for k, v in blocks.items() if "an embodiment" in k)
    cfg_doc = next(v for k, v in blocks.items() if "a train config" in k)
    emb = parse_embodiment("humanoid26", emb_doc["humanoid26"], str(DOC))
    assert [k.dim for k in emb.state] == [26] and emb.action_horizon == 16
    cfg = TrainConfig.from_dict(cfg_doc)
    assert cfg.embodiment == "humanoid26" and cfg.skip_missing
    assert preset(cfg.preset, **cfg.model_overrides).num_action_per_block == emb.action_horizon
