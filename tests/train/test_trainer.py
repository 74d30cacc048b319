"""The trainer: single process, 2-process FSDP2 on gloo, atomic checkpoints, bit-exact resume after kill -9."""

import json

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dzmodel.dirlock import DirectoryBusy, directory_lock
from dzmodel.proctree import kill_tree
from dzmodel.data.embodiments import get_embodiment, load_embodiments
from dzmodel.train.checkpoint import latest_checkpoint
from dzmodel.train.config import TrainConfig
from dzmodel.train.trainer import lr_at, train



def _cfg(data, out, **kw) -> TrainConfig:
    base = dict(preset="tiny", datasets=[str(data / "ds")], embodiment="tabletop_pusher",
                embodiment_files=[str(data / "emb.yaml")], metadata=str(data / "meta.json"), tokenizer=str(data / "tok"),
                steps=6, save_every=3, out_dir=str(out), lr=1e-3, warmup_ratio=0.2, progress=False)
    base.update(kw)
    return TrainConfig(**base)


def test_schedule_warmup_then_cosine():
    cfg = TrainConfig(steps=100, lr=1.0, warmup_ratio=0.1, min_lr=0.1)
    assert lr_at(0, cfg) == pytest.approx(0.1) and lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(10, cfg) == pytest.approx(1.0) and lr_at(99, cfg) < 0.11
    assert lr_at(55, cfg) == pytest.approx(0.1 + 0.9 * 0.5, abs=1e-9)


def test_single_process_checkpoints_and_resumes_bit_exact(data, tmp_path):
    ref = train(_cfg(data, tmp_path / "ref"))
    assert [h["step"] for h in ref] == [1, 2, 3, 4, 5, 6]
    lines = (tmp_path / "ref" / "metrics.jsonl").read_text().splitlines()
    first = json.loads(lines[0])
    assert {"loss", "action_loss", "dynamics_loss", "lr", "grad_norm", "samples_per_s_per_gpu",
            "peak_mem_gib"} <= set(first)
    assert "mfu" not in first  # a CPU has no peak to divide by
    part = train(_cfg(data, tmp_path / "run", steps=6, stop_at=3))
    assert latest_checkpoint(tmp_path / "run").name == "step_0000003"
    rest = train(_cfg(data, tmp_path / "run", steps=6))
    assert [h["step"] for h in rest] == [4, 5, 6]
    assert [h["loss"] for h in part + rest] == [h["loss"] for h in ref]  # bit-exact, not approximately
    assert train(_cfg(data, tmp_path / "run", steps=6)) == []  # finished: nothing to do


