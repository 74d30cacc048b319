"""View transforms, layout, q99 normalisation and relative actions."""

import numpy as np
import torch

from dzmodel.data.embodiments import load_embodiments
from dzmodel.data.transforms import (NormStats, color_jitter, compose_layout, from_relative, relative_action_dims,
                                     to_relative, transform_view)


def _frames(T=3, H=40, W=60, seed=0):
    return np.random.default_rng(seed).integers(0, 255, (T, H, W, 3), dtype=np.uint8)


def test_eval_transform_is_a_deterministic_centre_crop_and_resize():
    f = _frames()
    a = transform_view(f, (20, 30), train=False, rng=np.random.default_rng(0))
    b = transform_view(f, (20, 30), train=False, rng=np.random.default_rng(99))
    assert a.shape == (3, 20, 30, 3) and a.dtype == torch.uint8
    assert torch.equal(a, b)
    same = transform_view(f, (38, 57), train=False, rng=np.random.default_rng(0), crop_scale=0.95)
    assert torch.equal(same, torch.from_numpy(f[:, 1:39, 1:58]))  # centre crop, no resize needed


def test_train_transform_is_random_per_sample_but_shared_by_frames():
    f = np.repeat(_frames(T=1), 4, axis=0)  # four identical frames
    jitter = {"brightness": 0.3, "contrast": 0.4, "saturation": 0.5, "hue": 0.08}
    a = transform_view(f, (20, 30), True, np.random.default_rng(1), 0.9, jitter)
    b = transform_view(f, (20, 30), True, np.random.default_rng(2), 0.9, jitter)
    assert not torch.equal(a, b)
    assert all(torch.equal(a[0], a[t]) for t in range(4))
    again = transform_view(f, (20, 30), True, np.random.default_rng(1), 0.9, jitter)
    assert torch.equal(a, again)


def test_colour_jitter_components():
    x = torch.rand(2, 3, 5, 5) * 0.5 + 0.25

    class Fixed:
        def __init__(self, v):
            self.v = v

        def uniform(self, lo, hi):
            return self.v

    torch.testing.assert_close(color_jitter(x, Fixed(1.2), brightness=0.3), (x * 1.2).clamp(0, 1))
    gray = (x * torch.tensor([0.299, 0.587, 0.114]).view(1, 3, 1, 1)).sum(1, keepdim=True)
    torch.testing.assert_close(color_jitter(x, Fixed(0.0), saturation=1.0), gray.expand_as(x), atol=1e-6, rtol=0)
    mean = gray.mean(dim=(-2, -1), keepdim=True)
    torch.testing.assert_close(color_jitter(x, Fixed(0.5), contrast=0.5), 0.5 * x + 0.5 * mean, atol=1e-6, rtol=0)
    shifted = color_jitter(x, Fixed(0.25), hue=0.5)  # a quarter turn of the chroma plane keeps luma
    torch.testing.assert_close((shifted * torch.tensor([0.299, 0.587, 0.114]).view(1, 3, 1, 1)).sum(1, keepdim=True),
                               gray, atol=1e-4, rtol=0)
    assert not torch.allclose(shifted, x, atol=1e-2)


def test_hue_jitter_round_trips_at_zero_shift():
    x = torch.rand(2, 3, 5, 5)

    class Zero:
        def uniform(self, lo, hi):
            return 0.0 if lo < 0 else 1.0

    out = color_jitter(x, Zero(), hue=0.1)
    torch.testing.assert_close(out, x, atol=1e-5, rtol=0)


def test_droid_layout_puts_a_stretched_wrist_on_top():
    emb = load_embodiments()["oxe_droid"]
    h, w = emb.view_size
    views = {"wrist": torch.full((2, h, w, 3), 10, dtype=torch.uint8),
             "exterior_1": torch.full((2, h, w, 3), 20, dtype=torch.uint8),
             "exterior_2": torch.full((2, h, w, 3), 30, dtype=torch.uint8)}
    out = compose_layout(emb, views)
    assert out.shape == (2, 352, 640, 3)
    assert (out[:, :h] == 10).all() and (out[:, h:, :w] == 20).all() and (out[:, h:, w:] == 30).all()


def test_q99_normalisation_and_inverse():
    st = NormStats(q01=np.array([0.0, -2.0, 5.0]), q99=np.array([10.0, 2.0, 5.0]))
    x = np.array([[5.0, 1.0, 5.0], [12.0, -3.0, 7.0]])
    n = st.normalize(x)
    np.testing.assert_allclose(n, [[0.0, 0.5, 5.0], [1.0, -1.0, 7.0]])
    np.testing.assert_allclose(st.unnormalize(n[:1]), x[:1])


def test_relative_actions_and_inverse():
    emb = load_embodiments()["oxe_droid"]
    widths = {"joint_position": 7, "gripper_position": 1}
    pairs = relative_action_dims(emb, widths, widths)
    H = 3
    rng = np.random.default_rng(0)
    states = rng.normal(size=(2, 8))
    actions = rng.normal(size=(2 * H, 8))
    rel = to_relative(actions, states, H, pairs)
    np.testing.assert_allclose(rel[:H, :7], actions[:H, :7] - states[0, :7])
    np.testing.assert_allclose(rel[H:, :7], actions[H:, :7] - states[1, :7])
    np.testing.assert_allclose(rel[:, 7], actions[:, 7])  # gripper stays absolute
    np.testing.assert_allclose(from_relative(rel[H:], states[1], pairs), actions[H:])


JITTER = {"brightness": 0.3, "contrast": 0.4, "saturation": 0.5, "hue": 0.08}


def _float_path(x, seed):
    planar = x.permute(0, 3, 1, 2).float().contiguous() / 255
    return (color_jitter(planar, np.random.default_rng(seed), **JITTER) * 255).round().to(torch.uint8).permute(0, 2, 3, 1)


def test_the_uint8_jitter_is_one_opencv_pass_per_frame_and_the_float_map(monkeypatch):
    import cv2

    from dzmodel.data import transforms

    x = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (4, 24, 40, 3), dtype=np.uint8))
    calls = []
    original = cv2.transform
    monkeypatch.setattr(cv2, "transform", lambda *a, **k: calls.append(1) or original(*a, **k))
    fast = transforms.color_jitter_uint8(x, np.random.default_rng(3), **JITTER)
    assert len(calls) == 4  # one pass per frame, no float copies
    diff = (fast.int() - _float_path(x, 3).int()).abs()
    assert fast.dtype == torch.uint8 and diff.max() <= 1 and (diff == 0).float().mean() > 0.9


def test_without_opencv_the_uint8_jitter_is_the_float_path(monkeypatch):
    import builtins

    from dzmodel.data import transforms

    real_import = builtins.__import__
    monkeypatch.setattr(builtins, "__import__",
                        lambda name, *a, **k: (_ for _ in ()).throw(ImportError("no cv2")) if name == "cv2"
                        else real_import(name, *a, **k))
    x = torch.from_numpy(np.random.default_rng(1).integers(0, 256, (3, 16, 24, 3), dtype=np.uint8))
    assert torch.equal(transforms.color_jitter_uint8(x, np.random.default_rng(5), **JITTER), _float_path(x, 5))
