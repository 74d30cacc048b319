"""The cost guard of one action chunk: what a chunk costs in model calls, attention calls and FLOPs,
counted on CPU for a fixed configuration (the tiny policy, 16 solver steps, with and without CFG). An extra
forward, a mask rebuilt per call or a second prefill changes these counts; timing is left to `dz bench policy`.
An optimisation that lowers them updates the numbers here, with the measured speed-up in docs/performance.md."""

import collections

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from dzmodel.model import sampler
from dzmodel.policy import sessions as inference
from dzmodel.policy.sessions import build_tiny_policy
from dzmodel.model.sampler import SolverConfig

# cfg_scale -> calls in a session's first chunk, and the FLOPs torch's FlopCounterMode counts for it.
# CFG: one batch-2 forward per solver step and one batch-2 prefill; CLIP runs once for both branches; the
# cross-attention K/V of text and image are computed once per chunk, not at every solver step.
EXPECTED = {
    5.0: {"denoise_velocity": 16, "prefill": 1, "sdpa": 105},
    1.0: {"denoise_velocity": 16, "prefill": 1, "sdpa": 105},
}
GUARD_FLOPS = {5.0: 139_663_360, 1.0: 97_552_384}


def _count_one_chunk(policy, monkeypatch, prompt="pick up the bowl and place it on the plate"):
    counts = collections.Counter()

    def counted(module, name, key):
        original = getattr(module, name)

        def wrapper(*args, **kwargs):
            counts[key] += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)

    counted(sampler, "denoise_velocity", "denoise_velocity")  # the solver calls it; the policy calls prefill
    counted(inference, "prefill", "prefill")
    counted(F, "scaled_dot_product_attention", "sdpa")
    counted(type(policy.text_encoder), "forward", "text_encoder")
    h, w = policy.image_size
    rng = np.random.default_rng(0)
    obs = {"images": rng.integers(0, 255, (h, w, 3), dtype=np.uint8), "state": np.zeros(8),
           "prompt": prompt, "session_id": "guard"}
    with FlopCounterMode(display=False) as flops:
        policy.predict_actions(obs)
    return dict(counts), flops.get_total_flops()


@pytest.mark.parametrize("cfg_scale", [5.0, 1.0])
def test_one_chunk_costs_what_it_did(tmp_path, monkeypatch, cfg_scale):
    torch.set_num_threads(1)
    policy = build_tiny_policy(tmp_path, solver=SolverConfig(num_steps=16, cfg_scale=cfg_scale))
    counts, flops = _count_one_chunk(policy, monkeypatch)
    text_calls = 2 if cfg_scale != 1.0 else 1  # the prompt and, with CFG, the negative prompt
    assert counts == dict(EXPECTED[cfg_scale], text_encoder=text_calls)
    assert flops == GUARD_FLOPS[cfg_scale]  # encoders, VAE, prefill and solver together: nothing may grow


def test_the_prompt_is_encoded_once_per_policy(tmp_path, monkeypatch):
    """A robot repeats its prompt every call (and LIBERO restarts the cache every call): umT5 runs only for new
    prompts, so the second chunk costs the first minus the text encoder."""
    torch.set_num_threads(1)
    policy = build_tiny_policy(tmp_path, solver=SolverConfig(num_steps=16, cfg_scale=5.0))
    _, first = _count_one_chunk(policy, monkeypatch)
    monkeypatch.undo()
    counts, second = _count_one_chunk(policy, monkeypatch)
    assert "text_encoder" not in counts and second < first
    monkeypatch.undo()
    counts, _ = _count_one_chunk(policy, monkeypatch, prompt="open the drawer")
    assert counts["text_encoder"] == 1  # the negative prompt is cached too


def test_dit_caching_runs_the_denoiser_on_the_scheduled_steps(tmp_path, monkeypatch):
    """upstream's schedule: 16 solver steps, 8 denoiser forwards (the other steps reuse the velocity)."""
    policy = build_tiny_policy(tmp_path, solver=SolverConfig(num_steps=16, cfg_scale=5.0, dit_steps="upstream"))
    counts, flops = _count_one_chunk(policy, monkeypatch)
    assert counts["denoise_velocity"] == 8 and flops < GUARD_FLOPS[5.0]


def test_the_guard_fails_on_a_slow_path(tmp_path, monkeypatch):
    """A denoiser that runs twice per solver step (what a regression would look like) is caught."""
    policy = build_tiny_policy(tmp_path, solver=SolverConfig(num_steps=16, cfg_scale=1.0))
    original = sampler.denoise_velocity

    def twice(*args, **kwargs):
        original(*args, **kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(sampler, "denoise_velocity", twice)
    counts, flops = _count_one_chunk(policy, monkeypatch)
    assert counts["sdpa"] > EXPECTED[1.0]["sdpa"] and flops > GUARD_FLOPS[1.0]


def test_batched_cfg_equals_two_passes(tmp_path):
    """One forward of [cond; uncond] gives the chunk of the two separate passes (float32 on CPU)."""
    rng = np.random.default_rng(1)
    obs = {"images": rng.integers(0, 255, (64, 64, 3), dtype=np.uint8), "state": rng.uniform(-1, 1, 8),
           "prompt": "open the drawer", "session_id": "cfg"}
    chunks = []
    for batch_cfg in (True, False):
        policy = build_tiny_policy(tmp_path, solver=SolverConfig(num_steps=4, cfg_scale=5.0, batch_cfg=batch_cfg))
        chunks.append(policy.predict_actions(dict(obs)))
    np.testing.assert_allclose(chunks[0], chunks[1], rtol=1e-4, atol=1e-5)
