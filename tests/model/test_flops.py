"""The model FLOPs (DreamZeroArgs.flops) count what forward runs: equal to torch's FlopCounterMode on the tiny
preset (matmuls, the patch conv, and attention through the math kernel, one call per mask rectangle)."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from dzmodel.train.metrics import peak_flops

from .helpers import tiny_batch, tiny_model


@pytest.mark.parametrize("batch,noisy_first_frame", [(1, True), (2, True), (2, False)])
def test_forward_flops_equal_what_torch_counts(batch, noisy_first_frame):
    model = tiny_model()
    b = tiny_batch(model.args, batch=batch)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        # segments: only the mask's allowed rectangles are computed
        model(**b, attn_backend="segments", noisy_first_frame=noisy_first_frame)
    latents = b["noisy_latents"]
    ours = model.args.flops(tuple(latents.shape[-2:]), latents.shape[2], noisy_first_frame=noisy_first_frame)
    assert ours.forward * batch == counter.get_total_flops()
    assert ours.train() == 3 * ours.forward


def test_peaks_per_device_and_no_mfu_without_one(monkeypatch):
    assert peak_flops(torch.device("cpu")) is None
    for name, peak in (("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H200", 989e12), ("NVIDIA A100-SXM4-80GB", 312e12),
                       ("NVIDIA L40S", 362e12), ("NVIDIA B200", 2250e12), ("Some Future GPU", None)):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, n=name: n)
        assert peak_flops(torch.device("cuda")) == peak, name


def test_forward_flops_with_text_rows_equal_what_torch_counts_and_are_fewer():
    model = tiny_model()
    b = tiny_batch(model.args, batch=2)
    b["context"][:, 5:] = 0
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(**b, attn_backend="segments", text_rows=5)
    latents = b["noisy_latents"]
    ours = model.args.flops(tuple(latents.shape[-2:]), latents.shape[2], text_rows=5)
    # per sample: the pad row's text embedding and K/V run once for the batch, not once a sample
    a, d = model.args, model.args.dim
    pad_row_once = 2 * (a.text_dim * d + d * d) + a.num_layers * 2 * 2 * d * d
    assert ours.forward * 2 - pad_row_once == counter.get_total_flops()
    assert ours.forward < model.args.flops(tuple(latents.shape[-2:]), latents.shape[2]).forward
