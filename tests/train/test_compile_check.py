"""The trainer's compile check: with `train.compile`, the compiled blocks must agree with their eager forward on
the run's first micro-batch (losses and gradient norm) before anything trains. torch 2.11's Inductor miscompiled the
small preset's blocks at micro-batch 128 on an H100, and that run diverged; here a compiler is stood in for by a
wrapper that is faithful, or that scales each block's output, so the check runs in seconds on a CPU."""

import pytest
import torch

from dzmodel.train.trainer import train
from tests.train.test_trainer import _cfg


def _fake_compiler(monkeypatch, scale: float):
    compiled = []

    def compile(fn, *args, **kwargs):
        def run(*a, **k):
            return fn(*a, **k) * scale
        compiled.append(fn)
        return run

    monkeypatch.setattr(torch, "compile", compile)
    return compiled


def test_a_faithful_compile_passes_the_check_and_trains(data, tmp_path, monkeypatch):
    compiled = _fake_compiler(monkeypatch, scale=1.0)
    probes = []
    from dzmodel.train.step import TrainStep

    original = TrainStep.probe
    monkeypatch.setattr(TrainStep, "probe", lambda self, batch: probes.append(1) or original(self, batch))
    history = train(_cfg(data, tmp_path / "run", compile=True, save_every=0, steps=22, log_every=11))
    assert compiled and len(history) == 22
    assert len(probes) == 4  # the eager and the compiled pass before the first step, and again at step 21


def test_a_miscompiled_model_is_stopped_before_it_trains(data, tmp_path, monkeypatch):
    _fake_compiler(monkeypatch, scale=1.5)  # each compiled block returns 1.5x what it should
    with pytest.raises(RuntimeError, match="compiled model disagrees with the eager one") as err:
        train(_cfg(data, tmp_path / "run", compile=True))
    assert "set train.compile: false" in str(err.value)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # no step was logged
    assert not list((tmp_path / "run").glob("checkpoints/step_*"))


def test_without_compile_there_is_no_check(data, tmp_path, monkeypatch):
    from dzmodel.train.step import TrainStep

    monkeypatch.setattr(TrainStep, "probe", lambda self, batch: pytest.fail("probed without compile"))
    assert len(train(_cfg(data, tmp_path / "run", steps=2, save_every=0))) == 2


def test_a_compile_that_goes_wrong_later_is_stopped_at_the_recheck(data, tmp_path, monkeypatch):
    """Faithful at the first micro-batch, wrong from the 10th call of a compiled block on: the recheck at step 21
    (after 20 optimizer steps) stops the run."""
    calls = []

    def compile(fn, *args, **kwargs):
        def run(*a, **k):
            calls.append(1)
            return fn(*a, **k) * (4.0 if len(calls) > 10 * 2 else 1.0)  # 2 blocks per forward
        return run

    monkeypatch.setattr(torch, "compile", compile)
    with pytest.raises(RuntimeError, match="step 21's micro-batch.*do not resume"):
        train(_cfg(data, tmp_path / "run", compile=True, steps=30, save_every=0))
