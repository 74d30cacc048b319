"""LoRA in the trainer: checkpoints hold the trainable tensors and a reference to the base, resume is bit-exact,
and `dz convert` merges (outputs equal the unmerged model's) or exports the adapters alone."""

import json

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader

from dzmodel.model.synthetic import random_inputs
from dzmodel.model.lora import LoRALinear, apply_lora
from dzmodel.model.state_dict import load_dreamzero_dir
from dzmodel.train.checkpoint import latest_checkpoint, load_checkpoint
from dzmodel.train.config import TrainConfig
from dzmodel.train.convert import convert_checkpoint, lora_base
from dzmodel.train.trainer import train

from .test_trainer import _cfg

LORA = {"rank": 4, "alpha": 8.0}


def _losses(history):
    return [round(h["loss"], 6) for h in history]


@pytest.fixture(scope="module")
def lora_run(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora") / "run"
    history = train(_cfg(data, out, steps=4, save_every=2, lora=LORA, micro_batch=1, global_batch=2))  # 2 accumulated
    return out, history


def test_a_lora_checkpoint_holds_only_trainable_tensors_and_the_base_reference(lora_run):
    out, history = lora_run
    assert len(history) == 4 and all(torch.isfinite(torch.tensor(h["loss"])) for h in history)
    ckpt = latest_checkpoint(out)
    keys = {k.removeprefix("model.") for k in FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
            if k.startswith("model.")}
    assert keys and all(".lora_" in k or k.split(".")[0] in ("action_encoder", "state_encoder", "action_decoder")
                        for k in keys)
    assert "blocks.0.self_attn.q.weight" not in keys
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["base"] == {"init": "seeded", "seed": 0, "device": "cpu"}


def test_lora_resume_is_bit_exact(data, tmp_path, lora_run):
    _, full = lora_run
    out = tmp_path / "resumed"
    kw = dict(steps=4, save_every=2, lora=LORA, micro_batch=1, global_batch=2)
    first = train(_cfg(data, out, stop_at=2, **kw))
    second = train(_cfg(data, out, **kw))
    assert _losses(first + second) == _losses(full)


def test_convert_merges_into_a_plain_model_with_the_same_outputs(lora_run, tmp_path):
    out, _ = lora_run
    ckpt = latest_checkpoint(out)
    merged = load_dreamzero_dir(convert_checkpoint(ckpt, tmp_path / "merged"))
    assert not any(isinstance(m, LoRALinear) for m in merged.modules())
    cfg = TrainConfig.from_dict(json.loads((ckpt / "trainer_state.json").read_text())["config"])
    adapted = lora_base(cfg, {"init": "seeded", "seed": 0, "device": "cpu"}, ckpt)
    apply_lora(adapted, cfg.lora)
    load_checkpoint(ckpt, adapted, None)
    assert any(m.lora_b.abs().sum() > 0 for m in adapted.modules() if isinstance(m, LoRALinear))  # it trained
    x = random_inputs(adapted.args, 2, (4, 6), "cpu", torch.float32, torch.Generator().manual_seed(3))
    with torch.no_grad():
        a, b = adapted(**x, attn_backend="sdpa"), merged(**x, attn_backend="sdpa")
    torch.testing.assert_close(b.action_pred, a.action_pred, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b.video_pred, a.video_pred, rtol=1e-5, atol=1e-5)


def test_adapters_only_export_and_its_errors(lora_run, data, tmp_path):
    out, _ = lora_run
    ckpt = latest_checkpoint(out)
    exported = convert_checkpoint(ckpt, tmp_path / "adapters", adapters_only=True)
    tensors = load_file(str(exported / "adapters.safetensors"))
    assert any(".lora_a" in k for k in tensors) and not (exported / "model.safetensors").exists()
    assert (exported / "experiment_cfg" / "train_config.json").is_file()
    full = tmp_path / "full"
    train(_cfg(data, full, steps=1, save_every=1))
    with pytest.raises(ValueError, match="--adapters-only needs a LoRA run"):
        convert_checkpoint(latest_checkpoint(full), tmp_path / "x", adapters_only=True)
    state_file = ckpt / "trainer_state.json"
    state = json.loads(state_file.read_text())
    cfg = TrainConfig.from_dict(state["config"])
    with pytest.raises(ValueError, match="does not match the run's config"):
        lora_base(cfg, {**state["base"], "seed": 7}, ckpt)


def test_ema_resume_is_bit_exact_and_convert_exports_either_weights(data, tmp_path):
    ema = {"ema_decay": 0.9, "lora": LORA}
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    train(_cfg(data, whole, steps=4, save_every=2, **ema))
    train(_cfg(data, parts, steps=4, save_every=2, stop_at=2, **ema))
    train(_cfg(data, parts, steps=4, save_every=2, **ema))
    exported = {}
    for name, run in (("whole", whole), ("parts", parts)):
        for weights in ("ema", "raw"):
            d = convert_checkpoint(latest_checkpoint(run), tmp_path / f"{name}_{weights}", weights=weights)
            exported[name, weights] = load_file(str(d / "model.safetensors"))
            assert json.loads((d / "experiment_cfg" / "train_config.json").read_text())["weights"] == weights
    for key, value in exported["whole", "ema"].items():
        assert torch.equal(value, exported["parts", "ema"][key]), key  # bit-exact across the resume
    moved = [k for k, v in exported["whole", "ema"].items() if not torch.equal(v, exported["whole", "raw"][k])]
    assert any(k.startswith("action_decoder") for k in moved) and any(".self_attn.q.weight" in k for k in moved)
    plain = tmp_path / "plain"
    train(_cfg(data, plain, steps=1, save_every=1))
    with pytest.raises(ValueError, match="--weights ema needs a run that kept an EMA"):
        convert_checkpoint(latest_checkpoint(plain), tmp_path / "y", weights="ema")
    # `dz eval libero RUN --weights ema` converts the run's steps with the EMA, beside the raw ones
    from dzmodel.eval.libero_eval import _models_to_evaluate
    from dzmodel.policy.policy import PolicyLoadError

    name = next(k for k in moved if k.startswith("action_decoder"))
    for weights in ("ema", "raw"):
        [(step, model)] = _models_to_evaluate(whole, tmp_path / "eval", [4], weights)
        assert step == 4 and model.parent.name == ("converted_ema" if weights == "ema" else "converted")
        assert torch.equal(load_file(str(model / "model.safetensors"))[name],
                           exported["whole", weights][name])
    with pytest.raises(PolicyLoadError, match="already converted"):
        _models_to_evaluate(model, tmp_path / "eval", None, "ema")


def test_the_optimizer_holds_only_the_trainable_parameters(data, tmp_path):
    from dzmodel.train.trainer import Trainer

    trainer = Trainer(_cfg(data, tmp_path / "t", lora=LORA))
    trainer.build_model()
    held = [p for g in trainer.optimizer.param_groups for p in g["params"]]
    assert len(held) == len(trainer.step.params) < sum(1 for _ in trainer.model.parameters())
    assert all(p.requires_grad for p in held)


@pytest.mark.parametrize("feature", [{"ema_decay": 0.9}, {"frame_cache_mib": 64}])
def test_an_ema_or_the_frame_cache_leaves_the_raw_training_unchanged(data, tmp_path, feature):
    """Both arrived after the first closed-loop runs: neither may change what is trained."""
    plain = train(_cfg(data, tmp_path / "plain", steps=4, save_every=4))
    other = train(_cfg(data, tmp_path / "other", steps=4, save_every=4, **feature))
    assert _losses(other) == _losses(plain)
    a, b = (load_file(str(convert_checkpoint(latest_checkpoint(tmp_path / r), tmp_path / f"{r}_raw")
                          / "model.safetensors")) for r in ("plain", "other"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
