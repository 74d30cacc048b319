"""WAN DiT: manifest exactness, fixture parity, and the behaviour of each piece."""

import math

import pytest
import torch

from dzmodel.model.args import WanDiTArgs, preset
from dzmodel.model.manifest import compare_shapes, compare_to_manifest, manifest_entry
from dzmodel.model.parity import run_parity
from dzmodel.model.state_dict import DREAMZERO_ONLY, IMAGE_BRANCH
from dzmodel.model.wam import DreamZeroWAM
from dzmodel.model.wan_dit import (Rope, WanLayerNorm, WanModel, WanRMSNorm, WanSelfAttention, rope_angles,
                                   rope_split, sinusoidal_embedding_1d, video_rope_angles)


@pytest.mark.parametrize("name,entry", [("wan2.2_ti2v_5b", "wan2.2_ti2v_5b_dit"), ("wan2.1_i2v_14b", "wan2.1_i2v_14b_dit")])
def test_wan_dit_matches_manifest_exactly(name, entry):
    with torch.device("meta"):
        model = WanModel(preset(name))
    diff = compare_to_manifest(model, entry)
    assert diff.ok, diff.summary()


@pytest.mark.parametrize("name,entry,extra", [
    ("dreamzero_5b", "wan2.2_ti2v_5b_dit", f"{DREAMZERO_ONLY.pattern}|{IMAGE_BRANCH.pattern}"),
    ("dreamzero_14b", "wan2.1_i2v_14b_dit", DREAMZERO_ONLY.pattern),
])
def test_dreamzero_backbone_is_the_wan_checkpoint(name, entry, extra):
    """Removing the DreamZero-only keys (and for 5B the image branch) leaves exactly the WAN checkpoint."""
    import re

    with torch.device("meta"):
        model = DreamZeroWAM(preset(name))
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    extra_keys = [k for k in shapes if re.search(extra, k)]
    assert extra_keys, "expected DreamZero-only keys"
    diff = compare_shapes({k: v for k, v in shapes.items() if k not in extra_keys}, manifest_entry(entry))
    assert diff.ok, diff.summary()


def test_dit_fixture_parity(fixtures_dir):
    result = run_parity(fixtures_dir / "wan22_dit_tiny_reference.safetensors")
    assert result.kind == "dit"
    assert result.ok, result.report()
    assert result.errors["output.x"] < 1e-5


def test_rmsnorm_normalises_over_the_full_dim_not_per_head():
    norm = WanRMSNorm(8, eps=0.0)
    x = torch.cat([torch.ones(1, 4), 3 * torch.ones(1, 4)], dim=1)  # two "heads" with different scales
    out = norm(x)
    rms = math.sqrt((4 * 1 + 4 * 9) / 8)
    torch.testing.assert_close(out, x / rms)
    assert norm.weight.shape == (8,)


def test_rmsnorm_computes_in_fp32():
    norm = WanRMSNorm(4).to(torch.bfloat16)
    x = torch.tensor([[1e3, 2e3, 3e3, 4e3]], dtype=torch.bfloat16)
    assert norm(x).dtype == torch.bfloat16
    # the squares (up to 1.6e7) overflow nothing and lose nothing because the mean runs in fp32
    ref = x.float() / x.float().pow(2).mean().sqrt()
    torch.testing.assert_close(norm(x).float(), ref, atol=1e-2, rtol=1e-2)