def test_epochs_set_the_length_in_samples_not_steps(data, tmp_path):
    """train.epochs: ceil(epochs x windows / global_batch) steps, whatever train.steps says; the schedule spans them."""
    from dzmodel.train.trainer import Trainer

    cfg = _cfg(data, tmp_path / "run", steps=1000, epochs=0.25, micro_batch=2, global_batch=4, save_every=0)
    trainer = Trainer(cfg)
    trainer.build_model()
    trainer.build_data()
    windows = trainer.num_windows
    expected = -(-windows // 16)  # ceil(0.25 x windows / 4)
    history = train(_cfg(data, tmp_path / "run", steps=1000, epochs=0.25, micro_batch=2, global_batch=4, save_every=0))
    assert windows > 16 and len(history) == expected and history[-1]["step"] == expected
    with pytest.raises(ValueError, match=r"train.epochs: must be in \(0, 1000000\]"):
        _cfg(data, tmp_path, epochs=0)


def test_a_second_run_on_the_same_directory_is_refused_before_it_writes(data, tmp_path):
    with directory_lock(tmp_path / "run"):  # e.g. workers left running by a killed torchrun
        with pytest.raises(DirectoryBusy, match="another `dz train`"):
            train(_cfg(data, tmp_path / "run", steps=2))
    assert list((tmp_path / "run").iterdir()) == []
    assert [h["step"] for h in train(_cfg(data, tmp_path / "run", steps=2))] == [1, 2]


def test_gradient_accumulation_matches_a_bigger_micro_batch(data, tmp_path):
    big = train(_cfg(data, tmp_path / "a", steps=2, micro_batch=2, global_batch=2))
    acc = train(_cfg(data, tmp_path / "b", steps=2, micro_batch=1, global_batch=2))
    # per-sample noise seeded by stream position: the same samples give the same loss either way
    assert abs(big[0]["loss"] - acc[0]["loss"]) < 1e-5, (big[0]["loss"], acc[0]["loss"])
    assert len(acc) == 2


def test_bf16_training_runs_the_frozen_encoders_in_bf16(data, tmp_path):
    import math

    import torch

    from dzmodel.train.trainer import Trainer

    cfg = _cfg(data, tmp_path / "bf16", steps=2, precision="bf16", save_every=10)
    trainer = Trainer(cfg)
    trainer.build_model()
    assert all(p.dtype == torch.bfloat16 for m in trainer.encoders.modules() for p in m.parameters())
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())  # master weights stay fp32
    history = train(cfg)
    assert len(history) == 2 and all(math.isfinite(h["loss"]) for h in history)


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="sharding"):
        TrainConfig(sharding="zero3")
    with pytest.raises(ValueError, match="global_batch"):
        TrainConfig(micro_batch=3, global_batch=4).accumulation(1)


def test_every_rank_meets_the_tokenizer_barrier_even_when_rank_0_already_wrote_it(data, tmp_path, monkeypatch):
    # The race CI hit: rank 1 looked for tokenizer.json after rank 0 had built it, skipped the barrier, and the
    # two ranks then paired rank 0's barrier with rank 1's first FSDP all-gather: a hang.
    import torch.distributed as dist

    from dzmodel.model.tokenizer import build_tiny_tokenizer
    from dzmodel.train.trainer import DistInfo, Trainer

    trainer = Trainer(_cfg(data, tmp_path / "run", tokenizer=None))
    build_tiny_tokenizer(tmp_path / "run" / "tokenizer")  # what rank 0 did a moment earlier
    trainer.info = DistInfo(rank=1, world_size=2, local_rank=1, device=trainer.info.device)
    barriers = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: barriers.append(1))
    trainer._tokenizer()
    assert barriers == [1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(cfg: TrainConfig, cfg_path: Path, nproc: int = 2) -> subprocess.Popen:
    cfg_path.write_text(json.dumps(cfg.to_dict()))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
           f"--master_port={_free_port()}", "-m", "dzmodel.cli", "train", "--config", str(cfg_path)]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def _kill9_job(p: subprocess.Popen) -> None:
    """kill -9 a torchrun job whole, as a lost node would: the launcher and every worker at once."""
    killed = kill_tree(p.pid, timeout=60)
    assert len(killed) >= 3, f"torchrun and its 2 workers, got {killed}"
    p.wait()


def _failure(out: bytes) -> str:
    """What a failed torchrun printed: each rank's first traceback (the root cause, which a 2-process job's
    last lines often do not show: the peer only reports the closed connection) and the tail."""
    text = out.decode(errors="replace")
    heads = [m.start() for m in re.finditer(r"Traceback \(most recent call last\)", text)]
    first = "\n".join(text[h:h + 2500] for h in heads[:2])
    return f"{first}\n...\n{text[-2500:]}"


