"""LoRA adapters: an adapted model starts equal to its base, trains only what it should, and merges into a plain
model whose outputs equal the adapted one's and which loads with the strict loader."""

import pytest
import torch

from dzmodel.model.synthetic import random_inputs
from dzmodel.model.args import preset
from dzmodel.model.lora import LORA_TARGETS, LoRAConfig, LoRALinear, apply_lora, merge_lora
from dzmodel.model.state_dict import load_strict
from dzmodel.model.wam import DreamZeroWAM


def _model_and_inputs(seed=0):
    args = preset("tiny")
    torch.manual_seed(seed)
    model = DreamZeroWAM(args)
    x = random_inputs(args, 2, (4, 6), "cpu", torch.float32, torch.Generator().manual_seed(1))
    return model, x


def _out(model, x):
    with torch.no_grad():
        o = model(**x, attn_backend="sdpa")
    return torch.cat([o.video_pred.flatten(), o.action_pred.flatten()])


def test_an_adapted_model_starts_as_its_base_and_trains_only_adapters_and_robot_modules():
    model, x = _model_and_inputs()
    base_names = [n for n, _ in model.named_parameters()]
    before = _out(model, x)
    trainable = apply_lora(model, LoRAConfig(rank=4))
    torch.testing.assert_close(_out(model, x), before)  # B = 0
    present = [t for t in LORA_TARGETS if t.split(".")[-1] not in ("k_img", "v_img")
               or hasattr(model.blocks[0].cross_attn, "k_img")]
    assert all(isinstance(model.blocks[0].get_submodule(t), LoRALinear) for t in present)
    assert {n for n in trainable if ".lora_" not in n} == {
        n for n in base_names if n.split(".")[0] in ("action_encoder", "state_encoder", "action_decoder")}
    assert sum(".lora_" in n for n in trainable) == 2 * sum(isinstance(m, LoRALinear) for m in model.modules())
    assert model.blocks[0].self_attn.q.weight.requires_grad is False
    # the base names did not move: a WAN checkpoint's keys still address the same tensors
    assert set(base_names) <= {n for n, _ in model.named_parameters()}


def test_merged_outputs_equal_the_adapted_ones_and_load_strictly():
    model, x = _model_and_inputs()
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0))
    with torch.no_grad():  # as if trained: non-zero adapters
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_b.normal_(0, 0.05)
    adapted = _out(model, x)
    per_block = 12 if hasattr(model.blocks[0].cross_attn, "k_img") else 10  # q k v o twice (+ image k v), 2 FFN
    assert merge_lora(model) == len(model.blocks) * per_block
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    torch.testing.assert_close(_out(model, x), adapted, rtol=1e-5, atol=1e-5)
    fresh, _ = _model_and_inputs(seed=5)
    load_strict(fresh, model.state_dict(), source="merged")  # plain names, nothing extra or missing
    torch.testing.assert_close(_out(fresh, x), adapted, rtol=1e-5, atol=1e-5)


def test_a_bf16_base_keeps_fp32_adapters():
    model, _ = _model_and_inputs()
    apply_lora(model, LoRAConfig(rank=2), base_dtype=torch.bfloat16)
    q = model.blocks[0].self_attn.q
    assert q.weight.dtype == torch.bfloat16 and q.lora_a.dtype == torch.float32
    assert model.action_decoder.layer1.W.dtype == torch.float32  # trained in full, fp32 master


def test_bad_lora_settings_name_the_field():
    with pytest.raises(ValueError, match="train.lora.rank must be >= 0"):
        LoRAConfig(rank=-1)
    with pytest.raises(ValueError, match=r"train.lora.targets: unknown \['attn.q'\]"):
        LoRAConfig(rank=4, targets=["attn.q"])
