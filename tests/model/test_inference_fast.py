"""The fast inference path gives the reference's chunks: batched sessions, the CUDA-graph code path
(run without capture on CPU), streamed VAE encoding, and the bounded error of bf16 weights and DiT caching."""

import copy

import numpy as np
import pytest
import torch

from dzmodel.policy.sessions import build_tiny_policy
from dzmodel.model.cuda_graphs import GraphCache
from dzmodel.model.sampler import Conditioning, KVCache, SolverConfig, draw_noise, interleave_cfg, prefill, solve, split_cfg

from .helpers import tiny_batch, tiny_model


def _obs(seed, frames=1, prompt="pick up the red block", session="s"):
    rng = np.random.default_rng(seed)
    shape = (64, 64, 3) if frames == 1 else (frames, 64, 64, 3)
    return {"images": rng.integers(0, 255, shape, dtype=np.uint8), "state": rng.uniform(-1, 1, 8),
            "prompt": prompt, "session_id": session}


@pytest.mark.parametrize("cfg_scale", [5.0, 1.0])
def test_a_batch_of_sessions_equals_one_call_each(tmp_path, cfg_scale):
    """Sessions at different cache lengths and prompts in one predict_batch call give each its own chunk."""
    solver = SolverConfig(num_steps=4, cfg_scale=cfg_scale)
    singles, batched = (build_tiny_policy(tmp_path, solver=solver) for _ in range(2))
    for p in (singles, batched):  # session "long" first holds frame 0, then frame 0 + one block
        p.predict_actions(_obs(0, session="long"))
    second = [_obs(1, frames=8, session="long"), _obs(2, session="a"), _obs(3, prompt="open the drawer", session="b")]
    expected = [singles.predict_actions(o) for o in second]
    got = batched.predict_batch(second)
    assert batched.sessions["long"].cache.num_frames == 3 and batched.sessions["a"].cache.num_frames == 1
    for e, g in zip(expected, got):
        np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="repeated"):
        batched.predict_batch([_obs(4, session="x"), _obs(5, session="x")])


def test_the_graph_code_path_equals_the_direct_one(tmp_path):
    """On the GPU prefill and solver run through GraphCache (flattened inputs, captured per shape); on CPU the
    same flattening runs uncaptured and must give the direct path's chunks."""
    solver = SolverConfig(num_steps=4, cfg_scale=5.0)
    direct, graphed = (build_tiny_policy(tmp_path, solver=solver) for _ in range(2))
    graphed.graphs = GraphCache(enabled=True, capture=False)
    for obs in (_obs(0, session="g"), _obs(1, frames=8, session="g"), _obs(2, session="h")):
        np.testing.assert_allclose(graphed.predict_actions(dict(obs)), direct.predict_actions(dict(obs)),
                                   rtol=1e-5, atol=1e-6)
    # three sessions are padded to a batch of four (one captured shape per power of two); the pad is dropped
    batch = [_obs(3 + i, session=f"b{i}") for i in range(3)]
    for g, d in zip(graphed.predict_batch(batch), direct.predict_batch(batch)):
        np.testing.assert_allclose(g, d, rtol=1e-4, atol=1e-5)
    assert not any(sid.startswith("b3") for sid in graphed.sessions)
    # the image encoder goes through the graphs too: one shape per padded batch
    assert sorted(shapes[0][0][0] for key, shapes in graphed.graphs._graphs if key == ("clip",)) == [1, 4]


