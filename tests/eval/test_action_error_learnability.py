"""Learnability on CPU: the demo profile's real stages (generated data, held-out episodes, the encoder cache,
2-process FSDP training, convert) and the held-out action error of the trained model against the mean predictor
and the untrained model. The full fine-tune is the session's `dvc repro` of the demo on a fresh clone
(tests/conftest.py, shared with tests/test_dvc.py); the LoRA run trains here. Minutes on 2 cores, hence `slow`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dzmodel.config import StagePaths, load_params
from dzmodel.pipeline import run_stage

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _before_train(paths: StagePaths) -> tuple[Path, ...]:
    """The outputs of the stages up to the encoder cache: what a run with other train parameters shares."""
    return paths.dataset, paths.metadata.parent, paths.stage("vision"), paths.stage("cache"), paths.tokenizer


def _demo_action_error(root: Path, overrides: list[str], upstream: Path) -> dict:
    """Train and convert the demo with `overrides` from `upstream`'s outputs of the stages before train, then
    measure the held-out action error as the eval stage does."""
    from dzmodel.stages.eval import stage_action_error

    shutil.copy(ROOT / "params.yaml", root / "params.yaml")
    prof = load_params(root / "params.yaml", overrides, profile="demo").selected("demo")
    paths = StagePaths(root, "demo")
    for src, dst in zip(_before_train(StagePaths(upstream, "demo")), _before_train(paths)):
        shutil.copytree(src, dst)
    for stage in ("train", "convert"):
        run_stage(stage, prof, paths, log=lambda line: None)
    result = stage_action_error(prof, paths, root / "action_error", log=print)
    return {**result, "model": paths.stage("converted") / "step_0001000", "eval": prof.eval}


@pytest.fixture(scope="module")
def action_error(demo_repro):
    """What the eval stage of `dvc repro` measured on the demo it trained and converted."""
    clone, _ = demo_repro
    paths = StagePaths(clone, "demo")
    measured = json.loads((paths.stage("eval") / "action_error" / "action_error.json").read_text())
    prof = load_params(ROOT / "params.yaml", [], profile="demo").selected("demo")
    return {**measured, "model": paths.stage("converted") / "step_0001000", "eval": prof.eval}


@pytest.fixture(scope="module")
def lora_action_error(demo_repro, tmp_path_factory):
    """The demo as LoRA (rank 16 adapters on a frozen base, robot modules in full, under 2-process FSDP2) + EMA,
    converted merged from the EMA weights; on the full run's data and encoder cache."""
    return _demo_action_error(tmp_path_factory.mktemp("demo_lora"),
                              ["train.lora={rank: 16, alpha: 32.0}", "train.ema_decay=0.99", "convert.weights=ema"],
                              upstream=demo_repro[0])


def test_the_trained_model_beats_the_untrained_one_on_heldout_episodes(action_error):
    assert action_error["episodes"] == [18, 19]
    assert action_error["steps"][-1]["trained"] < 0.5 * action_error["untrained"]


def test_the_trained_model_beats_half_the_mean_predictor(action_error):
    """The demo's bound, with the demo's own steps and learning rate (measured: 0.09 x at step 1000)."""
    last = action_error["steps"][-1]
    assert last["step"] == 1000 and last["trained"] < 0.5 * action_error["mean_predictor"], action_error


def test_a_lora_run_learns_too(lora_action_error, action_error):
    """LoRA lowers the held-out action error as the full fine-tune does, if less on this random base
    (measured: 0.34 against full 0.07, untrained 0.90, mean predictor 0.36)."""
    last = lora_action_error["steps"][-1]
    assert last["trained"] < 0.5 * lora_action_error["untrained"], lora_action_error
    print(f"held-out action error at step {last['step']}: LoRA {last['trained']:.4f}, "
          f"full {action_error['steps'][-1]['trained']:.4f}, mean predictor {action_error['mean_predictor']:.4f}")


def test_the_head_to_head_scores_two_runs_on_the_same_windows(action_error, lora_action_error):
    """Promotion's comparison (`compare_action_error`): the full and the LoRA run trained on the same episodes, so
    on the candidate's held-out windows each model scores what its own evaluation measured, and the better one
    shows as better. Run from this checkout, not the DVC project: its runs record project-relative datasets, found
    from the folders above the models."""
    from dzmodel.eval.action_error import compare_action_error
    from dzmodel.stages.eval import eval_solver

    e = action_error["eval"]
    both = compare_action_error(action_error["model"], lora_action_error["model"], stride=e.action_error_stride,
                                max_windows=e.action_error_windows, device=e.device, solver=eval_solver(e), seed=e.seed)
    assert both["windows"] == action_error["windows"] and both["episodes"] == [18, 19]
    assert both["candidate"] == pytest.approx(action_error["steps"][-1]["trained"], rel=1e-4), both
    assert both["other"] == pytest.approx(lora_action_error["steps"][-1]["trained"], rel=1e-4), both
    assert both["candidate"] < both["other"]
