"""Activation recompute modes: same gradients, and each mode recomputes what it says (counted per op)."""

import pytest
import torch
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode

from dzmodel.train.parallelize import apply_recompute_and_compile
from tests.model.helpers import tiny_batch, tiny_model

MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.matmuls = 0
        self.layer_norms = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in MATMULS:
            self.matmuls += 1
        if func.overloadpacket in (torch.ops.aten.native_layer_norm, torch.ops.aten.layer_norm):
            self.layer_norms += 1
        return func(*args, **(kwargs or {}))


def _backward(mode: str):
    model = tiny_model(seed=3).train()
    apply_recompute_and_compile(model, mode, compile=False)
    batch = tiny_batch(model.args, batch=2)
    out = model(**batch)
    loss = out.video_pred.square().mean() + out.action_pred.square().mean()
    counter = CountOps()
    with counter:
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, counter


def test_recompute_modes_give_identical_gradients_and_recompute_what_they_claim():
    loss0, grads0, none = _backward("none")
    for mode in ("elementwise", "selective", "full"):
        loss, grads, counter = _backward(mode)
        assert torch.equal(loss, loss0), mode
        assert grads.keys() == grads0.keys()
        for name in grads0:
            torch.testing.assert_close(grads[name], grads0[name], rtol=1e-6, atol=1e-7, msg=f"{mode}: {name}")
        if mode == "elementwise":  # norms are recomputed, matmuls are not
            assert counter.matmuls == none.matmuls
            assert counter.layer_norms > none.layer_norms
        else:  # a whole-block checkpoint recomputes the block's matmuls too
            assert counter.matmuls > none.matmuls
    _, _, full = _backward("full")
    _, _, selective = _backward("selective")
    assert none.matmuls < selective.matmuls < full.matmuls  # every other block vs every block


def test_unknown_recompute_mode_is_rejected():
    with pytest.raises(ValueError, match="activation checkpointing must be one of"):
        apply_recompute_and_compile(tiny_model(), "most", compile=False)
    from dzmodel.train.config import TrainConfig
    with pytest.raises(ValueError, match="train.activation_checkpointing"):
        TrainConfig(activation_checkpointing="full:")


def test_compiled_elementwise_recompute_matches_eager():
    """The policy sits inside the compiled region (the order apply_recompute_and_compile guarantees)."""
    _, grads0, _ = _backward("none")
    torch._dynamo.reset()
    counters.clear()
    model = tiny_model(seed=3).train()
    apply_recompute_and_compile(model, "elementwise", compile=True)
    out = model(**tiny_batch(model.args, batch=2))
    (out.video_pred.square().mean() + out.action_pred.square().mean()).backward()
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(p.grad, grads0[name], rtol=1e-4, atol=1e-5, msg=name)
    assert not counters["graph_break"], dict(counters["graph_break"])  # a break would silently run eager


def test_recompute_plans():
    from dzmodel.train.parallelize import block_recompute_plan

    assert block_recompute_plan("selective", 4) == ["full", "none", "full", "none"]
    assert block_recompute_plan("full:2", 4) == ["full", "elementwise", "full", "elementwise"]
    assert block_recompute_plan("full:0", 3) == ["elementwise"] * 3
    assert block_recompute_plan("full:40", 40) == ["full"] * 40
    assert block_recompute_plan("full:31", 40).count("full") == 31
    with pytest.raises(ValueError, match=r"full:N"):
        block_recompute_plan("full:41", 40)
    with pytest.raises(ValueError, match=r"full:N"):
        block_recompute_plan("full:x", 40)


def test_fsdp_keeps_fp32_timesteps_and_modulation_under_bf16_params(tmp_path):
    """FSDP2's default input cast would round the timesteps and the per-token modulation e0 to bf16."""
    import torch.distributed as dist

    from dzmodel.train.parallelize import apply_fsdp

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        model = tiny_model(seed=1).train()
        apply_fsdp(model, "full", param_dtype="bf16", reduce_dtype="fp32", device_type="cpu")
        seen = {}
        model.register_forward_pre_hook(lambda m, args, kwargs: seen.update(timestep=kwargs["timestep"].dtype),
                                        with_kwargs=True)
        model.blocks[0].register_forward_pre_hook(lambda m, args: seen.update(e0=args[1].e0.dtype, x=args[0].dtype))
        batch = tiny_batch(model.args, batch=2)
        out = model(**batch, attn_backend="sdpa")  # no autocast, as the sharded trainer runs it
        (out.video_pred.float().square().mean() + out.action_pred.float().square().mean()).backward()
        assert seen == {"timestep": torch.float32, "e0": torch.float32, "x": torch.bfloat16}
        assert all(p.grad is not None and torch.isfinite(p.grad.full_tensor()).all()
                   for p in model.parameters() if p.requires_grad)
    finally:
        dist.destroy_process_group()


