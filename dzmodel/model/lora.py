"""LoRA adapters on the DiT's linear layers (attention projections and FFN), written here rather than taken from
peft: the GPU image has torch, safetensors and numpy only, and a subclass of `nn.Linear` keeps every WAN
checkpoint name (`blocks.N.self_attn.q.weight`) where it was, so the base loads with the strict loader before the
adapters are added, and a merged model is a plain DreamZeroWAM that loads with it after.

    y = x Wᵀ + b + (alpha / rank) · dropout(x) Aᵀ Bᵀ        A [rank, in] (Kaiming-uniform), B [out, rank] (zeros)

B starts at zero, so an adapted model equals its base until it trains. `merge_lora` folds W += scale · B A and
turns the layers back into `nn.Linear`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from .weight_stacks import restack

# A block's linears by their name inside it (WanAttentionBlock): the attention projections and the FFN.
LORA_TARGETS = ("self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o", "cross_attn.q", "cross_attn.k",
                "cross_attn.v", "cross_attn.o", "cross_attn.k_img", "cross_attn.v_img", "ffn.0", "ffn.2")
# Modules outside the blocks trained in full with LoRA: the robot-specific encoders and the action decoder.
FULLY_TRAINED = ("action_encoder", "state_encoder", "action_decoder")


@dataclass
class LoRAConfig:
    rank: int = 0                      # 0: no LoRA (full fine-tuning)
    alpha: float = 16.0
    dropout: float = 0.0
    targets: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    fully_trained: list[str] = field(default_factory=lambda: list(FULLY_TRAINED))

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise ValueError(f"train.lora.rank must be >= 0, got {self.rank}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"train.lora.dropout must be in [0, 1), got {self.dropout}")
        unknown = sorted(set(self.targets) - set(LORA_TARGETS))
        if unknown:
            raise ValueError(f"train.lora.targets: unknown {unknown}; choose from {list(LORA_TARGETS)}")

    @property
    def enabled(self) -> bool:
        return self.rank > 0


class LoRALinear(nn.Linear):
    """nn.Linear plus a low-rank update; `weight` and `bias` keep their names (and are frozen by `apply_lora`)."""

    def __init__(self, in_features: int, out_features: int, rank: int, alpha: float, dropout: float = 0.0,
                 bias: bool = True, device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.rank, self.scale = rank, alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        self.reset_adapters(device)

    def reset_adapters(self, device=None) -> None:
        """Fresh fp32 adapters on `device`: A Kaiming-uniform, B zero (the layer equals its base)."""
        self.lora_a = nn.Parameter(torch.empty(self.rank, self.in_features, device=device, dtype=torch.float32))
        self.lora_b = nn.Parameter(torch.zeros(self.out_features, self.rank, device=device, dtype=torch.float32))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))

    @classmethod
    def wrap(cls, linear: nn.Linear, rank: int, alpha: float, dropout: float = 0.0) -> "LoRALinear":
        """A LoRA layer that shares `linear`'s weight and bias tensors (no copy)."""
        with torch.device("meta"):
            out = cls(linear.in_features, linear.out_features, rank, alpha, dropout, bias=linear.bias is not None)
        out.weight, out.bias = linear.weight, linear.bias
        out.reset_adapters(linear.weight.device)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = F.linear(x, self.weight, self.bias)
        a, b = self.lora_a.to(x.dtype), self.lora_b.to(x.dtype)
        return base + F.linear(F.linear(self.dropout(x), a), b) * self.scale

    def merged_weight(self) -> torch.Tensor:
        return (self.weight.float() + self.scale * (self.lora_b.float() @ self.lora_a.float())).to(self.weight.dtype)


def apply_lora(model: nn.Module, cfg: LoRAConfig, base_dtype: torch.dtype | None = None) -> list[str]:
    """Replace each target linear of every block by a LoRALinear sharing its weights, freeze everything but the
    adapters and `cfg.fully_trained`, and (base_dtype) cast the frozen weights, e.g. to bf16. Returns the names of
    the trainable parameters."""
    adapted = 0
    for block in model.blocks:
        for target in cfg.targets:
            parent_name, _, leaf = target.rpartition(".")
            parent = block.get_submodule(parent_name)
            linear = getattr(parent, leaf, None)
            if linear is None:  # e.g. k_img on a text-only cross-attention
                continue
            setattr(parent, leaf, LoRALinear.wrap(linear, cfg.rank, cfg.alpha, cfg.dropout))
            adapted += 1
    if not adapted:
        raise ValueError(f"train.lora.targets {cfg.targets} matched no linear layer of the model")
    trainable = []
    for name, p in model.named_parameters():
        train = ".lora_" in name or name.split(".")[0] in cfg.fully_trained
        p.requires_grad_(train)
        if train:
            trainable.append(name)
        elif base_dtype is not None and p.is_floating_point():
            p.data = p.data.to(base_dtype)
    restack(model)  # an inference weight stack of adapted layers is dropped (weight_stacks.py)
    return trainable


def merge_lora(model: nn.Module) -> int:
    """Fold every adapter into its base weight (in place) and restore plain nn.Linear layers: the result has the
    base model's parameter names and loads with the strict loader. Returns the number of merged layers."""
    merged = 0
    for name, module in list(model.named_modules()):
        if not isinstance(module, LoRALinear):
            continue
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        plain = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None, device="meta")
        with torch.no_grad():
            plain.weight = nn.Parameter(module.merged_weight(), requires_grad=module.weight.requires_grad)
            if module.bias is not None:
                plain.bias = nn.Parameter(module.bias.detach().clone(), requires_grad=module.bias.requires_grad)
        setattr(parent, leaf, plain)
        merged += 1
    restack(model)  # an inference weight stack is made again from the merged Linears (weight_stacks.py)
    return merged


def trainable_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of what training updates: every parameter, or with LoRA the adapters and the fully
    trained modules (the frozen base has requires_grad off). The optimizer, the EMA and checkpoints all use it."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def lora_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The trainable tensors (adapters and fully trained modules) by name."""
    return {n: p.detach() for n, p in trainable_parameters(model)}
