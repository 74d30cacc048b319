"""CLIP ViT-H/14 visual tower: checkpoint keys/shapes, the 31-block path, preprocessing, batching,
and a numerics cross-check against transformers' CLIPVisionModel."""

import pytest
import torch
import torch.nn.functional as F

from dzmodel.model.clip import (
    CLIP_MEAN,
    CLIP_STD,
    CLIP_VIT_H_14,
    WanCLIPVisual,
    clip_preset,
    preprocess_images,
    visual_state_dict,
)
from dzmodel.model.manifest import compare_to_manifest


def _randomize(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif p.dim() >= 2 and "embedding" not in name:
                p.copy_(torch.randn(p.shape, generator=g) / p[0].numel() ** 0.5)
            else:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
    return model


def tiny_clip(seed: int = 0, **overrides) -> WanCLIPVisual:
    torch.manual_seed(seed)
    return _randomize(WanCLIPVisual(clip_preset("tiny", **overrides)), seed).eval()


def test_vit_h_14_matches_manifest_exactly():
    with torch.device("meta"):
        model = WanCLIPVisual(CLIP_VIT_H_14)
    diff = compare_to_manifest(model, "wan2.1_clip_xlm_roberta_vit_h_14_visual")
    assert diff.ok, diff.summary()
    sd = model.state_dict()
    assert len(sd) == 392
    assert sd["visual.pos_embedding"].shape == (1, 257, 1280)
    assert sd["visual.patch_embedding.weight"].shape == (1280, 3, 14, 14)
    assert "visual.patch_embedding.bias" not in sd
    assert CLIP_VIT_H_14.num_tokens == 257


def test_visual_state_dict_filters_checkpoint():
    sd = {"visual.head": 1, "textual.token_embedding.weight": 2, "log_scale": 3}
    assert visual_state_dict(sd) == {"visual.head": 1}
    assert visual_state_dict({"model.visual.head": 1, "model.textual.x": 2, "other": 3}, prefix="model.") == {
        "visual.head": 1}


def test_encode_images_shape_and_31_blocks():
    model = tiny_clip()
    images = torch.rand(2, 3, 40, 56) * 2 - 1
    out = model.encode_images(images)
    assert out.shape == (2, 17, 64)  # 4x4 patches + cls
    x = preprocess_images(images, 28)
    v = model.visual
    # by hand: embeddings, pre_norm, blocks 0..n-2 (the last block, post_norm and head unused)
    h = v.patch_embedding(x).flatten(2).transpose(1, 2)
    h = torch.cat([v.cls_embedding.expand(2, -1, -1), h], 1) + v.pos_embedding
    h = v.pre_norm(h)
    for blk in list(v.transformer)[:-1]:
        h = blk(h)
    torch.testing.assert_close(out, h, rtol=0, atol=0)
    full = v(x, use_31_block=False)
    assert not torch.allclose(full, out)
    torch.testing.assert_close(v.transformer[-1](out), full)
    # [B, T, 3, H, W] (DreamZero passes the first frame as T = 1) flattens to B*T
    torch.testing.assert_close(model.encode_images(images[:, None]), out, rtol=0, atol=1e-6)


def test_block_numerics_by_hand():
    model = tiny_clip()
    blk = model.visual.transformer[0]
    x = torch.randn(2, 17, 64)
    h = F.layer_norm(x, (64,), blk.norm1.weight, blk.norm1.bias, 1e-5)
    q, k, v = blk.attn.to_qkv(h).split(64, dim=-1)  # [q | k | v]
    q, k, v = (t.view(2, 17, 4, 16).transpose(1, 2) for t in (q, k, v))
    a = ((q @ k.transpose(-1, -2)) / 4.0).softmax(-1) @ v  # scale 1/sqrt(16)
    x1 = x + blk.attn.proj(a.transpose(1, 2).reshape(2, 17, 64))
    h2 = F.layer_norm(x1, (64,), blk.norm2.weight, blk.norm2.bias, 1e-5)
    m = blk.mlp[0](h2)
    m = 0.5 * m * (1 + torch.erf(m / 2**0.5))  # exact GELU
    ref = x1 + blk.mlp[2](m)
    torch.testing.assert_close(blk(x), ref, rtol=1e-5, atol=1e-5)


def test_batch_of_two_equals_two_singles():
    model = tiny_clip()
    images = torch.rand(2, 3, 32, 48) * 2 - 1
    both = model.encode_images(images)
    one = torch.cat([model.encode_images(images[i:i + 1]) for i in range(2)])
    torch.testing.assert_close(both, one, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(both[0], both[1])


def test_preprocess_normalisation_and_resize():
    # a constant image stays constant under bicubic resize, then maps to (c/2 + 1/2 - mean) / std
    img = torch.full((1, 3, 50, 70), 0.3)
    out = preprocess_images(img, 224)
    assert out.shape == (1, 3, 224, 224)
    for c in range(3):
        expect = (0.3 * 0.5 + 0.5 - CLIP_MEAN[c]) / CLIP_STD[c]
        torch.testing.assert_close(out[0, c], torch.full((224, 224), expect), rtol=1e-5, atol=1e-5)
    # bicubic (not bilinear), no antialias, no clamp: overshoot beyond the input range survives
    step = torch.full((1, 3, 8, 8), -1.0)
    step[..., 4:] = 1.0
    out = preprocess_images(step, 28)
    raw = (out * torch.tensor(CLIP_STD).view(1, 3, 1, 1) + torch.tensor(CLIP_MEAN).view(1, 3, 1, 1) - 0.5) * 2
    assert raw.max() > 1.01 and raw.min() < -1.01
    ref = F.interpolate(step, size=(28, 28), mode="bicubic", align_corners=False)
    torch.testing.assert_close(raw, ref, rtol=1e-5, atol=1e-5)


def test_bf16_weights():
    model = tiny_clip()
    images = torch.rand(2, 3, 28, 28) * 2 - 1
    ref = model.encode_images(images)
    out = model.to(torch.bfloat16).encode_images(images)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=0.1, atol=0.15)


def test_wrong_image_size_is_an_error():
    model = tiny_clip()
    with pytest.raises(ValueError, match="tokens"):
        model.visual(torch.randn(1, 3, 35, 35))
    with pytest.raises(ValueError, match=r"\[N, 3, H, W\]"):
        preprocess_images(torch.randn(3, 28, 28))


def test_matches_transformers_clip_vision():
    from dzmodel.data.lerobot_compat import install_torchvision_shim

    install_torchvision_shim()  # transformers imports torchvision: the CPU-torch shim, whatever ran before
    transformers = pytest.importorskip("transformers", reason="transformers not installed (dev extra); "
                                       "cross-check against CLIPVisionModel skipped")
    cfg = clip_preset("tiny")
    model = tiny_clip(seed=2)
    hf_cfg = transformers.CLIPVisionConfig(
        hidden_size=cfg.dim, intermediate_size=cfg.mlp_dim, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, image_size=cfg.image_size, patch_size=cfg.patch_size,
        hidden_act="gelu", layer_norm_eps=cfg.eps, attention_dropout=0.0, num_channels=3,
    )
    hf = transformers.CLIPVisionModel(hf_cfg).eval()
    sd = model.state_dict()
    d = cfg.dim
    # transformers 4 prefixes the tower's keys with "vision_model.", transformers 5 does not
    p = "vision_model." if any(k.startswith("vision_model.") for k in hf.state_dict()) else ""
    mapped = {
        p + "embeddings.class_embedding": sd["visual.cls_embedding"].reshape(d),
        p + "embeddings.patch_embedding.weight": sd["visual.patch_embedding.weight"],
        p + "embeddings.position_embedding.weight": sd["visual.pos_embedding"][0],
        p + "pre_layrnorm.weight": sd["visual.pre_norm.weight"],
        p + "pre_layrnorm.bias": sd["visual.pre_norm.bias"],
        p + "post_layernorm.weight": sd["visual.post_norm.weight"],
        p + "post_layernorm.bias": sd["visual.post_norm.bias"],
    }
    for i in range(cfg.num_layers):
        a, o = f"visual.transformer.{i}.", f"{p}encoder.layers.{i}."
        for j, n in enumerate("qkv"):
            mapped[o + f"self_attn.{n}_proj.weight"] = sd[a + "attn.to_qkv.weight"][j * d:(j + 1) * d]
            mapped[o + f"self_attn.{n}_proj.bias"] = sd[a + "attn.to_qkv.bias"][j * d:(j + 1) * d]
        for ours, theirs in (("attn.proj", "self_attn.out_proj"), ("norm1", "layer_norm1"),
                             ("norm2", "layer_norm2"), ("mlp.0", "mlp.fc1"), ("mlp.2", "mlp.fc2")):
            mapped[o + theirs + ".weight"] = sd[a + ours + ".weight"]
            mapped[o + theirs + ".bias"] = sd[a + ours + ".bias"]
    hf_sd = hf.state_dict()
    extra = {k: v for k, v in hf_sd.items() if k not in mapped}
    assert all("position_ids" in k for k in extra), sorted(extra)
    hf.load_state_dict({**mapped, **extra}, strict=True)

    images = torch.rand(2, 3, 45, 60) * 2 - 1
    with torch.no_grad():
        ours = model.encode_images(images)
        hidden = hf(pixel_values=preprocess_images(images, cfg.image_size), output_hidden_states=True).hidden_states
    # hidden_states[0] is the pre_norm output; [n - 1] is the output of blocks 0..n-2
    torch.testing.assert_close(ours, hidden[cfg.num_layers - 1], rtol=1e-5, atol=1e-5)
