"""Weight loading: WAN files (safetensors, .pth weights_only), DreamZero directories, strict errors."""

import json

import pytest
import torch
from safetensors.torch import save_file

from dzmodel.model.args import WanDiTArgs, preset
from dzmodel.model.state_dict import (StateDictError, load_dreamzero_dir, load_strict, load_wan_dit, read_weights,
                                      save_dreamzero_dir)
from dzmodel.model.wam import DreamZeroWAM
from dzmodel.model.wan_dit import WanModel

from .helpers import tiny_batch, tiny_model


def _tiny_wan(cross: str) -> WanModel:
    a = preset("tiny")
    torch.manual_seed(3)
    return WanModel(WanDiTArgs(dim=a.dim, ffn_dim=a.ffn_dim, num_heads=a.num_heads, num_layers=a.num_layers,
                               in_dim=a.in_dim, out_dim=a.out_dim, text_dim=a.text_dim, text_len=a.text_len,
                               freq_dim=a.freq_dim, cross_attn_type=cross, clip_dim=a.clip_dim, clip_tokens=a.clip_tokens))


@pytest.mark.parametrize("cross,fmt", [("t2v", "safetensors"), ("i2v", "pth")])
def test_cold_start_from_a_wan_checkpoint(tmp_path, cross, fmt):
    wan = _tiny_wan(cross)
    path = tmp_path / f"dit.{fmt}"
    if fmt == "safetensors":
        save_file(wan.state_dict(), str(path))
    else:
        torch.save(wan.state_dict(), str(path))
    model = DreamZeroWAM(preset("tiny"))
    report = load_wan_dit(model, path)
    missing_roots = {k.split(".")[0] for k in report.missing}
    assert {"action_encoder", "action_decoder", "state_encoder"} <= missing_roots
    if cross == "t2v":  # Wan2.2-TI2V-5B has no image branch: it stays at init
        assert "img_emb" in missing_roots
        assert any(".k_img." in k for k in report.missing)
    else:
        assert "img_emb" not in missing_roots
    torch.testing.assert_close(model.blocks[1].self_attn.q.weight, wan.blocks[1].self_attn.q.weight)


def test_strict_load_lists_every_problem_at_once():
    model = WanModel(_tiny_wan("t2v").args)
    state = dict(model.state_dict())
    state.pop("head.head.bias")
    state["blocks.0.extra.weight"] = torch.zeros(1)
    state["patch_embedding.bias"] = torch.zeros(3)
    with pytest.raises(StateDictError) as exc:
        load_strict(model, state, source="ckpt.safetensors")
    msg = str(exc.value)
    assert "ckpt.safetensors" in msg and "head.head.bias" in msg and "blocks.0.extra.weight" in msg
    assert "patch_embedding.bias" in msg and "shape" in msg


def test_missing_weight_file_and_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        read_weights(tmp_path / "nope.safetensors")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file")
    with pytest.raises(StateDictError, match="bad.safetensors"):
        read_weights(bad)


def test_pth_loading_refuses_pickled_code(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    path = tmp_path / "evil.pth"
    torch.save({"x": Evil()}, str(path))
    with pytest.raises(StateDictError, match="weights_only"):
        read_weights(path)


@pytest.mark.parametrize("shard_bytes", [10**12, 20_000])
def test_dreamzero_directory_round_trip(tmp_path, shard_bytes):
    model = tiny_model()
    out = save_dreamzero_dir(model, tmp_path / "ckpt", max_shard_bytes=shard_bytes)
    if shard_bytes < 10**6:
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1
    else:
        assert (out / "model.safetensors").is_file()
    assert json.loads((out / "config.json").read_text())["args"]["dim"] == model.args.dim
    loaded = load_dreamzero_dir(out).eval()
    b = tiny_batch(model.args)
    with torch.no_grad():
        a, c = model(**b, attn_backend="sdpa"), loaded(**b, attn_backend="sdpa")
    assert torch.equal(a.video_pred, c.video_pred) and torch.equal(a.action_pred, c.action_pred)


def test_dreamzero_prefix_is_stripped(tmp_path):
    model = tiny_model()
    d = tmp_path / "upstream"
    save_dreamzero_dir(model, d)
    from safetensors.torch import load_file

    state = load_file(str(d / "model.safetensors"))
    save_file({f"action_head.model.{k}": v for k, v in state.items()}, str(d / "model.safetensors"))
    loaded = load_dreamzero_dir(d)
    assert torch.equal(loaded.head.head.weight, model.head.head.weight)


def test_directory_without_config_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_dreamzero_dir(tmp_path)
