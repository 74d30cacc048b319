"""End-to-end: the tiny WAM learns (slow; run by `make test-slow` and CI)."""

import pytest
import torch

from dzmodel.model.objective import FlowMatchSchedule, flow_matching_losses
from tests.model.helpers import sample_timestep_ids

from .helpers import tiny_batch, tiny_model


@pytest.mark.slow
def test_tiny_wam_fits_a_fixed_batch():
    torch.manual_seed(0)
    model = tiny_model().train()
    a = model.args
    sched = FlowMatchSchedule()
    b = tiny_batch(a, batch=2)
    g = torch.Generator().manual_seed(0)
    actions = torch.rand(2, a.max_chunk_size * a.num_action_per_block, a.action_dim, generator=g) * 2 - 1
    noise, noise_a = torch.randn(b["clean_latents"].shape, generator=g), torch.randn(actions.shape, generator=g)
    _, ids, aids = sample_timestep_ids(2, a.num_frames, a.num_frame_per_block, a.num_action_per_block, generator=g)
    ids, aids = ids.clamp(300, 700), aids.clamp(300, 700)  # mid-noise, where w(t) is large
    mask = torch.ones_like(actions, dtype=torch.bool)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.95, 0.999), weight_decay=1e-5)
    history = []
    for _ in range(150):
        out = model(sched.add_noise(b["clean_latents"], noise, ids, 2), b["clean_latents"], sched.timestep(ids),
                    sched.add_noise(actions, noise_a, aids, 1), sched.timestep(aids), b["state"], b["context"],
                    b["clip_feature"], attn_backend="sdpa")
        losses = flow_matching_losses(sched, out.video_pred, out.action_pred, b["clean_latents"], noise, actions,
                                      noise_a, ids, aids, mask, torch.ones(2, dtype=torch.bool))
        opt.zero_grad()
        losses.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        history.append((float(losses.loss), float(losses.dynamics_loss), float(losses.action_loss)))
    first, last = history[0], history[-1]
    assert last[0] < 0.2 * first[0], (first, last)
    assert last[1] < first[1] and last[2] < first[2]
