"""The DreamZero WAM: fixture parity, presets, training step, mask and causality properties."""

import contextlib
import time

import pytest
import torch

from dzmodel.model.args import preset
from dzmodel.model.attention import latent_layout
from dzmodel.model.objective import FlowMatchSchedule, flow_matching_losses
from tests.model.helpers import sample_timestep_ids
from dzmodel.model.parity import run_parity
from dzmodel.model.wam import DreamZeroWAM

from .helpers import tiny_batch, tiny_model


def test_wam_fixture_parity(fixtures_dir):
    result = run_parity(fixtures_dir / "dreamzero_wam_tiny_reference.safetensors")
    assert result.kind == "wam"
    for key in ("output.video_pred", "output.action_pred", "output.dynamics_loss", "output.action_loss",
                "output.loss", "output.attention_mask"):
        assert key in result.errors
    assert result.ok, result.report()


@pytest.mark.parametrize("name,expected", [("dreamzero_5b", 5.607e9), ("dreamzero_14b", 16.484e9)])
def test_big_presets_param_counts_and_instant_meta_init(name, expected):
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = DreamZeroWAM(preset(name))
    elapsed = time.perf_counter() - t0
    n = sum(p.numel() for p in model.parameters())
    assert abs(n - expected) / expected < 0.005, n
    assert elapsed < 5.0
    assert all(p.is_meta for p in model.parameters())


def test_preset_overrides_and_unknown_names():
    assert preset("dreamzero_5b", num_layers=3).num_layers == 3
    with pytest.raises(KeyError, match="unknown model preset"):
        preset("nope")
    with pytest.raises(ValueError, match="unknown override"):
        preset("tiny", widht=3)


def test_tiny_training_step_is_well_under_a_second():
    torch.set_num_threads(2)
    model = tiny_model().train()
    args = model.args
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.95, 0.999), weight_decay=1e-5)
    sched = FlowMatchSchedule()
    g = torch.Generator().manual_seed(0)
    b = tiny_batch(args, batch=2)
    actions = torch.rand(2, args.max_chunk_size * args.num_action_per_block, args.action_dim, generator=g) * 2 - 1
    mask = torch.ones_like(actions, dtype=torch.bool)

    def step():
        _, ids, aids = sample_timestep_ids(2, args.num_frames, args.num_frame_per_block, args.num_action_per_block, generator=g)
        noise, noise_a = torch.randn_like(b["clean_latents"]), torch.randn_like(actions)
        out = model(sched.add_noise(b["clean_latents"], noise, ids, 2), b["clean_latents"], sched.timestep(ids),
                    sched.add_noise(actions, noise_a, aids, 1), sched.timestep(aids), b["state"], b["context"],
                    b["clip_feature"], attn_backend="sdpa")
        losses = flow_matching_losses(sched, out.video_pred, out.action_pred, b["clean_latents"], noise, actions, noise_a,
                                      ids, aids, mask, torch.ones(2, dtype=torch.bool))
        opt.zero_grad()
        losses.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return losses

    first = step()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        last = step()
        times.append(time.perf_counter() - t0)
    assert sorted(times)[2] < 0.5, times
    assert torch.isfinite(first.loss) and torch.isfinite(last.loss)
    assert all(p.grad is not None for p in model.parameters())


def test_last_clean_block_cannot_change_outputs():
    model = tiny_model()
    b = tiny_batch(model.args)
    out = model(**b, attn_backend="sdpa")
    b2 = dict(b)
    b2["clean_latents"] = b["clean_latents"].clone()
    b2["clean_latents"][:, :, -2:] = torch.randn_like(b2["clean_latents"][:, :, -2:])
    out2 = model(**b2, attn_backend="sdpa")
    torch.testing.assert_close(out.video_pred, out2.video_pred)
    torch.testing.assert_close(out.action_pred, out2.action_pred)


