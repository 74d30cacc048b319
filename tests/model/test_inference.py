"""Cached block inference equals the teacher-forcing forward; the solver and the policy behave."""

import numpy as np
import pytest
import torch

from dzmodel.data.transforms import NormStats
from dzmodel.model.sampler import Conditioning, KVCache, SolverConfig, denoise_velocity, prefill
from tests.model.helpers import sample_block

from .helpers import tiny_batch, tiny_model


def _cond(model, b):
    text, image = model.embed_context(b["context"], b["clip_feature"])
    return Conditioning(text=text, image=image)


@pytest.mark.parametrize("block", [0, 1])
def test_cached_block_equals_the_teacher_forcing_forward(block):
    model = tiny_model()
    a = model.args
    nfpb, A = a.num_frame_per_block, a.num_action_per_block
    b = tiny_batch(a)
    with torch.no_grad():
        ref = model(**b, attn_backend="sdpa")
    cond = _cond(model, b)
    cache = KVCache()
    prefill(model, cache, b["clean_latents"][:, :, :1], cond)
    for j in range(block):
        prefill(model, cache, b["clean_latents"][:, :, 1 + j * nfpb:1 + (j + 1) * nfpb], cond)
    frames = slice(1 + block * nfpb, 1 + (block + 1) * nfpb)
    t = b["timestep"][:, frames.start]
    v, act = denoise_velocity(model, cache, b["noisy_latents"][:, :, frames], b["noisy_actions"][:, block * A:(block + 1) * A],
                              b["state"][:, block:block + 1], t, cond)
    torch.testing.assert_close(v, ref.video_pred[:, :, frames], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(act, ref.action_pred[:, block * A:(block + 1) * A], atol=2e-5, rtol=1e-4)


def test_prefill_refuses_partial_blocks():
    model = tiny_model()
    b = tiny_batch(model.args)
    cond = _cond(model, b)
    cache = KVCache()
    with pytest.raises(ValueError, match="prefill"):
        prefill(model, cache, b["clean_latents"][:, :, :2], cond)
    prefill(model, cache, b["clean_latents"][:, :, :1], cond)
    assert cache.num_frames == 1 and cache.num_tokens == 6
    with pytest.raises(ValueError, match="prefill"):
        prefill(model, cache, b["clean_latents"][:, :, 1:2], cond)


def test_sampler_is_deterministic_and_guidance_changes_the_video():
    model = tiny_model()
    b = tiny_batch(model.args, batch=1)
    cond = _cond(model, b)
    neg = Conditioning(*model.embed_context(torch.zeros_like(b["context"]), b["clip_feature"]))
    caches = []
    for c in (cond, neg):
        cache = KVCache()
        prefill(model, cache, b["clean_latents"][:, :, :1], c)
        caches.append(cache)
    state = b["state"][:, :1]
    run = lambda cfg, seed: sample_block(model, (caches[0], caches[1]), (cond, neg), state, (4, 6),  # noqa: E731
                                         SolverConfig(num_steps=4, cfg_scale=cfg), torch.Generator().manual_seed(seed))
    v1, a1 = run(3.0, 0)
    v2, a2 = run(3.0, 0)
    torch.testing.assert_close(v1, v2)
    torch.testing.assert_close(a1, a2)
    v3, a3 = run(1.0, 0)
    assert not torch.allclose(v1, v3)  # guidance changes the video...
    assert v1.shape == (1, model.args.in_dim, 2, 4, 6) and a1.shape == (1, 4, model.args.action_dim)


def test_q99_normalisation_round_trips_and_clips():
    st = NormStats(q01=np.array([0.0, -2.0, 5.0]), q99=np.array([10.0, 2.0, 5.0]))
    x = np.array([5.0, 1.0, 5.0])
    n = st.normalize(x)
    np.testing.assert_allclose(n, [0.0, 0.5, 5.0])  # identity where q01 == q99
    np.testing.assert_allclose(st.unnormalize(n), x)
    assert st.normalize(np.array([20.0, -9.0, 5.0]))[:2].tolist() == [1.0, -1.0]


@pytest.fixture(scope="module")
def tiny_policy(tmp_path_factory):
    from dzmodel.policy.sessions import build_tiny_policy

    return build_tiny_policy(tmp_path_factory.mktemp("tok"))


def _obs(rng, frames=1, prompt="pick up the red block", session="s"):
    shape = (64, 64, 3) if frames == 1 else (frames, 64, 64, 3)
    return {"images": rng.integers(0, 255, shape, dtype=np.uint8), "state": rng.uniform(-1, 1, 8),
            "prompt": prompt, "session_id": session}


def test_predict_actions_returns_an_unnormalised_chunk(tiny_policy):
    rng = np.random.default_rng(0)
    from dzmodel.data.transforms import NormStats

    tiny_policy.action_stats = NormStats(q01=np.full(7, 10.0), q99=np.full(7, 20.0))
    try:
        actions = tiny_policy.predict_actions(_obs(rng))
    finally:
        tiny_policy.action_stats = NormStats(q01=-np.ones(7), q99=np.ones(7))
    assert actions.shape == (tiny_policy.model.args.num_action_per_block, 7)
    assert (actions >= 10.0).all() and (actions <= 20.0).all()  # mapped back from [-1, 1] to [q01, q99]


def test_kv_cache_grows_within_a_session_and_resets(tiny_policy):
    rng = np.random.default_rng(1)
    nfpb = tiny_policy.model.args.num_frame_per_block
    tiny_policy.predict_actions(_obs(rng, session="a"))
    assert tiny_policy.sessions["a"].caches[0].num_frames == 1
    tiny_policy.predict_actions(_obs(rng, frames=4 * nfpb, session="a"))  # one more latent block
    assert tiny_policy.sessions["a"].caches[0].num_frames == 1 + nfpb
    tokens_before = tiny_policy.sessions["a"].caches[0].num_tokens
    assert tokens_before == (1 + nfpb) * 4  # 4 tokens per latent frame at 64x64
    tiny_policy.predict_actions(_obs(rng, session="b"))  # another session keeps its own cache
    assert tiny_policy.sessions["a"].caches[0].num_tokens == tokens_before
    tiny_policy.predict_actions(_obs(rng, frames=4 * nfpb, prompt="open the drawer", session="a"))  # new prompt
    assert tiny_policy.sessions["a"].caches[0].num_frames == 1
    tiny_policy.predict_actions(_obs(rng, frames=4 * nfpb, session="a"))
    tiny_policy.predict_actions(_obs(rng, frames=4 * nfpb, session="a"))  # window full -> the context slides
    assert tiny_policy.sessions["a"].caches[0].num_frames == tiny_policy.model.args.local_attn_size - nfpb


def _frames(rng, n):
    return rng.integers(0, 255, (n, 64, 64, 3), dtype=np.uint8)


def test_an_episode_keeps_its_history_as_a_training_window_would(tiny_policy):
    """Within a session each chunk is predicted from frame 0 and whole blocks ending at the newest frame: whole
    blocks extend the cache, a full window or a partial block (replanning mid-chunk) rebuilds it from the
    session's recent frames. Either way the chunk equals a new session given the same frames at once."""
    rng = np.random.default_rng(4)
    a = tiny_policy.model.args
    fpb = 4 * a.num_frame_per_block
    frames = _frames(rng, 1 + 3 * fpb + fpb // 2)
    state = rng.uniform(-1, 1, 8)

    def ask(sid, images, reset):
        return tiny_policy.predict_actions({"images": images, "state": state, "prompt": "p", "session_id": sid,
                                            "reset": reset})

    cuts = [1, 1 + fpb, 1 + 2 * fpb, 1 + 3 * fpb, len(frames)]  # a block, a block (window full), half a block
    held = []
    for i, end in enumerate(cuts):
        start = cuts[i - 1] if i else 0
        chunk = ask("episode", frames[start:end], reset=i == 0)
        held.append(tiny_policy.sessions["episode"].caches[0].num_frames)
        fresh = ask(f"fresh{i}", frames[:end], reset=True)
        np.testing.assert_allclose(chunk, fresh, atol=1e-5)
    assert held == [1, 1 + a.num_frame_per_block, 1 + a.num_frame_per_block * (a.max_chunk_size - 1),
                    1 + a.num_frame_per_block * (a.max_chunk_size - 1), 1 + a.num_frame_per_block * (a.max_chunk_size - 1)]
    assert tiny_policy.sessions["episode"].raw_frames == len(frames)
    # the history changes the chunk: restarting from the newest frame alone gives another one
    alone = ask("alone", frames[-1:], reset=True)
    assert not np.allclose(alone, ask("full", frames, reset=True), atol=1e-4)


def test_a_reset_flag_restarts_a_session_whatever_it_sends(tiny_policy):
    rng = np.random.default_rng(5)
    fpb = 4 * tiny_policy.model.args.num_frame_per_block
    obs = {"images": _frames(rng, 1), "state": np.zeros(8), "prompt": "p", "session_id": "r", "reset": True}
    tiny_policy.predict_actions(obs)
    tiny_policy.predict_actions(dict(obs, images=_frames(rng, fpb), reset=False))
    assert tiny_policy.sessions["r"].raw_frames == 1 + fpb
    tiny_policy.predict_actions(dict(obs, images=_frames(rng, 1), reset=False))  # one new frame extends, no restart
    assert tiny_policy.sessions["r"].raw_frames == 2 + fpb
    tiny_policy.predict_actions(dict(obs, images=_frames(rng, fpb)))  # reset: True
    assert tiny_policy.sessions["r"].raw_frames == fpb


def test_predict_actions_is_deterministic_per_seed(tiny_policy):
    rng = np.random.default_rng(2)
    obs = _obs(rng, session="d1")
    a = tiny_policy.predict_actions(obs)
    b = tiny_policy.predict_actions(dict(obs, session_id="d2"))
    np.testing.assert_array_equal(a, b)


def test_bad_observations_are_refused(tiny_policy):
    rng = np.random.default_rng(3)
    with pytest.raises(ValueError, match="missing 'prompt'"):
        tiny_policy.predict_actions({"images": np.zeros((64, 64, 3), np.uint8), "state": np.zeros(8)})
    with pytest.raises(ValueError, match="uint8"):
        tiny_policy.predict_actions(dict(_obs(rng), images=np.zeros((64, 64, 3), np.float32)))
    with pytest.raises(ValueError, match="state has 3 dims"):
        tiny_policy.predict_actions(dict(_obs(rng), state=np.zeros(3)))


def test_odd_latent_height_is_cropped_to_whole_patches(tmp_path):
    """176x320 frames give 11 latent rows on 5B (reference §7.8); the patch conv drops the odd row, and the
    solver's latents must match. Tiny: 80 px / 16 = 5 rows."""
    import numpy as np

    from dzmodel.policy.sessions import build_tiny_policy

    policy = build_tiny_policy(tmp_path / "tok")
    policy.image_size = (80, 64)
    actions = policy.predict_actions({"images": np.zeros((80, 64, 3), np.uint8), "state": np.zeros(8), "prompt": "x"})
    assert actions.shape == (policy.model.args.num_action_per_block, 7)
