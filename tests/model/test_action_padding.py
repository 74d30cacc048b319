"""The padded action dims (past the robot's own, up to the model's action_dim) are zero in the solver's noise and
after every solver step, in each solver (one guided batch, two passes, unguided) and through the policy, on the
direct and the CUDA-graph code paths."""

import numpy as np
import pytest
import torch

from dzmodel.policy.sessions import build_tiny_policy
from dzmodel.model.cuda_graphs import GraphCache
from dzmodel.model.sampler import Conditioning, KVCache, SolverConfig, draw_noise, prefill
from tests.model.helpers import sample_block

from .helpers import tiny_batch, tiny_model

REAL = 5  # of the tiny preset's 8 action dims


def _record_noisy_actions(model) -> list[torch.Tensor]:
    """Every noisy action chunk the model is fed (the solver's state at each DiT step)."""
    seen, embed = [], model.embed_register

    def spy(noisy_actions, *args, **kwargs):
        seen.append(noisy_actions.detach().clone())
        return embed(noisy_actions, *args, **kwargs)

    model.embed_register = spy
    return seen


def _sample(model, cfg_scale: float, batch_cfg: bool, action_dims: int | None):
    b = tiny_batch(model.args, batch=2)
    conds = [Conditioning(*model.embed_context(ctx, b["clip_feature"]))
             for ctx in (b["context"], torch.zeros_like(b["context"]))]
    caches = []
    for c in conds:
        caches.append(KVCache())
        prefill(model, caches[-1], b["clean_latents"][:, :, :1], c)
    solver = SolverConfig(num_steps=4, cfg_scale=cfg_scale, batch_cfg=batch_cfg)
    return sample_block(model, tuple(caches), tuple(conds), b["state"][:, :1], (4, 6), solver,
                        torch.Generator().manual_seed(0), action_dims=action_dims)


@pytest.mark.parametrize("cfg_scale,batch_cfg", [(5.0, True), (5.0, False), (1.0, True)])
def test_padded_dims_are_zero_at_every_solver_step(cfg_scale, batch_cfg):
    model = tiny_model()
    seen = _record_noisy_actions(model)
    _, actions = _sample(model, cfg_scale, batch_cfg, REAL)
    assert len(seen) == (4 if cfg_scale == 1.0 or batch_cfg else 8)  # one or two forwards per step
    for step in seen:
        assert torch.equal(step[..., REAL:], torch.zeros_like(step[..., REAL:]))
        assert step[..., :REAL].abs().min() > 0  # the real dims are noisy
    assert torch.equal(actions[..., REAL:], torch.zeros_like(actions[..., REAL:]))


def test_the_real_dims_start_from_the_same_noise_and_all_dims_is_the_default():
    model = tiny_model()
    full = draw_noise(model, 2, (4, 6), "cpu", torch.Generator().manual_seed(0))[1]
    real = draw_noise(model, 2, (4, 6), "cpu", torch.Generator().manual_seed(0), action_dims=REAL)[1]
    assert torch.equal(real[..., :REAL], full[..., :REAL]) and not real[..., REAL:].any()
    seen = _record_noisy_actions(model)
    _, actions = _sample(model, 5.0, True, None)  # every dim real: nothing is zeroed
    assert seen[0][..., REAL:].abs().min() > 0 and actions[..., REAL:].abs().min() > 0
    with pytest.raises(ValueError, match="action_dims must be in"):
        draw_noise(model, 1, (4, 6), "cpu", action_dims=model.args.action_dim + 1)


@pytest.mark.parametrize("graphs", [False, True])
def test_the_policy_feeds_zeros_on_its_padded_dims_and_returns_its_own_dims(tmp_path, graphs):
    """build_tiny_policy has 7 action dims of the tiny model's 8. graphs: the CUDA-graph code path (flattened inputs,
    uncaptured on a CPU), whose key holds the real dims."""
    policy = build_tiny_policy(tmp_path, action_dims=7, solver=SolverConfig(num_steps=3, cfg_scale=5.0))
    keys = []
    if graphs:
        policy.graphs = GraphCache(enabled=True, capture=False)
        run = policy.graphs.run
        policy.graphs.run = lambda key, *rest: (keys.append(key), run(key, *rest))[1]
    seen = _record_noisy_actions(policy.model)
    rng = np.random.default_rng(0)
    obs = {"images": rng.integers(0, 255, (64, 64, 3), dtype=np.uint8), "state": rng.uniform(-1, 1, 8),
           "prompt": "pick up the red block"}
    chunk = policy.predict_actions(obs)
    assert chunk.shape == (policy.model.args.num_action_per_block, 7) and np.isfinite(chunk).all()
    assert len(seen) == 3
    for step in seen:
        assert not step[..., 7:].any() and step[..., :7].abs().min() > 0
    if graphs:  # the real dims are a constant of the captured solver: part of its key
        assert [key[-1] for key in keys if key[0] == "solve"] == [7]