def _losses(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


@pytest.mark.slow
def test_two_process_fsdp2_kill9_and_resume_bit_exact(data, tmp_path):
    steps = 10
    ref_out = tmp_path / "ref"
    p = _torchrun(_cfg(data, ref_out, steps=steps, save_every=2, micro_batch=1, global_batch=2), tmp_path / "ref.json")
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 0, _failure(out)
    ref = _losses(ref_out)
    assert sorted(ref) == list(range(1, steps + 1))
    ckpt = latest_checkpoint(ref_out)
    assert (ckpt / "__0_0.distcp").is_file() and (ckpt / "__1_0.distcp").is_file()  # sharded by FSDP2

    run_out = tmp_path / "run"
    cfg = _cfg(data, run_out, steps=steps, save_every=2, micro_batch=1, global_batch=2)
    p = _torchrun(cfg, tmp_path / "run.json")
    deadline = time.time() + 600
    while time.time() < deadline:  # kill -9 the whole job once step 5 is logged (mid-training)
        if (run_out / "metrics.jsonl").is_file() and max(_losses(run_out), default=0) >= 5:
            break
        time.sleep(0.02)
    _kill9_job(p)
    killed_at = max(_losses(run_out))
    assert killed_at < steps, "the run finished before it could be killed"
    resume_from = latest_checkpoint(run_out)
    assert resume_from is not None
    p = _torchrun(cfg, tmp_path / "run.json")
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 0, _failure(out)
    rows = [json.loads(line) for line in (run_out / "metrics.jsonl").read_text().splitlines()]
    resumed = [r for r in rows if r["step"] > int(resume_from.name.split("_")[1])][-(steps - int(resume_from.name.split("_")[1])):]
    assert [r["step"] for r in resumed] == list(range(int(resume_from.name.split("_")[1]) + 1, steps + 1))
    assert all(r["loss"] == ref[r["step"]] for r in resumed), (resumed, ref)
    assert not list((run_out / "checkpoints").glob("*.tmp"))


def _run_to_end(cfg, path, nproc):
    p = _torchrun(cfg, path, nproc)
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 0, _failure(out)


@pytest.mark.slow
@pytest.mark.parametrize("first, second", [(2, 1), (1, 2)])
def test_resume_on_another_process_count_continues_the_run(data, tmp_path, first, second):
    """Train 3 of 6 steps on `first` processes, resume on `second` (DCP reshards model and optimizer; the sample
    stream's position is global): steps 4-6 match an uninterrupted 2-process run with the same global batch."""
    common = dict(steps=6, save_every=3, micro_batch=1, global_batch=2)
    ref_out = tmp_path / "ref"
    _run_to_end(_cfg(data, ref_out, **common), tmp_path / "ref.json", 2)
    ref = _losses(ref_out)
    run_out = tmp_path / "run"
    _run_to_end(_cfg(data, run_out, stop_at=3, **common), tmp_path / "a.json", first)
    state = json.loads((latest_checkpoint(run_out) / "trainer_state.json").read_text())
    assert state["samples"] == 6 and state["world_size"] == first
    _run_to_end(_cfg(data, run_out, **common), tmp_path / "b.json", second)
    got = _losses(run_out)
    assert sorted(got) == list(range(1, 7))
    for step in (4, 5, 6):
        assert got[step] == pytest.approx(ref[step], rel=1e-3), (step, got, ref)


def test_resume_position_splits_the_global_count():
    from dzmodel.data.errors import DataError
    from dzmodel.train.trainer import resume_position

    assert resume_position({"samples": 12, "consumed": {"0": 6, "1": 6}}, 4) == 3
    assert resume_position({"consumed": {"0": 6, "1": 6}}, 1) == 12  # a checkpoint from before the global count
    with pytest.raises(DataError, match="do not split evenly over them"):
        resume_position({"samples": 6}, 4)


def test_convert_round_trips_exactly(data, tmp_path):
    import torch

    from dzmodel.cli import main
    from dzmodel.model.args import preset
    from dzmodel.model.state_dict import load_dreamzero_dir
    from dzmodel.model.wam import DreamZeroWAM
    from dzmodel.train.checkpoint import load_checkpoint

    run = tmp_path / "run"
    train(_cfg(data, run, steps=2, save_every=1))
    assert main(["convert", str(run), "--out", str(tmp_path / "hf"), "--max-shard-gib", "0.0001"]) == 0
    hf = tmp_path / "hf"
    assert (hf / "config.json").is_file() and (hf / "model.safetensors.index.json").is_file()
    assert (hf / "experiment_cfg" / "metadata.json").is_file()
    assert not any(p.suffix in (".pt", ".pth", ".bin", ".pkl") for p in hf.rglob("*"))
    converted = load_dreamzero_dir(hf).eval()
    reference = DreamZeroWAM(preset("tiny"))
    load_checkpoint(latest_checkpoint(run), reference, None)
    for k, v in reference.state_dict().items():
        assert torch.equal(v, converted.state_dict()[k]), k
    from tests.model.helpers import tiny_batch

    b = tiny_batch(reference.args)
    with torch.no_grad():
        a, c = reference.eval()(**b, attn_backend="sdpa"), converted(**b, attn_backend="sdpa")
    assert torch.equal(a.video_pred, c.video_pred) and torch.equal(a.action_pred, c.action_pred)
    assert main(["convert", str(run), "--step", "1", "--out", str(tmp_path / "hf1")]) == 0
    assert main(["convert", str(tmp_path / "nothing"), "--out", str(tmp_path / "x")]) == 2


@pytest.mark.slow
def test_optimised_and_plain_paths_give_the_same_losses_over_50_steps(data, tmp_path):
    """Plain: micro-batch 1 x 2 accumulation, no recompute, eager. Optimised: micro-batch 2, full recompute,
    compiled blocks. Same samples and noise (seeded per stream position): fp32 losses agree."""
    common = dict(steps=50, save_every=50, global_batch=2, lr=3e-4, attn_backend="sdpa")
    plain = train(_cfg(data, tmp_path / "plain", micro_batch=1, activation_checkpointing="none", compile=False, **common))
    opt = train(_cfg(data, tmp_path / "opt", micro_batch=2, activation_checkpointing="full", compile=True, **common))
    a = [h["loss"] for h in plain]
    b = [h["loss"] for h in opt]
    assert len(a) == len(b) == 50
    worst = max(abs(x - y) / max(abs(x), 1e-6) for x, y in zip(a, b))
    assert worst < 1e-3, worst
    assert sum(a[-10:]) < sum(a[:10])  # and it learns


def test_encoder_cache_holds_the_online_encoder_outputs_and_trains(data, tmp_path):
    """`dz cache` stores exactly what the frozen encoders give on the (eval-transformed) windows; training reads it."""
    from dzmodel.cli import main
    from dzmodel.model.tokenizer import build_tiny_tokenizer
    from dzmodel.train.cache import CachedWindows

    build_tiny_tokenizer(data / "tok")
    cfg = _cfg(data, tmp_path / "x")
    cfg_path = tmp_path / "cfg.json"
    cfg_path.write_text(json.dumps(cfg.to_dict()))
    assert main(["cache", "--config", str(cfg_path), "--out", str(tmp_path / "cache"), "--stride", "4"]) == 0
    cache = CachedWindows(tmp_path / "cache")
    idx = json.loads((tmp_path / "cache" / "index.json").read_text())
    assert len(cache) == idx["samples"] > 0 and len(idx["prompts"]) <= 4  # text stored once per unique prompt
    s = cache[0]
    assert s["clean_latents"].shape == (8, 5, 2, 4) and s["context"].shape == (16, 32)
    import torch

    from dzmodel.data.collate import Collator
    from dzmodel.data.dataset import WindowDataset, load_statistics
    from dzmodel.data.lerobot_format import open_dataset
    from dzmodel.data.sampling import WindowSpec
    from dzmodel.model.components import build_encoders
    from dzmodel.model.conditioning import encode_batch
    from dzmodel.model.tokenizer import load_tokenizer

    emb = get_embodiment("tabletop_pusher", load_embodiments([data / "emb.yaml"]))
    ds = WindowDataset(open_dataset(data / "ds"), emb, WindowSpec(2, 4, 8, emb.sampling),
                       load_statistics(data / "meta.json", emb.tag), train=False)
    torch.manual_seed(cfg.seed + 1)
    enc = build_encoders("tiny")
    batch = Collator(load_tokenizer(data / "tok"), 16, 8, 8)([ds.sample(4, 4)])  # stride 4: cache row 1
    from dzmodel.model.args import preset

    online = encode_batch(preset("tiny"), enc.vae, enc.text_encoder, enc.image_encoder, batch["images"], batch["text"], batch["text_attention_mask"])
    torch.testing.assert_close(cache[1]["clean_latents"], online.clean_latents[0])
    torch.testing.assert_close(cache[1]["context"], online.context[0])
    torch.testing.assert_close(cache[1]["action"], batch["action"][0])
    hist = train(_cfg(data, tmp_path / "cached_run", steps=4, save_every=4, cache=str(tmp_path / "cache")))
    assert len(hist) == 4 and all(h["loss"] == h["loss"] for h in hist)  # finite
    resumed = train(_cfg(data, tmp_path / "cached_run", steps=4, save_every=4, cache=str(tmp_path / "cache")))
    assert resumed == []


def test_a_tiny_model_sizes_its_state_and_action_to_the_embodiment(data, tmp_path):
    """A robot with more state/action dims than the tiny preset's 8: the widths follow the embodiment's metadata,
    are saved in the run's config (so convert builds the same model), and an explicit override still wins."""
    from dzmodel.data.dataset import embodiment_metadata
    from dzmodel.train.windows import size_to_embodiment

    wide = (data / "emb.yaml").read_text().replace("tabletop_pusher:", "wide_pusher:").replace(
        "state: {state: {column: observation.state}}",
        "state: {state: {column: observation.state}, again: {column: observation.state}}")
    (tmp_path / "wide.yaml").write_text(wide)
    emb = get_embodiment("wide_pusher", load_embodiments([tmp_path / "wide.yaml"]))
    embodiment_metadata(data / "ds", emb, tmp_path / "meta.json")
    cfg = _cfg(data, tmp_path / "run", embodiment="wide_pusher", embodiment_files=[str(tmp_path / "wide.yaml")],
               metadata=str(tmp_path / "meta.json"), steps=1, save_every=1)
    assert size_to_embodiment(cfg).model_overrides == {"max_state_dim": 16}
    assert train(cfg)[-1]["step"] == 1
    state = json.loads((latest_checkpoint(tmp_path / "run") / "trainer_state.json").read_text())
    assert state["config"]["model_overrides"] == {"max_state_dim": 16}
    pinned = _cfg(data, tmp_path / "x", embodiment="wide_pusher", embodiment_files=[str(tmp_path / "wide.yaml")],
                  metadata=str(tmp_path / "meta.json"), model_overrides={"max_state_dim": 20})
    assert size_to_embodiment(pinned).model_overrides == {"max_state_dim": 20}
    with pytest.raises(ValueError, match="valid: .*max_state_dim"):
        from dzmodel.model.args import preset
        preset("tiny", max_action_dim=26)


def test_the_seeded_init_of_small_presets_is_drawn_on_the_cpu():
    """As the encoders: a tiny run trained on a GPU and evaluated on a CPU starts from the same numbers (and so does
    its untrained reference); a big preset is drawn where it trains, a WAN DiT file is loaded on the CPU."""
    from dzmodel.train.trainer import init_device

    assert init_device(TrainConfig(preset="tiny"), "cuda") == "cpu"
    assert init_device(TrainConfig(preset="dreamzero_5b"), torch.device("cuda", 1)) == "cuda"
    assert init_device(TrainConfig(preset="dreamzero_5b", init_dit="w.safetensors"), "cuda") == "cpu"
