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
    monkeypatch.setattr(TrainStep, "probe", lambda self, *a: probes.append(1) or original(self, *a))
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

    monkeypatch.setattr(TrainStep, "probe", lambda self, *a: pytest.fail("probed without compile"))
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


def test_an_eager_pass_that_does_not_fit_runs_in_slices_with_the_same_numbers(data, tmp_path, monkeypatch):
    """At the recheck the compiled blocks' CUDA graphs keep their memory beside the eager pass; an eager pass that
    runs out of memory is retried over halves of the micro-batch, which give the whole batch's numbers."""
    _fake_compiler(monkeypatch, scale=1.0)
    from dzmodel.train.step import TrainStep

    original, calls = TrainStep.probe, []

    def probe(self, batch, parts=1):
        calls.append(parts)
        if len(calls) in (1, 4):  # each check's first pass is the eager one
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (stand-in)")
        return original(self, batch, parts)

    monkeypatch.setattr(TrainStep, "probe", probe)
    history = train(_cfg(data, tmp_path / "run", compile=True, save_every=0, steps=22, log_every=11))
    assert len(history) == 22
    assert calls == [1, 2, 1, 1, 2, 1]  # eager whole (out of memory), eager halves, compiled whole; twice



def _fake_step_compiler(monkeypatch, scale: float):
    """A stand-in for torch.compile that also takes the step's whole forward and loss (a tuple of losses)."""
    compiled = []

    def compile(fn, *args, **kwargs):
        def run(*a, **k):
            out = fn(*a, **k)
            return tuple(x * scale for x in out) if isinstance(out, tuple) else out * scale
        compiled.append(getattr(fn, "__name__", type(fn).__name__))
        return run

    monkeypatch.setattr(torch, "compile", compile)
    return compiled


def test_compile_scope_step_compiles_the_forward_and_loss_once_and_is_checked(data, tmp_path, monkeypatch):
    compiled = _fake_step_compiler(monkeypatch, scale=1.0)
    history = train(_cfg(data, tmp_path / "run", compile=True, compile_scope="step", save_every=0, steps=3))
    assert compiled == ["model_losses"] and len(history) == 3  # one compile: not one per block

    _fake_step_compiler(monkeypatch, scale=1.5)
    with pytest.raises(RuntimeError, match="compiled model disagrees with the eager one"):
        train(_cfg(data, tmp_path / "bad", compile=True, compile_scope="step"))


def test_compile_scope_step_is_refused_under_fsdp_and_with_whole_block_recompute(data, tmp_path):
    from dzmodel.train.trainer import Trainer

    with pytest.raises(ValueError, match="compile_scope: step compiles one-shape micro-batches"):
        _cfg(data, tmp_path / "run", compile=True, compile_scope="step", activation_checkpointing="full")
    trainer = Trainer(_cfg(data, tmp_path / "run", compile=True, compile_scope="step", sharding="full"))
    with pytest.raises(ValueError, match="under FSDP2 use compile_scope: blocks"):
        trainer.build_model(shard_one_process=True)
