"""`dz train` with `data_on_device`: it trains (the loss falls), resumes bit-exactly from a checkpoint, decodes the
recording once (no per-sample decoding), reads the device back once per log window, and is refused with a cache."""

import json

import pytest
import torch

from dzmodel.data.lerobot_format import LeRobotReader
from dzmodel.train.checkpoint import latest_checkpoint
from dzmodel.train.config import TrainConfig
from dzmodel.train.trainer import Trainer, train


def _cfg(data, out, **kw) -> TrainConfig:
    base = dict(preset="tiny", datasets=[str(data / "ds")], embodiment="tabletop_pusher",
                embodiment_files=[str(data / "emb.yaml")], metadata=str(data / "meta.json"), tokenizer=str(data / "tok"),
                steps=6, save_every=3, out_dir=str(out), lr=1e-3, warmup_ratio=0.2, progress=False,
                data_on_device=True)
    base.update(kw)
    return TrainConfig(**base)


def test_device_data_trains_and_resumes_bit_exact(data, tmp_path):
    ref = train(_cfg(data, tmp_path / "ref"))
    assert [h["step"] for h in ref] == [1, 2, 3, 4, 5, 6]
    part = train(_cfg(data, tmp_path / "run", stop_at=3))
    assert latest_checkpoint(tmp_path / "run").name == "step_0000003"
    rest = train(_cfg(data, tmp_path / "run"))
    assert [h["step"] for h in rest] == [4, 5, 6]
    assert [h["loss"] for h in part + rest] == [h["loss"] for h in ref]  # bit-exact


def test_device_data_learns(data, tmp_path):
    """The loss of fixed samples (fixed positions: the same windows, augmentation and noise) before and after 30
    steps: it falls clearly below the untrained model's."""
    import torch

    cfg = _cfg(data, tmp_path / "run", steps=30, save_every=0, lr=3e-3, micro_batch=4, global_batch=4,
               warmup_ratio=0.05, log_every=10)

    def fixed_loss(trainer):
        batch = trainer.device_data.batch([trainer.stream.peek(i) for i in range(8)])
        with torch.no_grad():
            return float(trainer.step.losses(batch).loss)

    untrained = Trainer(cfg)
    untrained.build_model()
    untrained.build_data()
    before = fixed_loss(untrained)
    trained = Trainer(cfg)
    assert len(trained.run()) == 30
    assert fixed_loss(trained) < 0.85 * before  # 3.14 -> 2.29 here


def test_the_recording_is_decoded_once_and_the_device_read_once_per_window(data, tmp_path, monkeypatch):
    decodes = []
    read = LeRobotReader.read_frames
    monkeypatch.setattr(LeRobotReader, "read_frames", lambda self, *a, **k: decodes.append(a[:2]) or read(self, *a, **k))
    reads = []
    read_back = Trainer._read_back
    monkeypatch.setattr(Trainer, "_read_back", lambda self, pending: reads.append(len(pending)) or read_back(self, pending))
    history = train(_cfg(data, tmp_path / "run", steps=8, save_every=0, log_every=4, micro_batch=2, global_batch=2))
    episodes, views = 3, 2
    assert sorted(decodes) == sorted({(e, k) for e in range(episodes)
                                      for k in ("observation.images.image", "observation.images.wrist_image")})
    assert len(decodes) == episodes * views                      # 16 samples, no decode per sample
    assert reads == [4, 4]                                       # one device read per 4 steps
    assert [h["step"] for h in history] == list(range(1, 9))     # every step's numbers still come back
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [4, 8] and all(r["samples_per_s_per_gpu"] > 0 for r in rows)


def test_data_on_device_is_refused_with_a_cache():
    with pytest.raises(ValueError, match="data_on_device"):
        TrainConfig(data_on_device=True, cache="data/cache")


def test_encoded_copies_run_the_encoders_once_per_copy_and_resume_bit_exact(data, tmp_path, monkeypatch):
    """train.encoded_variants: the VAE runs K passes over the windows before training and never inside a step;
    the run stops and resumes to the same losses."""
    from dzmodel.model.vae import WanVideoVAE38

    encodes = []
    encode = WanVideoVAE38.encode
    monkeypatch.setattr(WanVideoVAE38, "encode", lambda self, x, *a, **k: encodes.append(x.shape[0]) or encode(self, x, *a, **k))
    kw = dict(encoded_variants=2, micro_batch=2, global_batch=2)
    ref = train(_cfg(data, tmp_path / "ref", **kw))
    trainer = Trainer(_cfg(data, tmp_path / "probe", **kw))
    trainer.build_model()
    trainer.build_data()
    windows = trainer.device_data.windows
    assert sum(encodes) == 2 * 2 * windows  # two runs so far (ref, probe), each encoding 2 copies of every window
    encodes.clear()
    part = train(_cfg(data, tmp_path / "run", stop_at=3, **kw))
    rest = train(_cfg(data, tmp_path / "run", **kw))
    assert sum(encodes) == 2 * 2 * windows  # the two invocations each encoded once, not per step
    assert [h["loss"] for h in part + rest] == [h["loss"] for h in ref]


