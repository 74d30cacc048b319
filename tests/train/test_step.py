"""The one training step (`TrainStep`): what `dz train` and the benchmarks share, and its guards (mask built once
per shape, no host reads inside a step; on a GPU, no stream synchronisation)."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dzmodel.bench.train_bench import build_train_step, build_trainer
from dzmodel.train.synthetic import synthetic_batches
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


def test_the_noisy_action_input_is_zero_on_padded_dims():
    """Dims past the robot's own (action_mask False) get no noise: the model is fed zeros there, as at inference,
    and the real dims' noise is the draws' (unchanged by the padding)."""
    trainer, batches = _trainer(accumulation=1)
    batch = dict(next(batches))
    real = 5
    batch["action_mask"] = batch["action_mask"].clone()
    batch["action_mask"][..., real:] = False
    batch["action"] = batch["action"] * batch["action_mask"]  # as collated: zero past the robot's dims
    fed = []
    trainer.model.register_forward_pre_hook(lambda module, args: fed.append(args[3].detach().clone()))
    trainer.step.losses(batch)
    noisy = fed[0]
    assert not noisy[..., real:].any() and noisy[..., :real].abs().min() > 0
    _, aids, _, noise_a = trainer.step.draws(batch["position"], batch["clean_latents"].shape, batch["action"].shape)
    torch.testing.assert_close(noisy[..., :real], trainer.step.schedule.add_noise(batch["action"], noise_a, aids, 1)[..., :real])


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


def test_cpu_draws_are_round_2s_numbers():
    """noise_on="cpu" draws as the first trainer did (per sample, CPU generator seeded by (seed,
    position)): the same numbers on any device, for comparing a GPU run with that code."""
    trainer, _ = _trainer(accumulation=1)
    t = trainer.step
    step = TrainStep(t.model, noise_seed=3, noise_on="cpu")
    shape, ashape = (2, 8, 3, 4, 6), (2, 16, 8)
    ids, _, noise, noise_a = (x.cpu() for x in step.draws(torch.tensor([11, 4]), shape, ashape))
    for i, pos in enumerate((11, 4)):
        g = torch.Generator().manual_seed(3 * 1_000_003 + pos)
        raw = torch.randint(0, 1000, (1, 3), generator=g)
        assert ids[i, 0] == raw[0, 0] and ids[i, 1] == raw[0, 1]  # frame 0, then the block's first frame
        assert torch.equal(noise[i:i + 1], torch.randn((1, *shape[1:]), generator=g))
        assert torch.equal(noise_a[i:i + 1], torch.randn((1, *ashape[1:]), generator=g))
    with pytest.raises(ValueError, match="noise_on"):
        TrainStep(t.model, noise_on="gpu")


@pytest.mark.parametrize("noise_on", ["device", "cpu"])
def test_draws_are_uniform_timesteps_and_independent_unit_noise(noise_on):
    """Statistics of the per-sample draws over 512 consecutive positions (run on a GPU too: CUDA's generator,
    reseeded per sample, must give the same distribution as the CPU's)."""
    trainer, _ = _trainer(accumulation=1)
    step = TrainStep(trainer.step.model, noise_seed=0, noise_on=noise_on)
    n, shape, ashape = 512, (512, 4, 3, 8, 8), (512, 16, 8)
    ids, _, noise, noise_a = step.draws(torch.arange(n), shape, ashape)
    first = ids[:, 0].double().cpu()
    assert abs(first.mean().item() - 499.5) < 40 and abs(first.std().item() - 288.7) < 25  # uniform on 0..999
    deciles = torch.histc(first, bins=10, min=0, max=1000)
    assert deciles.min() > 25 and deciles.max() < 80  # 51 expected per decile
    for x in (noise, noise_a):
        x = x.double().cpu().flatten(1)
        assert abs(x.mean().item()) < 0.02 and abs(x.std().item() - 1) < 0.02
        corr = torch.corrcoef(torch.stack([x[:-1].flatten(), x[1:].flatten()]))[0, 1]
        assert abs(corr.item()) < 0.02  # consecutive positions (consecutive seeds) are independent
    assert abs(torch.corrcoef(torch.stack([first, noise.double().cpu().flatten(1)[:, 0]]))[0, 1].item()) < 0.2


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
        trainer.step.enable_prompt_dropout(1.0, pinned[0]["context"][:1].to(trainer.info.device))
        step()  # the null prompt: the host's choice reaches the device without a sync
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_the_residual_stream_in_the_compute_dtype_when_asked():
    """Under bf16 autocast with fp32 weights the tokens between blocks are fp32 (the fp32 action/state biases
    promote them); `residual_dtype` (train.residual_in_compute_dtype) keeps them in bf16, as inference with bf16
    weights runs them. The losses stay close."""
    trainer, batches = _trainer(accumulation=1)
    batch = next(batches)
    seen = []
    trainer.model.blocks[1].register_forward_pre_hook(lambda module, args: seen.append(args[0].dtype))
    losses = {}
    for dtype in (None, torch.bfloat16):
        trainer.step.residual_dtype = dtype
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses[dtype] = float(trainer.step.losses(batch).loss)
    assert seen == [torch.float32, torch.bfloat16]
    assert abs(losses[None] - losses[torch.bfloat16]) <= 0.05 * abs(losses[None])


def test_without_the_noisy_first_frame_the_loss_leaves_out_frame_0_and_nothing_else():
    """train.denoise_first_frame false: the dynamics loss is the whole sequence's over frames 1.. (same draws), the
    action loss is unchanged, and the step builds that layout's own mask."""
    from dzmodel.model.objective import flow_matching_losses

    trainer, batches = _trainer(accumulation=1)
    step, batch = trainer.step, next(batches)
    seen = []
    trainer.model.register_forward_hook(lambda module, args, out: seen.append(out) and None)
    with torch.no_grad():
        whole = step.losses(batch)
        step.denoise_first_frame = False
        without = step.losses(batch)
    assert step.mask_builds == 2
    latents = batch["clean_latents"].float()
    ids, aids, noise, noise_a = step.draws(batch["position"], latents.shape, batch["action"].shape)
    noise_a = noise_a * batch["action_mask"]
    full = seen[0]
    want = flow_matching_losses(step.schedule, full.video_pred[:, :, 1:], full.action_pred, latents[:, :, 1:],
                                noise[:, :, 1:], batch["action"], noise_a, ids[:, 1:], aids, batch["action_mask"],
                                batch["has_real_action"])
    assert seen[1].video_pred.shape[2] == latents.shape[2] - 1
    torch.testing.assert_close(without.dynamics_loss, want.dynamics_loss, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(without.action_loss, whole.action_loss, atol=1e-6, rtol=1e-5)
    assert not torch.allclose(without.dynamics_loss, whole.dynamics_loss)


def _embodiment_sample(args, latent_hw, blocks, action_dims, state_dims, position, seed):
    """One encoded sample (a batch of one) of an embodiment: its own latent grid (cameras and frame size), chunk
    count, and action and state dims within the model's (padded and masked, as the collator pads them)."""
    from dzmodel.model.synthetic import training_sample

    g = torch.Generator().manual_seed(seed)
    x = training_sample(args, latent_hw, g, blocks=blocks)
    rows = blocks * args.num_action_per_block
    mask = torch.zeros(1, rows, args.action_dim, dtype=torch.bool)
    mask[..., :action_dims] = True
    state = torch.zeros(1, blocks * args.num_state_per_block, args.max_state_dim)
    state[..., :state_dims] = torch.rand(1, state.shape[1], state_dims, generator=g)
    return {"clean_latents": x["clean_latents"], "context": x["context"], "clip_feature": x["clip_feature"],
            "state": state, "action": (torch.rand(1, rows, args.action_dim, generator=g) * 2 - 1) * mask,
            "action_mask": mask, "has_real_action": torch.ones(1, dtype=torch.bool),
            "position": torch.tensor([position])}


def _mixture(args, first_position=0):
    """A LIBERO-like sample (two views side by side, 2 chunks, 7-dim actions) and a G1-like one (one camera,
    1 chunk, 26-dim joint actions), twice each."""
    shapes = [((4, 6), 2, 7, 8), ((4, 4), 1, 26, 26)] * 2
    return [_embodiment_sample(args, hw, blocks, a, s, first_position + i, seed=i)
            for i, (hw, blocks, a, s) in enumerate(shapes)]


def _packing_step(seed=0):
    from dzmodel.model.args import preset
    from dzmodel.model.wam import DreamZeroWAM

    torch.manual_seed(seed)
    model = DreamZeroWAM(preset("tiny", action_dim=32, max_state_dim=32)).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return TrainStep(model, optimizer, attn_backend="sdpa")


def test_a_packed_micro_batch_gives_each_sample_the_loss_it_gets_alone():
    step = _packing_step()
    samples = _mixture(step.args)
    with torch.no_grad():
        packed = step.packed_losses(samples)
        alone = [step.losses(s) for s in samples]
        split = step.packed_losses(samples, capacity=max(step.model.sequence_length(
            {"noisy_latents": s["clean_latents"]}) for s in samples) + 40)  # several buffers
    for field in ("loss", "dynamics_loss", "action_loss"):
        expected = torch.stack([getattr(x, field) for x in alone]).mean()
        torch.testing.assert_close(getattr(packed, field), expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(getattr(split, field), expected, rtol=1e-5, atol=1e-6)


def test_a_mixture_of_embodiments_trains_two_packed_steps():
    step = _packing_step()
    before = {n: p.detach().clone() for n, p in step.model.named_parameters()}
    losses = []
    for k in range(2):
        out = step(iter([_mixture(step.args, first_position=4 * k)]))
        (loss, _, _), grad_norm = out.read()
        losses.append(loss)
        assert grad_norm > 0
    assert all(torch.isfinite(torch.tensor(losses)))
    moved = [n for n, p in step.model.named_parameters() if not torch.equal(p, before[n])]
    assert "action_encoder.W1.W" in moved and "blocks.0.self_attn.q.weight" in moved
    step.pack_capacity = 10
    with pytest.raises(ValueError, match="more than a buffer of 10: raise the capacity"):
        step(iter([_mixture(step.args)]))


def test_probe_over_slices_gives_the_whole_micro_batch_numbers():
    """The compile check's eager pass may run over equal slices of the micro-batch (memory): the losses are means
    over samples and each sample keeps its draws, so the slices' numbers are the whole batch's."""
    trainer = build_trainer("tiny", None, 4, False, "none", "sdpa", "cache")
    trainer.step.autocast = None  # fp32: the slices differ from the whole by summation order only
    batch = next(synthetic_batches(trainer.args, 4, (4, 6), trainer.info.device, "cache"))
    whole, norm = trainer.step.probe(batch)
    halves, norm2 = trainer.step.probe(batch, parts=2)
    quarters, norm4 = trainer.step.probe(batch, parts=4)
    assert halves == pytest.approx(whole, rel=1e-5) and quarters == pytest.approx(whole, rel=1e-5)
    assert norm2 == pytest.approx(norm, rel=1e-5) and norm4 == pytest.approx(norm, rel=1e-5)
    assert all(p.grad is None for p in trainer.step.params)
    with pytest.raises(ValueError, match="3 parts do not split a micro-batch of 4"):
        trainer.step.probe(batch, parts=3)


@pytest.mark.parametrize("recompute", ["none", "elementwise"])
def test_the_whole_step_traces_as_one_graph(recompute):
    """`train.compile_scope: step` compiles `model_losses`: the embeddings, every block (with its recompute), the
    head and the loss must trace into one graph, or the compiled step silently runs in pieces."""
    from dzmodel.train.parallelize import apply_recompute_and_compile

    trainer = build_trainer("tiny", None, 2, False, "none", "segments", "cache")
    step = trainer.step
    apply_recompute_and_compile(step.model, recompute, compile=True, scope="step")
    assert not any(hasattr(b, "_dz_eager_forward") for b in step.model.blocks)  # the blocks are not compiled alone
    step.residual_dtype = torch.bfloat16
    batch = next(synthetic_batches(trainer.args, 2, (4, 6), trainer.info.device, "cache"))
    inputs, targets = step.noised(batch)
    torch._dynamo.reset()
    with step.compute_dtype():
        explained = torch._dynamo.explain(step.model_losses)(inputs, step.mask(targets[0].shape), targets)
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons


class OpNames(TorchDispatchMode):
    """The names of the ops that run within it."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("sharded", [False, True])
def test_a_fused_adamw_clips_by_its_grad_scale_as_clip_grad_norm_would(sharded, tmp_path):
    """Clipping by the fused AdamW's grad_scale (no pass of its own over the gradients) gives clip_grad_norm_'s
    weights; under FSDP2 too (DTensor gradients and parameters, a plain scale)."""
    import torch.distributed as dist

    if sharded:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        runs = _clip_runs(sharded)
    finally:
        if sharded:
            dist.destroy_process_group()
    (plain, plain_norms, plain_scaling), (fused, fused_norms, fused_scaling) = runs[False], runs[True]
    assert plain_scaling == [["_foreach_mul_.Tensor"]] * 2  # clip_grad_norm_ scales the gradients itself
    assert fused_scaling == [[], []]  # the fused AdamW scales them as it reads them
    torch.testing.assert_close(plain_norms, fused_norms, rtol=1e-5, atol=0)
    assert bool((plain_norms > 1e-3).all())
    for a, b in zip(plain, fused):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _clip_runs(sharded: bool) -> dict:
    runs = {}
    for fused in (False, True):
        # fp32: in bf16 the weights' last-bit differences (a division for a product) grow over steps
        trainer = build_trainer("tiny", None, 2, False, "none", "sdpa", "cache", fsdp=sharded, precision="fp32")
        batches = synthetic_batches(trainer.args, 2, (4, 6), trainer.info.device, "cache")
        step = trainer.step
        # eps near the clipped gradients' size: Adam's update is otherwise blind to a gradient's scale
        step.optimizer = torch.optim.AdamW(step.params, lr=1e-2, eps=1e-6, weight_decay=0.1, fused=fused or None)
        step.grad_clip = 1e-3  # far below the tiny model's gradient norm: every step clips
        norms, scaling = [], []
        for _ in range(2):
            step.forward_backward(batches)
            with OpNames() as ops:
                norms.append(step.clip_gradients())
            scaling.append([n for n in ops.names if n.startswith("_foreach_mul")])
            step.optimizer.step()
            step.optimizer.zero_grad(set_to_none=True)
        weights = [p.detach().full_tensor() if sharded else p.detach().clone() for p in step.params]
        runs[fused] = weights, torch.stack(norms), scaling
    return runs
