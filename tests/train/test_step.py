"""The one training step (`TrainStep`): what `dz train` and the benchmarks share, and its guards (mask built once
per shape, no host reads inside a step; on a GPU, no stream synchronisation)."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dzmodel.bench.train_bench import build_train_step, build_trainer, synthetic_batches
from dzmodel.train.step import TrainStep


class HostReads(TorchDispatchMode):
    """Counts the ops that copy a device value to a Python number (`.item()`, `float(t)`, `bool(t)`)."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
        return func(*args, **(kwargs or {}))


def _trainer(accumulation=2, encoders="cache"):
    trainer = build_trainer("tiny", None, 2, False, "none", "sdpa", encoders, accumulation=accumulation)
    return trainer, synthetic_batches(trainer.args, 2, (4, 6), trainer.info.device, encoders)


def test_a_step_reads_nothing_back_and_builds_the_mask_once():
    trainer, batches = _trainer()
    trainer.step(batches)  # first step: per-shape setup, optimizer state
    with HostReads() as mode:  # (CPU AdamW reads its step counts; CUDA's fused AdamW, guarded below, does not)
        trainer.step.forward_backward(batches)
        trainer.step.forward_backward(batches)
    assert mode.reads == 0
    assert trainer.step.mask_builds == 1
    out = trainer.step(batches)
    (loss, dynamics, action), grad_norm = out.read()  # the caller's one read, after the step
    assert loss == pytest.approx(dynamics + action) and grad_norm > 0


def test_the_host_read_guard_fails_on_an_item_call():
    trainer, batches = _trainer(accumulation=1)
    with HostReads() as mode:
        trainer.step.losses(next(batches)).loss.item()  # what the old trainer did three times per micro-batch
    assert mode.reads == 1


def test_a_new_shape_builds_one_more_mask():
    trainer, batches = _trainer(accumulation=1)
    trainer.step(batches)
    other = synthetic_batches(trainer.args, 2, (6, 6), trainer.info.device, "cache")
    trainer.step(other)
    trainer.step(other)
    assert trainer.step.mask_builds == 2


def test_draws_depend_on_the_sample_position_only():
    trainer, _ = _trainer(accumulation=1)
    step, shape, ashape = trainer.step, (3, 8, 3, 4, 6), (3, 16, 8)
    ids, aids, noise, noise_a = step.draws(torch.tensor([5, 6, 7]), shape, ashape)
    ids2, _, noise2, noise_a2 = step.draws(torch.tensor([7, 5]), (2, *shape[1:]), (2, *ashape[1:]))
    assert torch.equal(ids2[0], ids[2]) and torch.equal(noise2[1], noise[0]) and torch.equal(noise_a2[0], noise_a[2])
    assert not torch.equal(noise[0], noise[1])
    a = trainer.args  # frames of a block share the block's id; actions take their block's id
    assert torch.equal(ids[:, 1:1 + a.num_frame_per_block], ids[:, 1:2].expand(-1, a.num_frame_per_block))
    assert torch.equal(aids[:, :a.num_action_per_block], ids[:, 1:2].expand(-1, a.num_action_per_block))


def test_online_per_sample_encoding_equals_batched():
    trainer, batches = _trainer(accumulation=1, encoders="online_batched")
    batch = next(batches)
    whole = trainer.step.encode(batch)
    trainer.step.encode_per_sample = True
    each = trainer.step.encode(batch)
    torch.testing.assert_close(each.clean_latents, whole.clean_latents, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(each.context, whole.context, rtol=1e-4, atol=1e-5)


def test_a_batch_without_positions_or_encoders_is_refused():
    trainer, batches = _trainer(accumulation=1)
    batch = dict(next(batches))
    batch.pop("position")
    with pytest.raises(ValueError, match="no 'position'"):
        trainer.step.losses(batch)
    raw = dict(next(_trainer(accumulation=1, encoders="online_batched")[1]))
    with pytest.raises(ValueError, match="without encoders"):
        trainer.step.losses(raw)
    with pytest.raises(ValueError, match="wants 2 micro-batches, the data gave 1"):
        TrainStep(trainer.model, accumulation=2).forward_backward(iter([next(batches)]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA stream synchronisation is a GPU property")
def test_a_cuda_step_never_synchronises():
    step, trainer = build_train_step("tiny", None, 2, False, "elementwise", "auto", "cache", latent_hw=(4, 6))
    step()  # per-shape setup and the optimizer's state on the first step
    batches = synthetic_batches(trainer.args, 2, (4, 6), trainer.info.device, "cache")
    pinned = [{k: v.cpu().pin_memory() for k, v in next(batches).items()} for _ in range(2)]  # as the loader gives
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        step()
        trainer.step(iter(pinned))
    finally:
        torch.cuda.set_sync_debug_mode("default")