@pytest.mark.parametrize("kw, match", [(dict(encoded_variants=2, data_on_device=False), "needs train.data_on_device"),
                                       (dict(encoded_variants=3, augment=False), "identical copies"),
                                       (dict(encoded_variants=-1), r"must be in \[0, 64\], got -1")])
def test_encoded_copies_refuse_what_cannot_work(kw, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**{"data_on_device": True, **kw})


@pytest.mark.parametrize("precision, on, want", [("bf16", True, torch.bfloat16), ("bf16", False, None),
                                                 ("fp8", True, torch.bfloat16), ("fp32", True, None)])
def test_residual_in_compute_dtype_reaches_the_step(data, tmp_path, precision, on, want):
    """train.residual_in_compute_dtype: the step casts the tokens between blocks to the compute dtype (bf16, also
    under fp8, whose non-FP8 work computes in bf16); off, or in fp32, it leaves them as the embeddings give them."""
    trainer = Trainer(_cfg(data, tmp_path / "r", precision=precision, residual_in_compute_dtype=on))
    trainer.build_model()
    assert trainer.step.residual_dtype == want


@pytest.mark.parametrize("on", [True, False])
def test_denoise_first_frame_reaches_the_step_and_the_flops(data, tmp_path, on):
    """train.denoise_first_frame: the step builds its sequence with or without the noisy frame 0, and the MFU's
    FLOPs count the sequence it runs."""
    trainer = Trainer(_cfg(data, tmp_path / "r", denoise_first_frame=on))
    trainer.build_model()
    trainer.build_data()
    assert trainer.step.denoise_first_frame is on
    batch = trainer.device_data.batch([trainer.stream.peek(i) for i in range(2)])
    latents = trainer.step.encode(batch).clean_latents
    a = trainer.args
    assert trainer.flops_per_sample == a.flops(tuple(latents.shape[-2:]), latents.shape[2],
                                               noisy_first_frame=on).train()
    assert a.flops(tuple(latents.shape[-2:]), noisy_first_frame=False).forward < a.flops(tuple(latents.shape[-2:])).forward


def test_video_decode_nvdec_is_refused_off_an_nvidia_gpu(data, tmp_path):
    with pytest.raises(ValueError, match="nvdec decodes on an NVIDIA GPU; this run trains on cpu"):
        train(_cfg(data, tmp_path / "run", data_on_device=False, video_decode="nvdec"))


def test_the_loader_hands_the_step_batches_decoded_on_the_device(data, tmp_path, monkeypatch):
    """`video_decode: nvdec` past its device check: the loader's batches name their frames, the trainer's loader
    fills them in (a stand-in decoder library on the CPU, tests/data/test_nvdec.py), and the step trains on them."""
    import sys

    from dzmodel.data.nvdec import VideoImages

    from ..data.test_nvdec import _FakeSimpleDecoder

    monkeypatch.setitem(sys.modules, "PyNvVideoCodec", type(sys)("PyNvVideoCodec"))
    sys.modules["PyNvVideoCodec"].SimpleDecoder = _FakeSimpleDecoder
    sys.modules["PyNvVideoCodec"].OutputColorType = type("OutputColorType", (), {"RGB": "RGB"})
    trainer = Trainer(_cfg(data, tmp_path / "run", data_on_device=False, micro_batch=2, global_batch=2))
    trainer.build_model()
    trainer.build_data()
    reference = next(iter(trainer.loader(0)))
    trainer.video_images = VideoImages.attach(trainer.datasets, "cpu", train=True, seed=trainer.cfg.seed)
    loader = trainer.loader(0)
    batch = next(iter(loader))
    loader.close()  # the prefetching thread
    assert set(batch) == set(reference) and batch["images"].shape == reference["images"].shape
    assert torch.equal(batch["position"], reference["position"]) and torch.equal(batch["action"], reference["action"])
    assert torch.isfinite(trainer.step.losses(batch).loss)
