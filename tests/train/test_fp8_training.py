"""`train.precision: fp8`: where the device runs FP8 the blocks' linears train in it; elsewhere (this CPU) the run
says so in one line and trains in bf16."""

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dzmodel.model.fp8 import fp8_linears
from dzmodel.train import trainer as trainer_mod
from dzmodel.train.config import TrainConfig
from dzmodel.train.trainer import Trainer, train


def _cfg(data, out, **kw) -> TrainConfig:
    base = dict(preset="tiny", datasets=[str(data / "ds")], embodiment="tabletop_pusher",
                embodiment_files=[str(data / "emb.yaml")], metadata=str(data / "meta.json"), tokenizer=str(data / "tok"),
                steps=2, save_every=10, out_dir=str(out), lr=1e-3, progress=False, precision="fp8")
    base.update(kw)
    return TrainConfig(**base)


def test_fp8_on_a_device_without_it_says_so_and_trains_in_bf16(data, tmp_path, capsys):
    trainer = Trainer(_cfg(data, tmp_path / "probe"))
    trainer.build_model()
    assert trainer.precision == "bf16" and fp8_linears(trainer.model) == 0
    assert trainer.step.autocast == torch.bfloat16
    history = train(_cfg(data, tmp_path / "run"))
    out = capsys.readouterr().out
    assert "precision fp8 falls back to bf16: FP8 matmuls need an NVIDIA GPU of compute capability 8.9" in out
    assert len(history) == 2 and all(math.isfinite(h["loss"]) for h in history)


def test_where_fp8_runs_the_blocks_train_through_fp8_matmuls(data, tmp_path, monkeypatch, capsys):
    # this CPU's torch runs _scaled_mm, so the FP8 path itself runs here once the device check is passed
    monkeypatch.setattr(trainer_mod, "resolve_precision", lambda requested, device: (requested, None))
    trainer = Trainer(_cfg(data, tmp_path / "probe"))
    trainer.build_model()
    assert trainer.precision == "fp8" and fp8_linears(trainer.model) > 0
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())  # master weights stay fp32
    fp8_run = train(_cfg(data, tmp_path / "fp8"))
    assert "linears of the blocks run FP8 matmuls" in capsys.readouterr().out
    kept = train(_cfg(data, tmp_path / "kept", fp8_bf16_layers=["cross_attn"]))
    assert "and the blocks' cross_attn" in capsys.readouterr().out
    assert kept[0]["loss"] != fp8_run[0]["loss"]  # the cross-attention's projections ran in bf16
    bf16_run = train(_cfg(data, tmp_path / "bf16", precision="bf16"))
    assert all(math.isfinite(h["loss"]) for h in fp8_run)
    assert fp8_run[0]["loss"] != bf16_run[0]["loss"]  # the FP8 path did run
    assert abs(fp8_run[0]["loss"] - bf16_run[0]["loss"]) < 0.1 * abs(bf16_run[0]["loss"])


@pytest.mark.slow
def test_fp8_linears_train_under_fsdp2_in_two_processes(data, tmp_path):
    cfg = _cfg(data, tmp_path / "run", steps=2, micro_batch=1, global_batch=2, save_every=2)
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg.to_dict()))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={port}", str(Path(__file__).with_name("fp8_fsdp_driver.py")), str(path)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=str(Path(__file__).parents[2]) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "linears of the blocks run FP8 matmuls" in out.stdout
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) for r in rows)
    ckpt = tmp_path / "run" / "checkpoints" / "step_0000002"
    assert (ckpt / "__0_0.distcp").is_file() and (ckpt / "__1_0.distcp").is_file()  # sharded by FSDP2