def test_frames_sent_in_pieces_equal_frames_sent_at_once(tmp_path):
    """Only new frames go through the VAE (its stream state keeps the history): 1 + 4 + 4 frames give the
    chunk and cache of 1 + 8, as DreamZero's client sends them."""
    solver = SolverConfig(num_steps=4, cfg_scale=5.0)
    pieces, whole = (build_tiny_policy(tmp_path, solver=solver) for _ in range(2))
    frames = _obs(1, frames=8)["images"]
    pieces.predict_actions(_obs(0))
    pieces.predict_actions(dict(_obs(0), images=frames[:4]))
    assert pieces.sessions["s"].cache.num_frames == 1  # one latent frame waits for its block
    a = pieces.predict_actions(dict(_obs(0), images=frames[4:]))
    whole.predict_actions(_obs(0))
    b = whole.predict_actions(dict(_obs(0), images=frames))
    assert pieces.sessions["s"].cache.num_frames == whole.sessions["s"].cache.num_frames == 3
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def _displacement_error(fast_dtype, solver: SolverConfig) -> tuple[float, float]:
    """Relative error of the fast setting's solver displacement (output minus the shared noise) against fp32 at 16
    steps, on random weights, for video and actions. Displacement, not output: the noise would hide the error."""
    torch.manual_seed(0)
    reference_model = tiny_model()
    b = tiny_batch(reference_model.args, batch=2)
    video, actions = draw_noise(reference_model, 2, (4, 6), "cpu", torch.Generator().manual_seed(0))
    state = b["state"][:, :1]

    def run(model, cfg):
        dtype = model.patch_embedding.weight.dtype
        conds = [Conditioning(*model.embed_context(ctx.to(dtype), b["clip_feature"]))
                 for ctx in (b["context"], torch.zeros_like(b["context"]))]
        caches = []
        for c in conds:
            caches.append(KVCache())
            prefill(model, caches[-1], b["clean_latents"][:, :, :1], c)
        cache, cond = interleave_cfg(tuple(caches), tuple(conds))
        assert split_cfg(cache, cond)[0][0].layers[0][0].equal(caches[0].layers[0][0])
        with torch.no_grad():
            return solve(model, cache, cond, state, video, actions, cfg, guided=True)

    ref = run(reference_model, SolverConfig(num_steps=16, cfg_scale=5.0))
    out = run(copy.deepcopy(reference_model).to(fast_dtype), solver)
    errs = [float(((o - n) - (r - n)).norm() / (r - n).norm()) for r, o, n in zip(ref, out, (video, actions))]
    return errs[0], errs[1]


def test_bf16_weights_stay_close_to_fp32():
    video_err, action_err = _displacement_error(torch.bfloat16, SolverConfig(num_steps=16, cfg_scale=5.0))
    assert video_err < 0.03 and action_err < 0.03  # measured ~0.010 / ~0.006


def test_dit_caching_error_is_bounded_and_the_bound_can_fail():
    """upstream's schedule (8 of 16 DiT forwards) with bf16 weights: measured ~0.13 / ~0.12 on random weights,
    where the velocity field is far from straight; one forward reused for all 16 steps breaks the bound."""
    video_err, action_err = _displacement_error(torch.bfloat16, SolverConfig(num_steps=16, cfg_scale=5.0,
                                                                             dit_steps="upstream"))
    assert video_err < 0.2 and action_err < 0.2
    crude = SolverConfig(num_steps=16, cfg_scale=5.0, dit_steps="T" + "F" * 15)
    assert max(_displacement_error(torch.float32, crude)) > 0.2


def test_solver_schedule_is_validated():
    assert SolverConfig(num_steps=16, dit_steps="upstream").dit_forwards == 8
    with pytest.raises(ValueError, match="one T/F per solver step"):
        SolverConfig(num_steps=4, dit_steps="upstream")
    with pytest.raises(ValueError, match="start with T"):
        SolverConfig(num_steps=2, dit_steps="FT")
    with pytest.raises(ValueError, match="string of T and F"):
        SolverConfig(num_steps=2, dit_steps="TX")


