"""umT5 encoder: checkpoint keys/shapes, relative-position buckets, masking, per-sample zeroing,
and a numerics cross-check against transformers' UMT5EncoderModel."""

import math

import pytest
import torch

from dzmodel.model.manifest import compare_to_manifest
from dzmodel.model.t5 import (
    UMT5_XXL,
    UMT5Encoder,
    relative_position_bucket,
    t5_preset,
    zero_beyond_length,
    zero_beyond_lengths,
)


def _randomize(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """O(1) random weights (norm weights around 1) so every path matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif "pos_embedding" in name or "token_embedding" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
    return model


def tiny_t5(seed: int = 0, **overrides) -> UMT5Encoder:
    torch.manual_seed(seed)
    return _randomize(UMT5Encoder(t5_preset("tiny", **overrides)), seed).eval()


def test_xxl_matches_manifest_exactly():
    with torch.device("meta"):
        model = UMT5Encoder(UMT5_XXL)
    diff = compare_to_manifest(model, "umt5_xxl_encoder")
    assert diff.ok, diff.summary()
    sd = model.state_dict()
    assert len(sd) == 242
    assert sd["token_embedding.weight"].shape == (256384, 4096)
    assert sd["blocks.23.pos_embedding.embedding.weight"].shape == (32, 64)
    assert sum(p.numel() for p in model.parameters()) == 5_680_910_336  # umT5-XXL encoder: 5.68B


def test_shared_pos_changes_keys():
    with torch.device("meta"):
        model = UMT5Encoder(t5_preset("xxl", shared_pos=True))
    diff = compare_to_manifest(model, "umt5_xxl_encoder")
    assert not diff.ok and "pos_embedding.embedding.weight" in diff.unexpected
    assert len(diff.missing) == 24


def test_relative_position_bucket_by_hand():
    # bidirectional, 32 buckets -> 16 per direction, 8 exact; log buckets 8..15 up to distance 128.
    # rel = key - query; keys after the query (rel > 0) are offset by 16.
    # bucket(d >= 8) = 8 + floor(ln(d/8) / ln(16) * 8), capped at 15.
    # Bucket 8 + k starts at d = 8 * 2**(k/2): 11.3, 16, 22.6, 32, 45.3, 64, 90.5, 128.
    rel = torch.tensor([0, -1, 1, -7, 7, -8, 8, -11, -12, -15, -22, -23, -45, -46, -90, -91, -127, -128, -1000, 5000,
                        12, 91])
    expect = [0, 1, 17, 7, 23, 8, 24, 8, 9, 9, 10, 11, 12, 13, 14, 15, 15, 15, 15, 31, 25, 31]
    for d in (11, 12, 15, 22, 23, 45, 46, 90, 91, 127):  # the hand table above, recomputed in float64
        assert expect[rel.tolist().index(-d)] == min(15, 8 + int(math.log(d / 8) / math.log(16) * 8))
    assert relative_position_bucket(rel, 32, 128, bidirectional=True).tolist() == expect
    # unidirectional (decoder-style): only keys at or before the query; 32 buckets, 16 exact
    rel_u = torch.tensor([3, 0, -1, -15, -16, -32, -64, -200])
    assert relative_position_bucket(rel_u, 32, 128, bidirectional=False).tolist() == [0, 0, 1, 15, 16, 21, 26, 31]


def test_position_bias_is_per_layer_and_toeplitz():
    model = tiny_t5()
    e0 = model.blocks[0].pos_embedding(5, 5)
    e1 = model.blocks[1].pos_embedding(5, 5)
    assert e0.shape == (1, 4, 5, 5)
    assert not torch.allclose(e0, e1)
    w = model.blocks[0].pos_embedding.embedding.weight
    assert torch.equal(e0[0, :, 1, 3], w[16 + 2])  # key 3, query 1: rel +2 -> bucket 18
    assert torch.equal(e0[0, :, 3, 1], w[2])       # rel -2 -> bucket 2
    assert torch.equal(e0[0, :, 2, 2], w[0])


def test_forward_shapes_and_no_scaling():
    model = tiny_t5()
    ids = torch.randint(0, 640, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.long)
    out = model(ids, mask)
    assert out.shape == (2, 7, 32) and out.dtype == torch.float32
    assert torch.isfinite(out).all()
    # attention logits are q.k without 1/sqrt(d): check one block by hand
    blk = model.blocks[0]
    x = model.token_embedding(ids)
    h = blk.norm1(x)
    q = blk.attn.q(h).view(2, 7, 4, 8)
    k = blk.attn.k(h).view(2, 7, 4, 8)
    v = blk.attn.v(h).view(2, 7, 4, 8)
    logits = torch.einsum("bind,bjnd->bnij", q, k) + blk.pos_embedding(7, 7)
    ref = torch.einsum("bnij,bjnd->bind", logits.softmax(-1), v).reshape(2, 7, 32)
    torch.testing.assert_close(blk.attn(h, mask, blk.pos_embedding(7, 7)), blk.attn.o(ref))


def test_rmsnorm_has_no_mean_subtraction():
    model = tiny_t5()
    x = torch.randn(3, 32) + 5.0
    w = model.norm.weight
    ref = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w
    torch.testing.assert_close(model.norm(x), ref)


def test_padding_tokens_do_not_change_unpadded_outputs():
    model = tiny_t5()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 640, (2, 9), generator=g)
    mask = torch.tensor([[1] * 9, [1] * 5 + [0] * 4])
    out = model(ids, mask)
    ids2 = ids.clone()
    ids2[1, 5:] = torch.randint(3, 640, (4,), generator=g)
    out2 = model(ids2, mask)
    torch.testing.assert_close(out2[1, :5], out[1, :5], rtol=0, atol=0)
    torch.testing.assert_close(out2[0], out[0], rtol=0, atol=0)
    # and the mask matters: without it the padded tokens leak in
    assert not torch.allclose(model(ids2)[1, :5], out[1, :5])
    # a padded sample equals the same sample run alone at its own length
    alone = model(ids[1:2, :5], mask[1:2, :5])
    torch.testing.assert_close(out[1, :5], alone[0], rtol=1e-5, atol=1e-5)


def test_zero_beyond_lengths_is_per_sample():
    emb = torch.randn(3, 6, 4) + 10
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0]])
    out = zero_beyond_lengths(emb, mask)
    for i, n in enumerate([6, 2, 4]):
        assert torch.equal(out[i, :n], emb[i, :n])
        assert torch.count_nonzero(out[i, n:]) == 0
    # lengths instead of a mask, and the alias
    assert torch.equal(zero_beyond_length(emb, torch.tensor([6, 2, 4])), out)
    # upstream's batch-wide bug would have truncated sample 0 to 2 tokens; we do not
    assert torch.count_nonzero(out[0, 2:]) == 4 * 4
    # non-finite values beyond the length become exact zeros (no 0 * inf = nan)
    emb[1, 3] = float("inf")
    assert torch.count_nonzero(zero_beyond_lengths(emb, mask)[1, 2:]) == 0
    assert not emb.isnan().any()


def test_encode_zeroes_padding():
    model = tiny_t5()
    ids = torch.randint(3, 640, (2, 6))
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])
    out = model.encode(ids, mask)
    assert torch.count_nonzero(out[1, 3:]) == 0
    assert torch.equal(out[1, :3], model(ids, mask)[1, :3])
    assert torch.count_nonzero(out[0]) == out[0].numel()


def test_bf16_runs_and_tracks_fp32():
    model = tiny_t5()
    ids = torch.randint(3, 640, (2, 6))
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2])
    ref = model(ids, mask)
    out = model.to(torch.bfloat16)(ids, mask)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float()[0], ref[0], rtol=0.1, atol=0.1)


def test_matches_transformers_umt5():
    from dzmodel.data.lerobot_compat import install_torchvision_shim

    install_torchvision_shim()  # transformers imports torchvision: the CPU-torch shim, whatever ran before
    transformers = pytest.importorskip("transformers", reason="transformers not installed (dev extra); "
                                       "cross-check against UMT5EncoderModel skipped")
    cfg = t5_preset("tiny", num_layers=3, max_distance=20)  # small max distance: exercise the log/capped buckets
    model = tiny_t5(seed=1, num_layers=3, max_distance=20)
    hf_cfg = transformers.UMT5Config(
        vocab_size=cfg.vocab, d_model=cfg.dim, d_kv=cfg.head_dim, d_ff=cfg.dim_ffn, num_layers=cfg.num_layers,
        num_heads=cfg.num_heads, relative_attention_num_buckets=cfg.num_buckets,
        relative_attention_max_distance=cfg.max_distance, dropout_rate=0.0, layer_norm_epsilon=cfg.eps,
        feed_forward_proj="gated-gelu", is_encoder_decoder=False, use_cache=False,
    )
    hf = transformers.UMT5EncoderModel(hf_cfg).eval()
    sd = model.state_dict()
    mapped = {"shared.weight": sd["token_embedding.weight"], "encoder.embed_tokens.weight": sd["token_embedding.weight"],
              "encoder.final_layer_norm.weight": sd["norm.weight"]}
    for i in range(cfg.num_layers):
        a, f = f"encoder.block.{i}.layer.0.", f"encoder.block.{i}.layer.1."
        for n in "qkvo":
            mapped[a + f"SelfAttention.{n}.weight"] = sd[f"blocks.{i}.attn.{n}.weight"]
        mapped[a + "SelfAttention.relative_attention_bias.weight"] = sd[f"blocks.{i}.pos_embedding.embedding.weight"]
        mapped[a + "layer_norm.weight"] = sd[f"blocks.{i}.norm1.weight"]
        mapped[f + "DenseReluDense.wi_0.weight"] = sd[f"blocks.{i}.ffn.gate.0.weight"]
        mapped[f + "DenseReluDense.wi_1.weight"] = sd[f"blocks.{i}.ffn.fc1.weight"]
        mapped[f + "DenseReluDense.wo.weight"] = sd[f"blocks.{i}.ffn.fc2.weight"]
        mapped[f + "layer_norm.weight"] = sd[f"blocks.{i}.norm2.weight"]
    hf_keys = set(hf.state_dict())
    assert hf_keys <= set(mapped), sorted(hf_keys - set(mapped))
    hf.load_state_dict({k: v for k, v in mapped.items() if k in hf_keys}, strict=True)

    g = torch.Generator().manual_seed(5)
    L = 40  # > 2 * max_distance: every bucket is used
    ids = torch.randint(0, cfg.vocab, (2, L), generator=g)
    mask = torch.ones(2, L, dtype=torch.long)
    mask[1, 23:] = 0
    with torch.no_grad():
        ours = model(ids, mask)
        theirs = hf(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours[1, :23], theirs[1, :23], rtol=1e-5, atol=1e-5)

    # the bucket function against transformers' own (encoder: bidirectional), over a wide range of offsets
    from transformers.models.umt5.modeling_umt5 import UMT5Attention

    rel = torch.arange(-400, 401).view(1, -1)
    for max_distance in (128, 20):
        c = transformers.UMT5Config(relative_attention_num_buckets=32, relative_attention_max_distance=max_distance,
                                    is_decoder=False)
        expected = UMT5Attention(c, has_relative_attention_bias=True)._relative_position_bucket(rel)
        assert torch.equal(relative_position_bucket(rel, 32, max_distance, bidirectional=True), expected)