def test_q_and_k_stay_in_the_compute_dtype_under_autocast():
    """fp32 weights under bf16 autocast (training): the normed, roped q and k are bf16, as v is. An fp32 norm
    weight promoted them to fp32, which doubled what each attention call read and converted."""
    attn = WanSelfAttention(64, 4)
    x = torch.randn(2, 6, 64)
    rope = Rope(rope_angles(torch.arange(6), 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        q, k, v = attn.qkv(x, rope)
    assert (q.dtype, k.dtype, v.dtype) == (torch.bfloat16,) * 3
    q32, k32, _ = attn.qkv(x, rope)
    assert q32.dtype == torch.float32
    torch.testing.assert_close(q.float(), q32, atol=0.05, rtol=0.02)


def test_layernorm_affine_only_when_asked():
    assert WanLayerNorm(6).weight is None
    ln = WanLayerNorm(6, elementwise_affine=True)
    assert ln.weight.shape == (6,) and ln.bias.shape == (6,)


def test_time_sinusoid_is_cos_then_sin_float64():
    emb = sinusoidal_embedding_1d(8, torch.tensor([0.0, 10.0]))
    assert emb.dtype == torch.float64
    torch.testing.assert_close(emb[0], torch.tensor([1.0] * 4 + [0.0] * 4, dtype=torch.float64))
    assert emb[1, 0] == math.cos(10.0) and emb[1, 4] == math.sin(10.0)


def test_rope_split_matches_wan():
    assert rope_split(128) == (44, 42, 42)
    assert rope_split(24) == (8, 8, 8)


def test_rope_scores_depend_only_on_relative_position():
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)

    def score(pq, pk):
        rq = Rope(rope_angles(torch.tensor([pq]), 16)).apply(q)
        rk = Rope(rope_angles(torch.tensor([pk]), 16)).apply(k)
        return (rq * rk).sum()

    torch.testing.assert_close(score(3, 1), score(12, 10))
    assert not torch.allclose(score(3, 1), score(3, 2))
    rotated = Rope(rope_angles(torch.tensor([5]), 16)).apply(q)
    torch.testing.assert_close(rotated.norm(), q.norm())  # a rotation keeps the norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_rotates_each_adjacent_pair_exactly_as_the_pairwise_form(dtype):
    """Rope.apply's x·cos + swap(x)·(-sin, sin) gives the bits of the pairwise (x0·cos - x1·sin, x0·sin + x1·cos)."""
    torch.manual_seed(0)
    x = torch.randn(2, 9, 3, 16).to(dtype)
    rope = Rope(rope_angles(torch.arange(9) * 7, 16))
    xf = x.float().unflatten(-1, (8, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    cos, sin = rope.cos[None, :, None, :], rope.sin[None, :, None, :]
    pairwise = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(3).to(dtype)
    assert torch.equal(rope.apply(x), pairwise)
    assert not torch.equal(Rope(rope_angles(torch.arange(9) * 7 + 1, 16)).apply(x), pairwise)


def test_video_rope_uses_frame_row_column_tables():
    ang = video_rope_angles((2, 3, 4), head_dim=24)
    assert ang.shape == (24, 12)
    # token (f=1, h=2, w=3) = index 1*12 + 2*4 + 3
    tok = ang[1 * 12 + 2 * 4 + 3]
    torch.testing.assert_close(tok[:4], rope_angles(torch.tensor(1), 8))
    torch.testing.assert_close(tok[4:8], rope_angles(torch.tensor(2), 8))
    torch.testing.assert_close(tok[8:], rope_angles(torch.tensor(3), 8))
    # start_frame shifts only the temporal part
    shifted = video_rope_angles((2, 3, 4), 24, start_frame=5)
    torch.testing.assert_close(shifted[:, 4:], ang[:, 4:])
    torch.testing.assert_close(shifted[0, :4], rope_angles(torch.tensor(5), 8))


def _tiny_dit(cross="t2v"):
    torch.manual_seed(0)
    return WanModel(WanDiTArgs(dim=32, ffn_dim=64, num_heads=2, num_layers=2, in_dim=4, out_dim=4, text_dim=8,
                               text_len=6, freq_dim=16, cross_attn_type=cross, clip_dim=12, clip_tokens=5)).eval()


def test_per_token_timesteps_change_only_the_time_path():
    model = _tiny_dit()
    x = torch.randn(1, 4, 2, 4, 4)
    ctx = torch.randn(1, 3, 8)
    L = 2 * 2 * 2
    t_scalar = model(x, torch.tensor([500.0]), ctx)
    t_tokens = model(x, torch.full((1, L), 500.0), ctx)
    torch.testing.assert_close(t_scalar, t_tokens)
    t_mixed = torch.full((1, L), 500.0)
    t_mixed[0, :4] = 0.0  # frame 0 clean, frame 1 noisy: per-token t must change the output
    assert not torch.allclose(model(x, t_mixed, ctx), t_scalar)


def test_i2v_cross_attention_needs_clip_and_uses_it():
    model = _tiny_dit("i2v")
    x, t, ctx = torch.randn(1, 4, 1, 4, 4), torch.tensor([100.0]), torch.randn(1, 6, 8)
    with pytest.raises(ValueError, match="clip_feature"):
        model(x, t, ctx)
    a = model(x, t, ctx, torch.randn(1, 5, 12))
    b = model(x, t, ctx, torch.randn(1, 5, 12))
    assert not torch.allclose(a, b)


def test_head_and_unpatchify_shapes_and_odd_height():
    model = _tiny_dit()
    out = model(torch.randn(2, 4, 3, 5, 6), torch.tensor([1.0, 2.0]), torch.randn(2, 6, 8))
    assert out.shape == (2, 4, 3, 4, 6)  # odd latent height 5 loses its last row in the patch conv


def test_text_context_is_zero_padded_and_too_long_is_refused():
    model = _tiny_dit()
    x, t = torch.randn(1, 4, 1, 4, 4), torch.tensor([10.0])
    short = torch.randn(1, 3, 8)
    padded = torch.cat([short, torch.zeros(1, 3, 8)], dim=1)
    torch.testing.assert_close(model(x, t, short), model(x, t, padded))
    with pytest.raises(ValueError, match="text_len"):
        model(x, t, torch.randn(1, 7, 8))


def test_grouped_modulation_gives_the_per_token_block_exactly():
    """The block with e0 per group (broadcast over token runs) equals the block with e0 repeated per token,
    outputs and every gradient (e0's included)."""
    from dzmodel.model.wan_dit import GroupedModulation, Rope, WanAttentionBlock

    torch.manual_seed(0)
    args = preset("tiny")
    block = WanAttentionBlock(args).double()
    with torch.no_grad():
        for p in block.parameters():
            p.add_(0.1 * torch.randn_like(p))
    runs = ((1, 7), (3, 4), (5, 1))  # a clean run, three frames of 4 tokens, five register tokens
    L, B, d = 24, 2, args.dim
    x = torch.randn(B, L, d, dtype=torch.float64)
    text = torch.randn(B, 5, d, dtype=torch.float64)
    rope = Rope(torch.randn(L, args.head_dim // 2, dtype=torch.float64))
    image = torch.randn(B, 3, d, dtype=torch.float64) if args.cross_attn_type == "i2v" else None
    results = []
    for grouped in (True, False):
        e0 = torch.randn(B, 9, 6, d, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).requires_grad_()
        mod = GroupedModulation(e0, runs)
        out = block(x, mod if grouped else mod.per_token(), rope, text, image)
        block.zero_grad()
        (out * torch.linspace(-1, 1, d, dtype=torch.float64)).sum().backward()
        results.append((out, e0.grad, [p.grad.clone() for p in block.parameters()]))
    (a, ea, ga), (b, eb, gb) = results
    torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
    # modulation runs in fp32 (WAN), so gradients summed over a group's tokens differ by fp32 summation order
    torch.testing.assert_close(ea, eb, atol=1e-5, rtol=1e-5)
    for u, v in zip(ga, gb):
        torch.testing.assert_close(u, v, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [(0, 24), (7, 24), (9, 21), (3, 5), (23, 24)])
def test_grouped_modulation_of_some_rows_is_those_rows_per_token(rows):
    from dzmodel.model.wan_dit import GroupedModulation, modulation_rows

    e0 = torch.randn(2, 9, 6, 4, dtype=torch.float64)
    mod = GroupedModulation(e0, ((1, 7), (3, 4), (5, 1)))
    part = mod.rows(*rows)
    assert part.num_tokens == rows[1] - rows[0]
    torch.testing.assert_close(part.per_token(), mod.per_token()[:, rows[0]:rows[1]])
    torch.testing.assert_close(modulation_rows(mod.per_token(), *rows), mod.per_token()[:, rows[0]:rows[1]])
    with pytest.raises(ValueError, match="not within the 24 tokens"):
        mod.rows(20, 25)


def test_grouped_modulation_rejects_runs_that_do_not_fit():
    from dzmodel.model.wan_dit import GroupedModulation, per_run

    with pytest.raises(ValueError, match=r"must be \[B, 4, 6, dim\]"):
        GroupedModulation(torch.zeros(1, 3, 6, 8), ((1, 5), (3, 2)))
    with pytest.raises(ValueError, match="covers 11 tokens, the sequence has 12"):
        per_run(lambda x, m: x * m, ((1, 5), (3, 2)), (torch.zeros(1, 12, 8),), (torch.zeros(1, 4, 8),))


def _matmuls(fn) -> int:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default):
                Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.n


def test_self_attention_projects_q_k_v_in_one_matmul_forward_and_backward():
    """q, k and v of plain Linears are one matmul (x read once; its gradient one matmul, not three summed), with
    the same values as the three Linears; LoRA layers still run one by one."""
    from dzmodel.model.lora import LoRAConfig, apply_lora

    torch.manual_seed(0)
    attn = WanSelfAttention(16, 2).double()
    x = torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)
    fused = attn.project_qkv(x)
    for got, linear in zip(fused, (attn.q, attn.k, attn.v)):
        torch.testing.assert_close(got, linear(x), atol=1e-12, rtol=0)
    assert _matmuls(lambda: attn.project_qkv(x)) == 1
    assert _matmuls(lambda: torch.cat(attn.project_qkv(x), -1).sum().backward()) == 3  # forward, dx, dW

    holder = torch.nn.Module()
    holder.blocks = torch.nn.ModuleList([torch.nn.Module()])
    holder.blocks[0].self_attn = attn
    apply_lora(holder, LoRAConfig(rank=2, targets=("self_attn.q", "self_attn.k", "self_attn.v")))
    assert _matmuls(lambda: attn.project_qkv(x)) > 1


def test_the_cross_attentions_context_k_and_v_are_one_matmul_each_for_text_and_image():
    """The context's k and v (text, and CLIP image for i2v) run as one matmul each, with the values of the separate
    Linears, forward and backward."""
    from dzmodel.model.wan_dit import WanI2VCrossAttention

    torch.manual_seed(0)
    attn = WanI2VCrossAttention(16, 2).double()
    text = torch.randn(2, 6, 16, dtype=torch.float64, requires_grad=True)
    image = torch.randn(2, 3, 16, dtype=torch.float64, requires_grad=True)
    heads = lambda t: t.view(2, -1, 2, 8)  # noqa: E731
    expected = (heads(attn.norm_k(attn.k(text))), heads(attn.v(text)), heads(attn.norm_k_img(attn.k_img(image))),
                heads(attn.v_img(image)))
    got = attn.context_kv(text, image)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=1e-12, rtol=0)
    grads = torch.autograd.grad(sum(g.square().sum() for g in got), (text, image, attn.k.weight, attn.v_img.weight))
    want = torch.autograd.grad(sum(e.square().sum() for e in expected),
                               (text, image, attn.k.weight, attn.v_img.weight))
    for g, e in zip(grads, want):
        torch.testing.assert_close(g, e, atol=1e-10, rtol=0)
    assert _matmuls(lambda: attn.context_kv(text, image)) == 2


def test_padded_text_is_projected_whole_where_an_adapters_dropout_draws_noise():
    """A LoRA adapter with dropout on the text K or V, training: each padding row gets its own dropout draw, so the
    whole context is projected; evaluating (no draw), only the distinct rows and the pad row."""
    from dzmodel.model.lora import LoRAConfig, apply_lora
    from dzmodel.model.wan_dit import PaddedText, WanT2VCrossAttention

    torch.manual_seed(0)
    attn = WanT2VCrossAttention(16, 2)
    holder = torch.nn.Module()
    holder.blocks = torch.nn.ModuleList([torch.nn.Module()])
    holder.blocks[0].cross_attn = attn
    apply_lora(holder, LoRAConfig(rank=2, dropout=0.5, targets=("cross_attn.k",)))
    seen = []
    attn.k.register_forward_hook(lambda module, args, out: seen.append(tuple(args[0].shape)))
    text = PaddedText(torch.randn(2, 3, 16), torch.randn(1, 1, 16), 8)
    attn.train()
    attn.context_kv(text)
    attn.eval()
    attn.context_kv(text)
    assert seen == [(2, 8, 16), (2 * 3 + 1, 16)]