def test_first_frame_condition_is_encoded_only_as_far_as_needed(tmp_path):
    """14B-style models (concat_first_frame_latent): y grows block by block with its own VAE stream and equals the
    first frames of encoding the whole window [frame 0, zeros...] at once (what the policy did before)."""
    import numpy as np

    from dzmodel.model.args import preset
    from dzmodel.model.components import build_encoders
    from dzmodel.policy.sessions import build_policy
    from dzmodel.data.transforms import NormStats
    from dzmodel.model.tokenizer import build_tiny_tokenizer, load_tokenizer
    from dzmodel.model.wam import DreamZeroWAM

    torch.manual_seed(0)
    model = DreamZeroWAM(preset("tiny", in_dim=8 + 4 + 8, concat_first_frame_latent=True))  # noisy | mask | z
    stats = NormStats(q01=-np.ones(7), q99=np.ones(7))
    policy = build_policy(model, build_encoders("tiny"), load_tokenizer(build_tiny_tokenizer(tmp_path)), stats,
                          NormStats(q01=-np.ones(8), q99=np.ones(8)), solver=SolverConfig(num_steps=2, cfg_scale=5.0))
    policy.predict_actions(_obs(0))
    session = policy.sessions["s"]
    assert session.cond.y.shape[2] == 1 + 2  # frame 0 and the block being solved
    frame0 = policy._frames(_obs(0)["images"])[:, :, -1]
    chunk = policy.predict_actions(_obs(1, frames=8))
    assert session.cache.num_frames == 3 and session.cond.y.shape[2] == 5 and np.isfinite(chunk).all()
    window = (model.args.local_attn_size - 1) * 4 + 1
    whole = policy._encode(torch.cat([frame0[:, :, None], frame0.new_zeros(1, 3, window - 1, 64, 64)], dim=2))
    torch.testing.assert_close(session.cond.y[0:1, 4:], whole[:, :, :5], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(session.cond.y[1:2], session.cond.y[0:1])  # the unconditional branch's copy
    assert (session.cond.y[:, :4, 0] == 1).all() and (session.cond.y[:, :4, 1:] == 0).all()


def test_the_14b_style_graph_path_equals_the_direct_one(tmp_path):
    """A 14B-style model encodes frame 0 and y's window through the graphs at each reset (two VAE starts, their stream
    states among the outputs); batched sessions, a growing y and later resets give the direct path's chunks."""
    from dzmodel.model.args import preset
    from dzmodel.model.components import build_encoders
    from dzmodel.policy.sessions import build_policy
    from dzmodel.data.transforms import NormStats
    from dzmodel.model.tokenizer import build_tiny_tokenizer, load_tokenizer
    from dzmodel.model.wam import DreamZeroWAM

    tokenizer = load_tokenizer(build_tiny_tokenizer(tmp_path))

    def policy():
        torch.manual_seed(0)
        model = DreamZeroWAM(preset("tiny", in_dim=8 + 4 + 8, concat_first_frame_latent=True))
        return build_policy(model, build_encoders("tiny"), tokenizer, NormStats(q01=-np.ones(7), q99=np.ones(7)),
                            NormStats(q01=-np.ones(8), q99=np.ones(8)), solver=SolverConfig(num_steps=2, cfg_scale=5.0))

    graphed, direct = policy(), policy()
    graphed.graphs = GraphCache(enabled=True, capture=False)
    calls = [[_obs(0, session="a"), _obs(1, session="b", prompt="pick up the bowl and place it on the plate")],
             [_obs(2, frames=8, session="a"), _obs(3, frames=4, session="b")],
             [_obs(4, session="a")]]
    for obs in calls:
        for g, d in zip(graphed.predict_batch([dict(o) for o in obs]), direct.predict_batch([dict(o) for o in obs])):
            np.testing.assert_allclose(g, d, rtol=1e-5, atol=1e-6)
    assert sum(key[0] == "vae start" for key, _ in graphed.graphs._graphs) == 4  # frame 0 and y, batches 2 and 1


def test_cross_attention_kv_computed_once_equals_per_step():
    """The solver computes every layer's text/image K/V once per chunk; a step given them equals one that
    computes them itself."""
    from dzmodel.model.sampler import denoise_velocity

    torch.manual_seed(0)
    model = tiny_model()
    b = tiny_batch(model.args, batch=2)
    cond = Conditioning(*model.embed_context(b["context"], b["clip_feature"]))
    cache = KVCache()
    prefill(model, cache, b["clean_latents"][:, :, :1], cond)
    args = (b["noisy_latents"][:, :, 1:3], b["noisy_actions"][:, :4], b["state"][:, :1], b["timestep"][:, 1])
    with torch.no_grad():
        fresh = denoise_velocity(model, cache, *args, cond)
        reused = denoise_velocity(model, cache, *args, cond, model.cross_kv(cond.text, cond.image))
    for x, y in zip(fresh, reused):
        torch.testing.assert_close(x, y)


@pytest.mark.parametrize("sessions,graphs", [(4, False), (3, True)])
def test_sessions_restarted_together_share_their_vae_and_prefill_calls(tmp_path, sessions, graphs):
    """Restarting sessions from a context of frame 0 and whole blocks (every query once the window slides, as in
    LIBERO evaluation) encodes and prefills the whole batch at once: 2 VAE calls and 2 prefills for 4 sessions,
    not 1 + 4 each. The chunks equal one call per session, also through the graph code path (3 sessions padded
    to 4)."""
    solver = SolverConfig(num_steps=2, cfg_scale=1.0)
    singles, batched = (build_tiny_policy(tmp_path, solver=solver) for _ in range(2))
    if graphs:
        batched.graphs = GraphCache(enabled=True, capture=False)
    obs = [dict(_obs(i, frames=9, session=f"s{i}"), reset=True) for i in range(sessions)]
    calls = {"vae": 0, "prefill": 0}
    encode, prefill_ = batched._encode, batched._prefill

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    batched._encode, batched._prefill = counted("vae", encode), counted("prefill", prefill_)
    got = batched.predict_batch(obs)
    assert calls == {"vae": 2, "prefill": 2}
    assert set(batched.sessions) == {f"s{i}" for i in range(sessions)}  # a padding row is no session
    assert {s.cache.num_frames for s in batched.sessions.values()} == {1 + batched.model.args.num_frame_per_block}
    for o, g in zip(obs, got):
        np.testing.assert_allclose(g, singles.predict_actions(o), rtol=1e-4, atol=1e-5)
    # a later frame extends each session from its own stream state, as it would have alone
    more = [dict(_obs(10 + i, frames=4, session=f"s{i}")) for i in range(sessions)]
    for o, g in zip(more, batched.predict_batch(more)):
        np.testing.assert_allclose(g, singles.predict_actions(o), rtol=1e-4, atol=1e-5)


def _libero_like_captures(tmp_path, max_graphs: int) -> tuple[int, int]:
    """Captures and calls of a LIBERO-like evaluation through the graph code path (CPU: counted, not captured): 16
    episodes at a time, each starting from one frame and then sending 4 frames a query, batches of 1-16 sessions,
    episodes ending and new ones starting; as `dz eval libero` with batched policy calls sends them."""
    policy = build_tiny_policy(tmp_path, solver=SolverConfig(num_steps=1, cfg_scale=1.0))
    policy.graphs = GraphCache(enabled=True, capture=False, max_graphs=max_graphs)
    rng = np.random.default_rng(0)
    episode = list(range(16))  # the episode each of 16 env workers runs
    started = [False] * 16
    for call in range(40):
        workers = sorted(rng.choice(16, size=int(rng.choice([1, 2, 3, 5, 8, 11, 16])), replace=False))
        obs = []
        for w in workers:
            if started[w] and rng.random() < 0.1:  # the episode ended: the worker starts the next one
                episode[w], started[w] = episode[w] + 16, False
            o = _obs(100 * call + w, frames=1 if not started[w] else 4, session=f"ep{episode[w]}")
            obs.append(dict(o, reset=not started[w]))
            started[w] = True
        policy.predict_batch(obs)
    return policy.graphs.captures, policy.graphs.replays


def test_an_evaluation_captures_each_shape_once(tmp_path):
    """The graphs an evaluation needs fit the cache: each (work, cache length, padded batch) is captured once. With
    the earlier cap of 16 the least recently used were dropped and captured again and again."""
    from dzmodel.model.cuda_graphs import MAX_GRAPHS

    unbounded, calls = _libero_like_captures(tmp_path / "a", max_graphs=10**6)
    assert _libero_like_captures(tmp_path / "b", max_graphs=MAX_GRAPHS) == (unbounded, calls)
    assert unbounded >= 12 and calls > 4 * unbounded  # the schedule meets many shapes, and mostly replays
    assert _libero_like_captures(tmp_path / "c", max_graphs=unbounded // 2)[0] > unbounded


def test_text_rows_kept_are_a_power_of_two_above_the_longest_prompt():
    from dzmodel.model.sampler import text_rows_for

    assert [text_rows_for(n, 512) for n in (0, 1, 7, 8, 15, 16, 100, 255)] == [8, 8, 8, 16, 16, 32, 128, 256]
    assert text_rows_for(256, 512) == 512 and text_rows_for(8, 16) == 16  # no rows left out: the whole context


def _chunk_and_flops(policy, obs):
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        chunk = policy.predict_actions(dict(obs))
    return chunk, counter.get_total_flops()


def test_a_short_prompt_projects_only_its_rows_with_the_same_chunk(tmp_path, monkeypatch):
    """A prompt's rows past its tokens are one padding row: the policy keeps the first rows (a power of two above the
    longest prompt) and projects the pad's K and V once. Same chunk as the whole context, fewer FLOPs; a prompt
    that leaves no row out costs what it did."""
    from dzmodel.policy import sessions as inference

    solver = SolverConfig(num_steps=4, cfg_scale=5.0)
    padded, whole = (build_tiny_policy(tmp_path, solver=solver) for _ in range(2))
    monkeypatch.setattr(inference, "text_rows_for", lambda tokens, text_len: text_len)  # the whole context
    obs = _obs(0, prompt="pick up the red block")  # 6 tokens of the tiny preset's 16
    expected, whole_flops = _chunk_and_flops(whole, obs)
    monkeypatch.undo()
    got, padded_flops = _chunk_and_flops(padded, obs)
    assert padded.sessions["s"].cond.text.shape[1] == 8 and whole.sessions["s"].cond.text.shape[1] == 16
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    assert padded_flops < whole_flops
    long_prompt = _obs(1, prompt="pick up the bowl and place it on the plate", session="long")  # 11 tokens: 16 rows
    monkeypatch.setattr(inference, "text_rows_for", lambda tokens, text_len: text_len)
    _, whole_long = _chunk_and_flops(whole, long_prompt)
    monkeypatch.undo()
    assert _chunk_and_flops(padded, long_prompt)[1] == whole_long


def test_sessions_with_fewer_text_rows_batch_with_longer_ones(tmp_path):
    """The rows kept only grow with the longest prompt seen, and a session conditioned on fewer rows (before a longer
    prompt came) is extended with its padding row when batched with newer ones: the same chunks as one call each."""
    solver = SolverConfig(num_steps=4, cfg_scale=5.0)
    singles, batched = (build_tiny_policy(tmp_path, solver=solver) for _ in range(2))
    first = _obs(0, prompt="open", session="short")
    for p in (singles, batched):
        p.predict_actions(first)
    assert batched.sessions["short"].cond.text.shape[1] == 8
    batched.predict_actions(_obs(1, prompt="pick up the bowl and place it on the plate", session="long"))
    assert batched.sessions["long"].cond.text.shape[1] == 16
    later = [_obs(2, frames=8, prompt="open", session="short"), _obs(3, prompt="open the drawer", session="new")]
    singles.predict_actions(_obs(1, prompt="pick up the bowl and place it on the plate", session="long"))
    expected = [singles.predict_actions(o) for o in later]
    for e, g in zip(expected, batched.predict_batch(later)):
        np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-5)
    assert batched.sessions["new"].cond.text.shape[1] == 16  # not back to 8: one shape for the graphs


def test_conditionings_of_different_text_rows_stack_to_their_whole_contexts():
    from dzmodel.model.sampler import block_text

    torch.manual_seed(0)
    model = tiny_model()
    a = model.args
    pad = model.text_embedding(torch.zeros(1, 1, a.text_dim))
    short = torch.cat([torch.randn(2, 3, a.dim), pad.expand(2, 5, -1)], dim=1)  # 3 prompt rows, kept 8
    longer = torch.cat([torch.randn(1, 9, a.dim), pad.expand(1, 7, -1)], dim=1)  # 9 rows, the whole 16
    stacked = Conditioning.stack([Conditioning(text=short, image=None), Conditioning(text=longer, image=None)])
    assert stacked.text.shape == (3, 16, a.dim)
    torch.testing.assert_close(stacked.text, torch.cat([block_text(model, short).full(), longer]))


def test_a_compiled_policy_keeps_a_compiled_block_for_every_shape_it_meets(tmp_path):
    """Batches of 1-8 sessions (prefill and solver, each batch size with CFG) are more shapes than dynamo's default
    recompile limit of 8, past which the block would run eagerly inside the graphs."""
    from dzmodel.policy.sessions import COMPILED_SHAPES

    policy = build_tiny_policy(tmp_path)
    with torch._dynamo.config.patch(recompile_limit=8):  # dynamo's default; the process's value comes back after
        policy.set_compile(True)
        assert torch._dynamo.config.recompile_limit == COMPILED_SHAPES >= 2 * 4 * 2  # (prefill, solver) x batches x rows
    policy.set_compile(False)