def test_elementwise_recompute_keeps_the_fp8_matmuls():
    """Under `activation_checkpointing: elementwise` no matmul runs twice: one FP8 matmul forward, two backward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from dzmodel.model.fp8 import Float8Linear
    from dzmodel.train.parallelize import _elementwise_checkpointed

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls += func is torch.ops.aten._scaled_mm.default
            return func(*args, **(kwargs or {}))

    layer = torch.nn.Linear(32, 16)
    layer.__class__ = Float8Linear
    x = torch.randn(8, 32, requires_grad=True)
    with Count() as count:
        _elementwise_checkpointed(lambda t: torch.nn.functional.gelu(layer(t)), x).sum().backward()
    assert count.calls == 3


def test_fp8_with_lora_is_one_clear_error(data, tmp_path):
    with pytest.raises(ValueError, match="train LoRA with precision bf16"):
        _cfg(data, tmp_path, lora={"rank": 4})


def test_bf16_layers_are_checked_without_fp8_too(data, tmp_path):
    with pytest.raises(ValueError, match="fp8_bf16_layers names linears kept in bf16 under precision fp8; "
                                         "precision is 'bf16'"):
        _cfg(data, tmp_path, precision="bf16", fp8_bf16_layers=["cross_attn"])
    # on this CPU fp8 falls back to bf16, and a wrong name is still refused where it was written
    trainer = Trainer(_cfg(data, tmp_path, fp8_bf16_layers=["cross"]))
    with pytest.raises(ValueError, match="'cross' matches no FP8 linear of the blocks"):
        trainer.build_model()


def _fp8_casts_under_elementwise_recompute(keep_fp8_inputs: bool | str, hidden: int | None = None,
                                          keep_input: bool = True):
    """An FP8 linear under elementwise recompute, forward and backward: the shapes of its e4m3 roundings in the
    order they ran (the input is [8, 32], the weight [16, 32]) and the gradients. hidden: an FFN instead,
    32 -> hidden -> 16 with a GELU between (the down projection's input is [8, hidden]). keep_input: the layers'
    Float8Linear.keep_input (False for a context projection)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from dzmodel.model.fp8 import E4M3, Float8Linear
    from dzmodel.train.parallelize import _elementwise_checkpointed

    aten = torch.ops.aten

    class CountCasts(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.shapes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in (aten._to_copy.default, aten.copy_.default) and out.dtype == E4M3:
                self.shapes.append(tuple(out.shape))
            return out

    g = torch.Generator().manual_seed(0)
    layers = [torch.nn.Linear(32, 16)] if hidden is None else [torch.nn.Linear(32, hidden), torch.nn.Linear(hidden, 16)]
    for layer in layers:
        layer.__class__ = Float8Linear
        layer.keep_input = keep_input
        with torch.no_grad():
            layer.weight.copy_(torch.randn(layer.weight.shape, generator=g))
            layer.bias.copy_(torch.randn(layer.bias.shape, generator=g))

    def forward(t):
        t = torch.nn.functional.gelu(layers[0](t))
        return t if hidden is None else layers[1](t)

    x = torch.randn(8, 32, generator=g, requires_grad=True)
    with CountCasts() as count:
        _elementwise_checkpointed(forward, x, keep_fp8_inputs=keep_fp8_inputs).sum().backward()
    return count.shapes, (x.grad, *(layer.weight.grad for layer in layers))


def test_keeping_the_fp8_inputs_rounds_the_input_once_and_the_weight_as_before():
    """train.fp8_keep_inputs: the input's e4m3 cast runs once (without it, again in the backward's recompute); the
    weight's runs three times either way (forward, recompute, the backward's own): its e4m3 copy is not kept, as
    FSDP2 frees the gathered weight between forward and backward. The gradients are the same."""
    casts, grads = {}, {}
    for keep in (False, True):
        shapes, grads[keep] = _fp8_casts_under_elementwise_recompute(keep)
        casts[keep] = shapes.count((8, 32)), shapes.count((16, 32))
    assert casts == {False: (2, 3), True: (1, 3)}
    torch.testing.assert_close(grads[True], grads[False], rtol=0, atol=0)


def test_a_context_projections_input_is_rounded_again_in_the_backward_even_when_inputs_are_kept():
    """Float8Linear.keep_input False (the cross-attention's context projections): with train.fp8_keep_inputs
    true its input is rounded in the forward and again in the recompute, as without keeping; the gradients are
    the same as a kept input's."""
    shapes, grads = _fp8_casts_under_elementwise_recompute(True, keep_input=False)
    kept_shapes, kept_grads = _fp8_casts_under_elementwise_recompute(True)
    assert (shapes.count((8, 32)), kept_shapes.count((8, 32))) == (2, 1)
    torch.testing.assert_close(grads, kept_grads, rtol=0, atol=0)


def test_converting_marks_only_the_cross_attentions_context_projections_as_not_kept():
    from dzmodel.model.args import preset
    from dzmodel.model.fp8 import Float8Linear, convert_blocks_to_fp8
    from dzmodel.model.wam import DreamZeroWAM

    model = DreamZeroWAM(preset("tiny"))
    convert_blocks_to_fp8(model)
    not_kept = sorted({name.split(".", 2)[2] for name, m in model.named_modules()
                       if isinstance(m, Float8Linear) and not m.keep_input})
    assert not_kept == ["cross_attn.k", "cross_attn.k_img", "cross_attn.v", "cross_attn.v_img"]


def test_keeping_the_wide_fp8_inputs_rounds_the_ffn_down_input_once_and_the_narrow_one_twice():
    """train.fp8_keep_inputs: wide keeps the inputs at least WIDE_FP8_INPUT wide (the FFN's down projection's),
    rounded once; the 32-wide input of the up projection is rounded again in the backward's recompute, as
    without keeping. The gradients are the same."""
    from dzmodel.train.parallelize import WIDE_FP8_INPUT

    wide, narrow = (8, WIDE_FP8_INPUT), (8, 32)
    casts, grads = {}, {}
    for keep in (False, "wide", True):
        shapes, grads[keep] = _fp8_casts_under_elementwise_recompute(keep, hidden=WIDE_FP8_INPUT)
        casts[keep] = shapes.count(narrow), shapes.count(wide)
    assert casts == {False: (2, 2), "wide": (2, 1), True: (1, 1)}
    torch.testing.assert_close(grads["wide"], grads[False], rtol=0, atol=0)


def test_fp8_keep_inputs_takes_true_false_or_wide_by_name(data, tmp_path):
    assert _cfg(data, tmp_path, activation_checkpointing="elementwise", fp8_keep_inputs="wide").fp8_keep_inputs == "wide"
    with pytest.raises(ValueError, match="train.fp8_keep_inputs must be true, false or wide, got 'all'"):
        _cfg(data, tmp_path, activation_checkpointing="elementwise", fp8_keep_inputs="all")


def test_compiled_keeping_the_fp8_inputs_saves_the_inputs_copy_and_not_the_weights():
    """Compiled, what the forward saves for the backward holds the input's e4m3 copy with train.fp8_keep_inputs
    (none without, none for a context projection) and never an e4m3 copy of the weight."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from dzmodel.model.fp8 import E4M3, Float8Linear
    from dzmodel.train.parallelize import _elementwise_checkpointed

    layer = torch.nn.Linear(32, 16)
    layer.__class__ = Float8Linear
    saved_fp8 = {}
    for keep in (False, True, "context"):
        layer.keep_input = keep != "context"  # a context projection's input: not kept
        saved = []

        def record_forward(gm, _):
            outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
            saved.extend((tuple(o.meta["val"].shape), o.meta["val"].dtype) for o in outputs if hasattr(o, "meta"))
            return make_boxed_func(gm.forward)

        torch._dynamo.reset()
        fn = torch.compile(lambda t: _elementwise_checkpointed(
            lambda u: torch.nn.functional.gelu(layer(u)), t, keep_fp8_inputs=bool(keep)),
            backend=aot_autograd(fw_compiler=record_forward, bw_compiler=lambda gm, _: make_boxed_func(gm.forward)))
        fn(torch.randn(8, 32, requires_grad=True)).sum().backward()
        saved_fp8[keep] = [shape for shape, dtype in saved if dtype == E4M3]
    torch._dynamo.reset()
    assert saved_fp8 == {False: [], True: [(8, 32)], "context": []}


def test_the_setting_reaches_every_elementwise_recomputed_block(data, tmp_path):
    trainer = Trainer(_cfg(data, tmp_path / "keep", activation_checkpointing="elementwise", fp8_keep_inputs=True))
    trainer.build_model()
    assert [b.forward.keywords for b in trainer.model.blocks] == [{"keep_fp8_inputs": True}] * len(
        trainer.model.blocks)


@pytest.mark.parametrize("settings", [{"precision": "bf16", "activation_checkpointing": "elementwise"},
                                      {"activation_checkpointing": "none"}, {"activation_checkpointing": "full"}])
def test_keeping_fp8_inputs_without_fp8_or_elementwise_recompute_is_one_clear_error(data, tmp_path, settings):
    with pytest.raises(ValueError, match="train.fp8_keep_inputs .* needs precision: fp8 and "
                                         "activation_checkpointing: elementwise"):
        _cfg(data, tmp_path, fp8_keep_inputs=True, **settings)

