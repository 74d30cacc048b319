"""Batched device augmentation (dzmodel/data/augment.py): per-position draws, the CPU transforms' arithmetic, one
transform per (sample, view) over time, identity when off, sane statistics."""

import numpy as np
import pytest
import torch

from dzmodel.data.augment import (ViewAugment, augment_view, color_jitter, draw, jitter_affine, jitter_factors,
                                  resize, stored_size, uniforms)
from dzmodel.data.transforms import color_jitter as cpu_color_jitter
from dzmodel.data.transforms import transform_view

JITTER = {"brightness": 0.3, "contrast": 0.4, "saturation": 0.5, "hue": 0.08}


class FixedRng:
    """Stands in for the CPU loader's numpy Generator: hands out given crop offsets and jitter uniforms."""

    def __init__(self, ints, us):
        self.ints, self.us = list(ints), list(us)

    def integers(self, lo, hi):
        v = self.ints.pop(0)
        assert lo <= v < hi
        return v

    def uniform(self, lo, hi):
        return lo + (hi - lo) * self.us.pop(0)


def frames(T=5, H=40, W=48, seed=0):
    g = np.random.default_rng(seed)
    base = g.integers(0, 256, (1, H, W, 3))
    noise = g.integers(-20, 21, (T, H, W, 3))
    return np.clip(base + noise, 0, 255).astype(np.uint8)


def test_draws_are_a_function_of_seed_and_position_only():
    a = uniforms(0, [5, 6, 7], 12)
    assert a.shape == (3, 12) and ((0 <= a) & (a < 1)).all()
    np.testing.assert_array_equal(a[1], uniforms(0, [6], 12)[0])       # batch-independent
    np.testing.assert_array_equal(uniforms(0, [9, 5], 12)[1], a[0])    # order-independent
    assert not np.array_equal(a[0], a[1])                              # differs across positions
    assert not np.array_equal(a, uniforms(1, [5, 6, 7], 12))           # and seeds
    many = uniforms(3, np.arange(20000), 6)
    assert abs(many.mean() - 0.5) < 0.01 and abs(many.var() - 1 / 12) < 0.01
    assert abs(np.corrcoef(many[:, 0], many[:, 1])[0, 1]) < 0.03       # independent draws of one position
    assert abs(np.corrcoef(many[:-1, 0], many[1:, 0])[0, 1]) < 0.03    # and of neighbouring positions