def test_elementwise_recompute_keeps_linear_outputs_but_not_lora_up_projections():
    """The guard for 5B LoRA's memory: only the up-projection (rank -> out) is recomputed, counted per op."""
    from torch.utils.checkpoint import CheckpointPolicy

    from dzmodel.train.parallelize import _recompute_elementwise_policy

    policy, mm, addmm = _recompute_elementwise_policy(), torch.ops.aten.mm.default, torch.ops.aten.addmm.default
    x, w = torch.empty(10, 64), torch.empty(64, 128)  # a base linear (tiny's FFN up)
    h, b = torch.empty(10, 4), torch.empty(4, 64)     # LoRA: rank 4 -> 64
    assert policy(None, mm, x, w) == CheckpointPolicy.MUST_SAVE
    assert policy(None, addmm, torch.empty(128), x, w) == CheckpointPolicy.MUST_SAVE
    assert policy(None, mm, x, torch.empty(64, 4)) == CheckpointPolicy.MUST_SAVE  # down-projection: small output
    assert policy(None, mm, h, b) == CheckpointPolicy.PREFER_RECOMPUTE


def test_lora_under_elementwise_recompute_gives_the_plain_gradients():
    from dzmodel.model.lora import LoRAConfig, LoRALinear, apply_lora

    grads = {}
    for mode in ("none", "elementwise"):
        model = tiny_model(seed=3).train()
        apply_lora(model, LoRAConfig(rank=4))
        for m in model.modules():
            if isinstance(m, LoRALinear):
                torch.nn.init.constant_(m.lora_b, 0.01)
        apply_recompute_and_compile(model, mode, compile=False)
        out = model(**tiny_batch(model.args, batch=2))
        (out.video_pred.square().mean() + out.action_pred.square().mean()).backward()
        grads[mode] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert any(".lora_a" in n for n in grads["none"])
    for n, g in grads["none"].items():
        torch.testing.assert_close(grads["elementwise"][n], g, rtol=1e-6, atol=1e-7, msg=n)


def test_compiling_the_blocks_limits_inductor_to_one_tiled_dimension(monkeypatch):
    """Inductor's multi-dimensional tiling miscompiled the blocks' backward."""
    import torch._inductor.config as inductor

    from dzmodel.model.args import preset
    from dzmodel.model.wam import DreamZeroWAM
    from dzmodel.train.parallelize import apply_recompute_and_compile

    monkeypatch.setattr(inductor.triton, "max_tiles", 2)
    model = DreamZeroWAM(preset("tiny"))
    apply_recompute_and_compile(model, "none", compile=False)
    assert inductor.triton.max_tiles == 2  # eager training leaves Inductor as it is
    apply_recompute_and_compile(model, "none", compile=True)  # torch.compile is lazy: nothing compiles here
    assert inductor.triton.max_tiles == 1


def test_cuda_graphs_compile_every_block_in_reduce_overhead_mode_and_need_compile(monkeypatch):
    modes = []

    def fake_compile(fn, **kwargs):
        modes.append(kwargs.get("mode"))
        return fn

    monkeypatch.setattr(torch, "compile", fake_compile)
    model = tiny_model()
    apply_recompute_and_compile(model, "none", compile=True, cuda_graphs=True)
    assert modes == ["reduce-overhead"] * len(model.blocks)
    modes.clear()
    apply_recompute_and_compile(tiny_model(), "none", compile=True)
    assert modes == [None] * len(model.blocks)
    with pytest.raises(ValueError, match="need compile"):
        apply_recompute_and_compile(tiny_model(), "none", compile=False, cuda_graphs=True)
    from dzmodel.train.config import TrainConfig
    with pytest.raises(ValueError, match="train.cuda_graphs .*needs train.compile"):
        TrainConfig(cuda_graphs=True)
    with pytest.raises(ValueError, match="train.cuda_graphs with train.activation_checkpointing 'full'"):
        TrainConfig(cuda_graphs=True, compile=True, activation_checkpointing="full")
    TrainConfig(cuda_graphs=True, compile=True, activation_checkpointing="elementwise")


def test_compile_options_reach_every_block_and_are_checked(monkeypatch):
    calls = []

    def fake_compile(fn, **kwargs):
        calls.append(kwargs)
        return fn

    monkeypatch.setattr(torch, "compile", fake_compile)
    model = tiny_model()
    apply_recompute_and_compile(model, "none", compile=True, cuda_graphs=True, compile_options={"combo_kernels": True})
    # reduce-overhead mode is Inductor's triton.cudagraphs; torch.compile takes a mode or options, not both
    assert calls == [{"options": {"combo_kernels": True, "triton.cudagraphs": True}}] * len(model.blocks)
    calls.clear()
    apply_recompute_and_compile(tiny_model(), "none", compile=True, compile_options={"aggressive_fusion": True})
    assert calls == [{"options": {"aggressive_fusion": True}}] * len(model.blocks)

    from dzmodel.train.config import TrainConfig
    TrainConfig(compile=True, compile_options={"combo_kernels": True})
    for options, error in (({"combo_kernel": True}, r"compile_options.combo_kernel: not an Inductor setting"),
                           ({"combo_kernels": 1}, r"compile_options.combo_kernels: expected a bool"),
                           ({"triton.cudagraphs": True}, r"set train.cuda_graphs instead")):
        with pytest.raises(ValueError, match=error):
            TrainConfig(compile=True, compile_options=options)
    with pytest.raises(ValueError, match="need train.compile: true"):
        TrainConfig(compile_options={"combo_kernels": True})