@pytest.mark.parametrize("backend", ["sdpa", "segments", "flex"])
def test_training_sequence_without_the_last_clean_block_gives_upstreams_outputs_and_gradients(monkeypatch, backend):
    """Training leaves out the last clean block; upstream's whole sequence must give the same outputs and
    gradients, and the sequence must be shorter by that block."""
    import dzmodel.model.wam as wam

    model = tiny_model().double()
    b = {k: v.double() if v.is_floating_point() else v for k, v in tiny_batch(model.args).items()}
    tokens, results = {}, {}
    for whole in (False, True):
        def layout(*args, **kwargs):
            result = latent_layout(*args, **kwargs, keep_last_clean_block=whole)
            tokens[whole] = result.seq_len
            return result

        monkeypatch.setattr(wam, "latent_layout", layout)
        model.zero_grad()
        with torch.no_grad() if backend == "flex" else contextlib.nullcontext():
            out = model(**b, attn_backend=backend)
        if backend != "flex":
            (out.video_pred.square().mean() + out.action_pred.square().mean()).backward()
        results[whole] = (out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    a = model.args
    block_tokens = a.num_frame_per_block * 4 * 6 // (a.patch_size[1] * a.patch_size[2])
    assert tokens[True] - tokens[False] == block_tokens
    (trimmed, g_trimmed), (whole, g_whole) = results[False], results[True]
    tol = dict(atol=1e-5, rtol=1e-5) if backend == "flex" else dict(atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(trimmed.video_pred, whole.video_pred, **tol)
    torch.testing.assert_close(trimmed.action_pred, whole.action_pred, **tol)
    assert g_trimmed.keys() == g_whole.keys() and (backend == "flex" or len(g_whole) > 10)
    for n in g_whole:
        torch.testing.assert_close(g_trimmed[n], g_whole[n], atol=1e-12, rtol=1e-9, msg=n)


@pytest.mark.parametrize("backend", ["sdpa", "segments", "flex"])
def test_leaving_out_the_noisy_first_frame_keeps_every_other_output(backend):
    """Nothing attends the noisy frame 0 and it attends only itself: without it, the noisy frames 1.. and the
    actions come out as before (float64), from a sequence one frame shorter; its own output is gone."""
    model = tiny_model().double()
    b = {k: v.double() if v.is_floating_point() else v for k, v in tiny_batch(model.args).items()}
    rows = []
    handle = model.blocks[0].ffn.register_forward_hook(lambda m, i, o: rows.append(i[0].shape[1]) and None)
    with torch.no_grad():
        whole = model(**b, attn_backend=backend)
        without = model(**b, attn_backend=backend, noisy_first_frame=False)
    handle.remove()
    fs = b["noisy_latents"].shape[-2] * b["noisy_latents"].shape[-1] // (model.args.patch_size[1] * model.args.patch_size[2])
    assert rows[0] - rows[1] == fs
    assert without.video_pred.shape[2] == whole.video_pred.shape[2] - 1
    tol = dict(atol=1e-5, rtol=1e-5) if backend == "flex" else dict(atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(without.video_pred, whole.video_pred[:, :, 1:], **tol)
    torch.testing.assert_close(without.action_pred, whole.action_pred, **tol)
    # frame 0's noisy input no longer reaches anything
    b2 = dict(b, noisy_latents=b["noisy_latents"].clone())
    b2["noisy_latents"][:, :, 0] += 1.0
    with torch.no_grad():
        moved = model(**b2, attn_backend=backend, noisy_first_frame=False)
    torch.testing.assert_close(moved.video_pred, without.video_pred, atol=0, rtol=0)


def test_block_causality_future_blocks_do_not_leak_backwards():
    """Noisy block 0 and its actions must not see block 1 (neither clean nor noisy nor its actions)."""
    model = tiny_model()
    A = model.args.num_action_per_block
    b = tiny_batch(model.args)
    out = model(**b, attn_backend="sdpa")
    b2 = {k: v.clone() for k, v in b.items()}
    b2["clean_latents"][:, :, 3:] += 1.0
    b2["noisy_latents"][:, :, 3:] += 1.0
    b2["noisy_actions"][:, A:] += 1.0
    b2["state"][:, 1:] += 1.0
    out2 = model(**b2, attn_backend="sdpa")
    torch.testing.assert_close(out.video_pred[:, :, :3], out2.video_pred[:, :, :3])
    torch.testing.assert_close(out.action_pred[:, :A], out2.action_pred[:, :A])
    assert not torch.allclose(out.action_pred[:, A:], out2.action_pred[:, A:])
    # ...while block 1 does see clean block 0
    b3 = {k: v.clone() for k, v in b.items()}
    b3["clean_latents"][:, :, 1:3] += 1.0
    out3 = model(**b3, attn_backend="sdpa")
    assert not torch.allclose(out.action_pred[:, A:], out3.action_pred[:, A:])


def test_state_tokens_condition_actions_of_their_block():
    model = tiny_model()
    A = model.args.num_action_per_block
    b = tiny_batch(model.args)
    out = model(**b, attn_backend="sdpa")
    b2 = {k: v.clone() for k, v in b.items()}
    b2["state"][:, 0] += 1.0
    out2 = model(**b2, attn_backend="sdpa")
    assert not torch.allclose(out.action_pred[:, :A], out2.action_pred[:, :A])
    torch.testing.assert_close(out.action_pred[:, A:], out2.action_pred[:, A:])


def test_flex_and_sdpa_give_the_same_wam_forward():
    model = tiny_model()
    b = tiny_batch(model.args)
    with torch.no_grad():
        a = model(**b, attn_backend="sdpa")
        f = model(**b, attn_backend="flex")
    torch.testing.assert_close(a.video_pred, f.video_pred, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a.action_pred, f.action_pred, atol=1e-5, rtol=1e-5)


def test_segmented_attention_gives_the_same_wam_forward_and_gradients():
    model = tiny_model().double()
    b = {k: v.double() if v.is_floating_point() else v for k, v in tiny_batch(model.args).items()}
    results = {}
    for backend in ("sdpa", "segments"):
        model.zero_grad()
        out = model(**b, attn_backend=backend)
        (out.video_pred.square().mean() + out.action_pred.square().mean()).backward()
        results[backend] = (out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    (a, ga), (s, gs) = results["sdpa"], results["segments"]
    torch.testing.assert_close(s.video_pred, a.video_pred, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(s.action_pred, a.action_pred, atol=1e-12, rtol=1e-10)
    assert ga.keys() == gs.keys() and len(ga) > 10
    for n in ga:
        torch.testing.assert_close(gs[n], ga[n], atol=1e-12, rtol=1e-9, msg=n)


def test_embodiment_id_is_ignored_like_upstream():
    model = tiny_model()
    b = tiny_batch(model.args)
    a = model(**b, embodiment_id=torch.tensor([0, 0]), attn_backend="sdpa")
    c = model(**b, embodiment_id=torch.tensor([17, 21]), attn_backend="sdpa")
    torch.testing.assert_close(a.action_pred, c.action_pred)


def test_first_frame_concat_model_requires_y():
    torch.manual_seed(0)
    args = preset("tiny", in_dim=8 + 20, concat_first_frame_latent=True)
    model = DreamZeroWAM(args).eval()
    b = tiny_batch(preset("tiny"))
    with pytest.raises(ValueError, match="first-frame latent"):
        model(**b, attn_backend="sdpa")
    y = torch.randn(2, 20, *b["clean_latents"].shape[2:])
    out = model(**b, y=y, attn_backend="sdpa")
    assert out.video_pred.shape == b["clean_latents"].shape


def test_bad_shapes_get_clear_errors():
    model = tiny_model()
    b = tiny_batch(model.args)
    bad = dict(b, noisy_actions=b["noisy_actions"][:, :3])
    with pytest.raises(ValueError, match="actions"):
        model(**bad, attn_backend="sdpa")
    bad = dict(b, timestep=b["timestep"][:, :2])
    with pytest.raises(ValueError, match="timestep"):
        model(**bad, attn_backend="sdpa")
    bad = dict(b, noisy_latents=b["noisy_latents"][:, :, :4], clean_latents=b["clean_latents"][:, :, :4])
    with pytest.raises(ValueError, match="latent frames"):
        model(**bad, attn_backend="sdpa")


@pytest.mark.parametrize("backend", ["sdpa", "segments"])
def test_last_layer_computing_only_the_loss_rows_gives_the_same_outputs_and_gradients(monkeypatch, backend):
    """The last block computes the noisy video's and the actions' rows only; running it over every row and
    slicing after must give the same outputs and gradients (float64), and the narrowed block must see fewer rows."""
    import dzmodel.model.wam as wam
    from dzmodel.model.wan_dit import WanAttentionBlock

    model = tiny_model().double()
    b = {k: v.double() if v.is_floating_point() else v for k, v in tiny_batch(model.args).items()}
    ffn_rows, results = {}, {}
    for narrow in (True, False):
        monkeypatch.setattr(wam, "narrows_queries", lambda mask, n=narrow: n)
        seen = []
        handles = [blk.ffn.register_forward_hook(lambda m, i, o: seen.append(i[0].shape[1])) for blk in model.blocks]
        model.zero_grad()
        out = model(**b, attn_backend=backend)
        for h in handles:
            h.remove()
        (out.video_pred.square().mean() + out.action_pred.square().mean()).backward()
        ffn_rows[narrow] = seen
        results[narrow] = (out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    layout = latent_layout(model.args, tuple(b["noisy_latents"].shape[-2:]), b["noisy_latents"].shape[2])
    assert ffn_rows[False] == [layout.seq_len] * len(model.blocks)
    assert ffn_rows[True] == [layout.seq_len] * (len(model.blocks) - 1) + [layout.video_len + layout.action_len]
    assert isinstance(model.blocks[-1], WanAttentionBlock)
    (narrowed, g_narrowed), (whole, g_whole) = results[True], results[False]
    torch.testing.assert_close(narrowed.video_pred, whole.video_pred, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(narrowed.action_pred, whole.action_pred, atol=1e-12, rtol=1e-10)
    assert g_narrowed.keys() == g_whole.keys() and len(g_whole) > 10
    for n in g_whole:
        # WAN's modulation runs in fp32, and the narrowed block sums its gradient in two parts
        tol = dict(atol=1e-6, rtol=1e-6) if n.endswith(".modulation") else dict(atol=1e-12, rtol=1e-9)
        torch.testing.assert_close(g_narrowed[n], g_whole[n], **tol, msg=lambda m, n=n: f"{n}: {m}")


def _linear_rows(fn) -> list[tuple[int, int]]:
    """(rows, in_features) of every linear matmul that `fn` runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Rows(TorchDispatchMode):
        seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
                left = args[1] if func is torch.ops.aten.addmm.default else args[0]
                Rows.seen.append(tuple(left.shape))
            return func(*args, **(kwargs or {}))

    with Rows():
        fn()
    return Rows.seen


def test_a_context_known_zero_past_its_prompts_gives_the_same_outputs_and_gradients_for_less_work():
    """text_rows T (every context row from T on zero, as umT5 pads a prompt): the same outputs and gradients as the
    whole context, with the text embedding and the cross-attention's text K and V run on B·T + 1 rows, not
    B·text_len."""
    model = tiny_model().double().train()
    b = {k: v.double() for k, v in tiny_batch(model.args).items()}
    T, B, text_len = 5, b["context"].shape[0], model.args.text_len
    b["context"][:, T:] = 0
    b["context"][1, 3:] = 0  # a shorter prompt
    results = {}
    for rows in (None, T):
        model.zero_grad()
        out = model(**b, attn_backend="sdpa", text_rows=rows)
        (out.video_pred.square().mean() + out.action_pred.square().mean()).backward()
        results[rows] = (out.video_pred, out.action_pred, {n: p.grad.clone() for n, p in model.named_parameters()})
    torch.testing.assert_close(results[T][0], results[None][0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(results[T][1], results[None][1], rtol=1e-10, atol=1e-10)
    for name, grad in results[None][2].items():  # the norms compute in fp32: the pad rows' gradients summed in
        torch.testing.assert_close(results[T][2][name], grad, rtol=1e-6, atol=1e-8, msg=name)  # another order
    dim = model.args.dim
    with torch.no_grad():
        whole = _linear_rows(lambda: model(**b, attn_backend="sdpa"))
        padded = _linear_rows(lambda: model(**b, attn_backend="sdpa", text_rows=T))
    text_kv = lambda seen: [r for r, k in seen if k == dim and r in (B * text_len, B * T + 1)]  # noqa: E731
    assert text_kv(whole) == [B * text_len] * (1 + len(model.blocks))  # the text embedding's second layer too
    assert text_kv(padded) == [B * T + 1] * len(model.blocks)


def test_text_rows_of_the_whole_context_or_none_take_the_plain_path():
    model = tiny_model()
    b = tiny_batch(model.args)
    with torch.no_grad():
        plain = model(**b, attn_backend="sdpa")
        for rows in (model.args.text_len, 0):
            torch.testing.assert_close(model(**b, attn_backend="sdpa", text_rows=rows).action_pred, plain.action_pred,
                                       rtol=0, atol=0)
