"""Inference reads the stacked weights of the Linears that run as one matmul as they are: the same values, no
concatenation per forward, no new memory, nothing in the state_dict, and training untouched."""

import collections
import copy

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dzmodel.policy.sessions import build_tiny_policy
from dzmodel.model.fp8 import freeze_blocks_to_fp8
from dzmodel.model.sampler import SolverConfig
from dzmodel.model.weight_stacks import SUFFIX, share_weight_stacks

from .helpers import tiny_batch, tiny_model


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _forward(model, batch):
    out = model(**batch, attn_backend="sdpa")
    return torch.cat([out.video_pred.flatten(), out.action_pred.flatten()])


def _stacked_copy(model):
    stacked = copy.deepcopy(model)
    groups = share_weight_stacks(stacked)
    return stacked, groups


def test_stacked_weights_give_the_same_forward():
    model = tiny_model().eval()
    batch = tiny_batch(model.args)
    stacked, groups = _stacked_copy(model)
    layers = model.args.num_layers
    assert groups == 3 * layers  # q+k+v, the text's k+v and the image's k+v of every block
    assert share_weight_stacks(stacked) == 0  # once
    assert stacked.state_dict().keys() == model.state_dict().keys()
    attn = stacked.blocks[0].self_attn
    stack = attn.q_k_v_weight_stack
    assert attn.k.weight.data_ptr() == stack.data_ptr() + attn.q.out_features * stack.stride(0) * stack.element_size()
    with torch.no_grad():
        assert torch.equal(_forward(stacked, batch), _forward(model, batch))


def test_a_chunk_reads_the_stacks_instead_of_concatenating_weights(tmp_path):
    """The policy stacks its model's weights when it is built: one chunk gives the same actions as without stacks,
    with two concatenations (weight, bias) fewer for each use of a group: per layer the prefill's q/k/v and the
    context's two K/V pairs, the chunk's K/V pairs once, and q/k/v at each denoiser forward."""
    solver = SolverConfig(num_steps=4, cfg_scale=2.0)
    stacked, plain = (build_tiny_policy(tmp_path, solver=solver) for _ in range(2))
    for module in plain.model.modules():  # back to concatenating the weights at every forward
        for name in [n for n in module._buffers if n.endswith(SUFFIX)]:
            del module._buffers[name]
    obs = {"images": np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8), "state": np.zeros(8),
           "prompt": "open the drawer", "session_id": "s"}
    counts = []
    for policy in (plain, stacked):
        with CountOps() as ops:
            counts.append((policy.predict_actions(dict(obs)), ops.counts["cat"]))
    (expected, plain_cats), (got, stacked_cats) = counts
    np.testing.assert_array_equal(got, expected)
    uses = 3 + 2 + solver.num_steps  # prefill (q/k/v, two context pairs), the chunk's two pairs, q/k/v per forward
    assert plain_cats - stacked_cats == 2 * uses * stacked.model.args.num_layers


def test_training_through_a_stacked_model_is_unchanged():
    """With autograd the Linears' own weights are used (their gradients reach them), as without stacks."""
    model = tiny_model()
    batch = tiny_batch(model.args)
    stacked, _ = _stacked_copy(model)
    for m in (model, stacked):
        _forward(m, batch).square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), stacked.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0)


def _are_views(model) -> bool:
    attn = model.blocks[0].self_attn
    stack = attn.q_k_v_weight_stack
    row = attn.q.out_features * stack.stride(0) * stack.element_size()
    return attn.q.weight.data_ptr() == stack.data_ptr() and attn.k.weight.data_ptr() == stack.data_ptr() + row


def test_a_stacked_model_moved_to_another_dtype_keeps_its_views_and_values():
    model = tiny_model().eval()
    batch = tiny_batch(model.args)
    stacked, _ = _stacked_copy(model)
    stacked.to(torch.float64)
    model.to(torch.float64)
    assert _are_views(stacked) and stacked.blocks[0].self_attn.q_k_v_weight_stack.dtype == torch.float64
    batch = {k: v.double() if v.is_floating_point() else v for k, v in batch.items()}
    with torch.no_grad():
        assert torch.equal(_forward(stacked, batch), _forward(model, batch))


def test_weights_loaded_or_merged_later_are_what_a_stacked_model_reads():
    """A state dict loaded with assign=True gives the Linears new tensors, and merging LoRA adapters gives new
    Linears: the stacks follow them (a stale stack would give the old weights' forward)."""
    from dzmodel.model.lora import LoRAConfig, apply_lora, merge_lora

    model, other = tiny_model(seed=0).eval(), tiny_model(seed=1).eval()
    batch = tiny_batch(model.args)
    stacked, _ = _stacked_copy(model)
    stacked.load_state_dict(copy.deepcopy(other.state_dict()), assign=True)
    assert _are_views(stacked)
    with torch.no_grad():
        assert torch.equal(_forward(stacked, batch), _forward(other, batch))
    stacked.load_state_dict(model.state_dict())  # copied into the views: the stacks hold the new values too
    with torch.no_grad():
        assert torch.equal(_forward(stacked, batch), _forward(model, batch))
    for m in (model, stacked):
        torch.manual_seed(2)
        apply_lora(m, LoRAConfig(rank=4, alpha=4.0))
        for name, p in m.named_parameters():
            if ".lora_b" in name:
                p.data.normal_()  # adapters that change the weights when merged
        merge_lora(m)
    with torch.no_grad():
        assert torch.equal(_forward(stacked, batch), _forward(model, batch))


def test_fp8_inference_drops_the_stacks():
    stacked, _ = _stacked_copy(tiny_model().eval())
    freeze_blocks_to_fp8(stacked)
    assert not [name for name, _ in stacked.named_buffers() if name.endswith(SUFFIX)]
