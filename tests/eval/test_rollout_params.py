"""The LIBERO rollout parameters are declared once (dzmodel/eval/rollout.py): the eval stage's `eval:` section, the
evaluator's EvalConfig and `dz eval libero`'s options all carry RolloutParams' fields under the same names, ranges and
help, so a value set in params.yaml reaches the evaluator unrenamed and a command-line option cannot drift from it."""

import argparse
import re
import dataclasses

import pytest

from dzmodel.config import EvalParams
from dzmodel.eval.libero_eval import EvalConfig
from dzmodel.eval.rollout import RolloutParams, add_rollout_arguments

ROLLOUT = [f.name for f in dataclasses.fields(RolloutParams)]
SET = dict(suite="goal", tasks=[1, 3], episodes=7, max_steps=99, workers=3, camera_size=96, actions_per_chunk=4,
           context="frame", videos=0, seed=11, perturb=["camera=10"])


def test_the_example_sets_every_rollout_field():
    assert sorted(SET) == sorted(ROLLOUT)


def test_eval_params_and_eval_config_extend_the_rollout_fields_unchanged():
    for cls in (EvalParams, EvalConfig):
        own = {f.name: f for f in dataclasses.fields(cls)}
        for f in dataclasses.fields(RolloutParams):
            assert own[f.name].metadata == f.metadata and own[f.name].default == f.default, (cls, f.name)


def test_a_value_in_the_eval_section_reaches_the_evaluator_under_its_own_name():
    cfg = EvalConfig(**EvalParams(**SET).rollout())
    assert {name: getattr(cfg, name) for name in ROLLOUT} == SET


def test_dz_eval_libero_has_one_option_per_rollout_field_with_its_help_and_default():
    from dzmodel.eval.cli import rollout_options

    p = argparse.ArgumentParser()
    add_rollout_arguments(p)
    actions = {a.dest: a for a in p._actions if a.dest != "help"}
    assert sorted(actions) == sorted(ROLLOUT)
    for f in dataclasses.fields(RolloutParams):
        assert actions[f.name].help == f.metadata["help"] and actions[f.name].option_strings == \
            ["--" + f.name.replace("_", "-")]
    ns = p.parse_args(["--suite", "goal", "--tasks", "1,3", "--episodes", "7", "--max-steps", "99", "--workers", "3",
                       "--camera-size", "96", "--actions-per-chunk", "4", "--context", "frame", "--videos", "0",
                       "--seed", "11", "--perturb", "camera=10"])
    assert rollout_options(ns) == SET
    assert rollout_options(p.parse_args([])) == {f.name: f.default if f.default is not dataclasses.MISSING
                                                 else f.default_factory() for f in dataclasses.fields(RolloutParams)}


@pytest.mark.parametrize("field, value, words", [("episodes", 0, "eval.episodes: must be in [1, 10000]"),
                                                 ("camera_size", 8, "eval.camera_size: must be in [16, 1024]"),
                                                 ("context", "window", "eval.context: must be one of"),
                                                 ("suite", "kitchen", "eval.suite: must be one of")])
def test_the_evaluator_refuses_what_the_eval_section_refuses_with_the_same_field_name(field, value, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        EvalConfig(**{field: value})