def test_eval_is_the_centre_crop_without_jitter():
    view = ViewAugment((40, 48), (32, 32), 0.95, JITTER)
    p = draw(0, [1, 2, 3], [view], train=False)
    assert p.matrix is None and p.coef is None
    assert (p.top == (40 - 38) // 2).all() and (p.left == (48 - 46) // 2).all()


def test_train_draws_cover_the_crop_range_and_the_factor_ranges():
    view = ViewAugment((40, 48), (32, 32), 0.9, JITTER)
    ch, cw = view.crop
    p = draw(7, np.arange(4000), [view, view], train=True)
    assert set(p.top[:, 0].tolist()) == set(range(40 - ch + 1)) and set(p.left[:, 1].tolist()) == set(range(48 - cw + 1))
    assert not np.array_equal(p.top[:, 0], p.top[:, 1])                # each view draws its own
    f = jitter_factors(uniforms(7, np.arange(4000), 4), JITTER)
    for i, (lo, hi) in enumerate([(0.7, 1.3), (0.6, 1.4), (0.5, 1.5), (-0.08, 0.08)]):
        assert lo <= f[:, i].min() < lo + 0.01 and hi - 0.01 < f[:, i].max() < hi
    assert (jitter_factors(np.full((2, 4), 0.3), {"hue": 0.1})[:, :3] == 1).all()   # absent factors stay neutral


def test_the_colour_map_is_the_cpu_jitter():
    x = torch.from_numpy(frames(T=3)).permute(0, 3, 1, 2).float() / 255   # [T, 3, H, W]
    us = [0.1, 0.8, 0.35, 0.9]
    cpu = (cpu_color_jitter(x, FixedRng([], us), **JITTER) * 255).round()
    m, c = jitter_affine(jitter_factors(np.array([us]), JITTER))
    u8 = (x * 255).round().to(torch.uint8).permute(0, 2, 3, 1)[None]      # [1, T, H, W, 3]
    dev = color_jitter(u8, torch.from_numpy(m).float(), torch.from_numpy(c).float())
    diff = (dev[0].permute(0, 3, 1, 2).float() - cpu).abs()
    assert diff.max() <= 1 and (diff == 0).float().mean() > 0.99


@pytest.mark.parametrize("jitter", [{}, JITTER])
def test_one_view_equals_the_cpu_transform_with_the_same_draws(jitter):
    view = ViewAugment((40, 48), (32, 32), 0.9, jitter)
    recording = torch.from_numpy(np.concatenate([frames(seed=1), frames(seed=2)]))   # 2 windows of 5 frames
    index = torch.tensor([[0, 1, 2, 3, 4], [9, 8, 7, 6, 5]])
    p = draw(3, [11, 12], [view], train=True)
    out = augment_view(recording, index, view, torch.from_numpy(p.top[:, 0]), torch.from_numpy(p.left[:, 0]),
                       None if p.matrix is None else torch.from_numpy(p.matrix[:, 0]),
                       None if p.coef is None else torch.from_numpy(p.coef[:, 0]))
    assert out.shape == (2, 5, 32, 32, 3) and out.dtype == torch.uint8
    u = uniforms(3, [11, 12], 6)
    for b in range(2):
        rng = FixedRng([p.top[b, 0], p.left[b, 0]], list(u[b, 2:]))
        cpu = transform_view(recording[index[b]].numpy(), (32, 32), True, rng, 0.9, jitter)
        diff = (out[b].int() - cpu.int()).abs()
        if jitter:  # the CPU's OpenCV pass rounds in its own 8-bit arithmetic: a level apart on a few % of pixels
            assert diff.max() <= 1 and (diff == 0).float().mean() > 0.9
        else:
            assert diff.max() == 0                                         # the same uint8 kernel on a CPU


def test_a_window_shares_one_transform_and_off_is_identity():
    view = ViewAugment((32, 32), (32, 32), 0.9, JITTER)
    still = torch.from_numpy(np.repeat(frames(T=1, H=32, W=32), 6, axis=0))        # one frame, 6 times
    index = torch.arange(6)[None].repeat(3, 1)
    p = draw(0, [4, 5, 6], [view], train=True)
    out = augment_view(still, index, view, torch.from_numpy(p.top[:, 0]), torch.from_numpy(p.left[:, 0]),
                       torch.from_numpy(p.matrix[:, 0]), torch.from_numpy(p.coef[:, 0]))
    assert all(torch.equal(out[b, t], out[b, 0]) for b in range(3) for t in range(6))   # consistent over time
    assert not torch.equal(out[0], out[1]) and not torch.equal(out[1], out[2])         # differs across positions
    again = draw(0, [5], [view], train=True)
    assert again.top[0, 0] == p.top[1, 0] and np.array_equal(again.matrix[0], p.matrix[1])  # deterministic
    identity = ViewAugment((32, 32), (32, 32), 1.0, JITTER)
    q = draw(0, [4, 5, 6], [identity], train=False)
    off = augment_view(still, index, identity, torch.from_numpy(q.top[:, 0]), torch.from_numpy(q.left[:, 0]))
    assert torch.equal(off, still[index])


def test_jittered_batches_keep_the_statistics_of_the_frames():
    view = ViewAugment((40, 48), (32, 32), 0.95, JITTER)
    recording = torch.from_numpy(frames(T=1, seed=5))
    n = 400
    index = torch.zeros(n, 1, dtype=torch.long)
    p = draw(1, np.arange(n), [view], train=True)
    out = augment_view(recording, index, view, torch.from_numpy(p.top[:, 0]), torch.from_numpy(p.left[:, 0]),
                       torch.from_numpy(p.matrix[:, 0]), torch.from_numpy(p.coef[:, 0])).float()
    plain = resize(recording[None, :, 1:39, 1:47], (32, 32)).float()
    means = out.mean(dim=(1, 2, 3, 4))
    assert abs(means.mean() - plain.mean()) < 0.05 * plain.mean()      # brightness factors average to 1
    assert means.std() > 0.05 * plain.mean()                           # and do vary
    assert out.min() >= 0 and out.max() <= 255


def test_the_float_resize_is_within_one_level_of_the_uint8_kernel():
    x = torch.from_numpy(frames(T=4, H=38, W=46))[None]
    a = resize(x, (32, 32), uint8_kernel=True)
    b = resize(x, (32, 32), uint8_kernel=False)                        # the GPU's path
    assert (a.int() - b.int()).abs().max() <= 1


def test_stored_size_keeps_the_crop_margin_and_bounds_memory():
    assert stored_size((128, 128), (128, 128), 0.95) == (128, 128)       # libero_scripted: as recorded
    assert stored_size((256, 256), (128, 128), 0.95) == (135, 135)       # larger: ceil(128 / 0.95)
    assert stored_size((180, 320), (176, 320), 0.95) == (180, 320)
