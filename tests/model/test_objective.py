"""The flow-matching objective: grid, weights, id tying, losses."""

import torch

from dzmodel.model.objective import FlowMatchSchedule, action_timestep_ids, flow_matching_losses, tie_timestep_ids
from tests.model.helpers import sample_timestep_ids


def test_grid_shift_and_range():
    s = FlowMatchSchedule()
    assert s.timesteps.shape == (1000,)
    assert abs(float(s.timesteps[0]) - 1000) < 1e-3
    assert abs(float(s.timesteps[-1]) - 4.98) < 0.01  # 1000 * 5*0.001/(1+4*0.001)
    torch.testing.assert_close(s.sigmas, 5 * (1 - torch.arange(1000) / 1000) / (1 + 4 * (1 - torch.arange(1000) / 1000)))
    assert 0.82 < float(s.sigmas.median()) < 0.85  # the shift favours high noise


def test_weights_mean_one_zero_at_pure_noise_peak_near_500():
    s = FlowMatchSchedule()
    assert abs(float(s.weights.mean()) - 1) < 1e-4
    assert float(s.weights[0]) == 0.0  # t = 1000
    peak = int(s.weights.argmax())
    assert abs(float(s.timesteps[peak]) - 500) < 5
    assert 2.0 < float(s.weights.max()) < 2.2


def test_ids_are_tied_per_block_and_actions_follow_their_block():
    raw = torch.tensor([[7, 1, 2, 3, 4], [9, 5, 6, 8, 0]])
    tied = tie_timestep_ids(raw, 2)
    assert tied.tolist() == [[7, 1, 1, 3, 3], [9, 5, 5, 8, 8]]
    assert action_timestep_ids(tied, 2, 3).tolist() == [[1, 1, 1, 3, 3, 3], [5, 5, 5, 8, 8, 8]]
    g = torch.Generator().manual_seed(0)
    r, t, a = sample_timestep_ids(4, 9, 2, 24, generator=g)
    assert r.shape == (4, 9) and a.shape == (4, 96)
    assert (t[:, 1::2] == t[:, 2::2]).all() and (t[:, 0] == r[:, 0]).all()


def test_add_noise_is_linear_interpolation():
    s = FlowMatchSchedule()
    x0, eps = torch.randn(2, 3, 4, 2, 2), torch.randn(2, 3, 4, 2, 2)
    ids = torch.tensor([[0, 999, 500, 10], [1, 2, 3, 4]])
    xt = s.add_noise(x0, eps, ids, dim=2)
    sig = s.sigma(ids)
    torch.testing.assert_close(xt[1, :, 2], (1 - sig[1, 2]) * x0[1, :, 2] + sig[1, 2] * eps[1, :, 2])
    torch.testing.assert_close(xt[0, :, 0], eps[0, :, 0])  # sigma 1 at id 0


def test_losses_match_a_brute_force_formula():
    torch.manual_seed(0)
    s = FlowMatchSchedule()
    B, C, F, H, W, N, D = 2, 3, 5, 2, 4, 8, 6
    x0, eps, vp = torch.randn(B, C, F, H, W), torch.randn(B, C, F, H, W), torch.randn(B, C, F, H, W)
    a0, ea, ap = torch.rand(B, N, D) * 2 - 1, torch.randn(B, N, D), torch.randn(B, N, D)
    ids, aids = torch.randint(0, 1000, (B, F)), torch.randint(0, 1000, (B, N))
    mask = torch.rand(B, N, D) > 0.3
    real = torch.tensor([True, False])
    out = flow_matching_losses(s, vp, ap, x0, eps, a0, ea, ids, aids, mask, real)
    dyn = sum(((vp[b, :, f] - (eps[b, :, f] - x0[b, :, f])) ** 2).mean() * s.weights[ids[b, f]]
              for b in range(B) for f in range(F)) / (B * F)
    act = sum((((ap[b, n] - (ea[b, n] - a0[b, n])) ** 2) * mask[b, n]).mean() * real[b] * s.weights[aids[b, n]]
              for b in range(B) for n in range(N)) / (B * N)
    torch.testing.assert_close(out.dynamics_loss, dyn)
    torch.testing.assert_close(out.action_loss, act.float())
    torch.testing.assert_close(out.loss, dyn + act.float())
    # has_real_action applies per sample: sample 1's actions contribute nothing
    ap2 = ap.clone()
    ap2[1] += 100
    out2 = flow_matching_losses(s, vp, ap2, x0, eps, a0, ea, ids, aids, mask, real)
    torch.testing.assert_close(out2.action_loss, out.action_loss)


def test_odd_latent_height_crops_the_target():
    s = FlowMatchSchedule()
    x0, eps = torch.randn(1, 2, 3, 5, 4), torch.randn(1, 2, 3, 5, 4)
    pred = (eps - x0)[..., :4, :]
    out = flow_matching_losses(s, pred, torch.zeros(1, 2, 2), x0, eps, torch.zeros(1, 2, 2), torch.zeros(1, 2, 2),
                               torch.full((1, 3), 500), torch.full((1, 2), 500), torch.ones(1, 2, 2, dtype=torch.bool),
                               torch.tensor([True]))
    assert float(out.dynamics_loss) == 0.0
