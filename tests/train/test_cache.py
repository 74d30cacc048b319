"""`dz cache --synthetic`: a cache of a preset's real shapes without data or encoders, that `dz train` trains from
(how `dz train` is measured on a GPU; docs/performance.md)."""

import json

import pytest

from safetensors.torch import load_file

from dzmodel.cli import main
from dzmodel.model.args import preset
from dzmodel.train.cache import CachedWindows
from dzmodel.train.checkpoint import latest_checkpoint


def test_a_synthetic_cache_has_the_presets_shapes_and_dz_train_reads_it(tmp_path, capsys):
    cache, run = tmp_path / "cache", tmp_path / "run"
    assert main(["cache", "--synthetic", "20", "--preset", "tiny", "--latent-hw", "4,6", "--out", str(cache)]) == 0
    a = preset("tiny")
    index = json.loads((cache / "index.json").read_text())
    assert index["synthetic"] and index["samples"] == 20 and len(index["shards"]) == 1 and len(index["prompts"]) == 4
    shard = load_file(str(cache / index["shards"][0]["file"]))
    z = a.in_dim - (20 if a.concat_first_frame_latent else 0)
    assert tuple(shard["clean_latents"].shape) == (20, z, a.num_frames, 4, 6)
    assert tuple(shard["clip_feature"].shape) == (20, a.clip_tokens, a.clip_dim)
    sample = CachedWindows(cache, expect_preset="tiny")[3]
    assert tuple(sample["context"].shape) == (a.text_len, a.text_dim)
    assert main(["train", "--preset", "tiny", "--set", f"cache={cache}", "--steps", "3", "--out", str(run),
                 "--set", "save_every=0", "--set", "progress=false"]) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["samples_per_s_per_gpu"] > 0 for r in rows)
    assert latest_checkpoint(run) is None  # save_every 0: a measurement run writes no checkpoint
    assert "step 3: loss" in capsys.readouterr().out


def test_synthetic_wants_a_positive_count(tmp_path, capsys):
    assert main(["cache", "--synthetic", "0", "--preset", "tiny", "--out", str(tmp_path / "c")]) != 0
    assert "--synthetic wants a number of samples >= 1, got 0" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


def test_learnable_caches_of_two_seeds_follow_one_rule(tmp_path):
    from dzmodel.train.cache import learnable_actions

    a = preset("tiny")
    rows = a.max_chunk_size * a.num_action_per_block
    shards = []
    for seed in (0, 1):
        out = tmp_path / f"c{seed}"
        assert main(["cache", "--synthetic", "8", "--preset", "tiny", "--latent-hw", "4,6", "--learnable",
                     "--set", f"seed={seed}", "--out", str(out)]) == 0
        index = json.loads((out / "index.json").read_text())
        assert index["learnable"] and index["seed"] == seed
        shards.append(load_file(str(out / index["shards"][0]["file"])))
    for shard in shards:
        expected = learnable_actions(shard["clean_latents"], shard["state"], rows, a.action_dim)
        assert (shard["action"].float() - expected).abs().max() < 1e-6
        assert shard["action"].float().std() > 0.2  # not saturated, not constant
    assert not shards[0]["clean_latents"].equal(shards[1]["clean_latents"])  # other samples, the same rule
    random = tmp_path / "random"
    assert main(["cache", "--synthetic", "8", "--preset", "tiny", "--latent-hw", "4,6", "--out", str(random)]) == 0
    index = json.loads((random / "index.json").read_text())
    shard = load_file(str(random / index["shards"][0]["file"]))
    assert (shard["action"].float() - learnable_actions(shard["clean_latents"], shard["state"], rows,
                                                        a.action_dim)).abs().max() > 0.5


def test_held_out_losses_are_logged_at_fixed_draws_whatever_the_scoring_micro_batch(tmp_path):
    """`train.val_cache`: a cache of another seed, scored every val_every steps (or at each checkpoint and the end)
    eager, at fixed draws and with each sample's own prompt: the same numbers whatever the micro-batch scores them,
    twice in a row, and with prompt dropout on."""
    from dzmodel.train.config import TrainConfig
    from dzmodel.train.trainer import Trainer

    train_cache, val_cache = tmp_path / "train", tmp_path / "val"
    for out, seed, n in ((train_cache, 0, 16), (val_cache, 1, 6)):
        assert main(["cache", "--synthetic", str(n), "--preset", "tiny", "--latent-hw", "4,6", "--learnable",
                     "--set", f"seed={seed}", "--out", str(out)]) == 0
    run = tmp_path / "run"
    assert main(["train", "--preset", "tiny", "--set", f"cache={train_cache}", "--set", f"val_cache={val_cache}",
                 "--set", "val_every=4", "--steps", "10", "--out", str(run), "--set", "save_every=5",
                 "--set", "progress=false", "--set", "log_every=3"]) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "val_action_loss" in r] == [4, 8]
    assert [r["step"] for r in rows] == [3, 4, 6, 8, 9]  # the held-out steps are logged beside log_every's

    def trainer(micro_batch):
        cfg = TrainConfig(preset="tiny", cache=str(train_cache), val_cache=str(val_cache), micro_batch=micro_batch,
                          global_batch=micro_batch, out_dir=str(tmp_path / f"t{micro_batch}"), progress=False,
                          prompt_dropout=0.5, seed=3)
        t = Trainer(cfg)
        t.build_model(with_encoders=False)
        t.build_data()
        return t

    one, three = trainer(1), trainer(3)
    three.model.load_state_dict(one.model.state_dict())
    first = one.validate()
    assert set(first) == {"val_loss", "val_dynamics_loss", "val_action_loss"}
    assert one.validate() == first and one.step.prompt_dropout == 0.5
    assert three.validate() == pytest.approx(first, rel=2e-3)  # bf16 sums in other groupings
    one.step.noise_seed = 4  # other draws: other numbers (the draws are the seed's, not fixed by accident)
    assert one.validate()["val_action_loss"] != first["val_action_loss"]


def test_prompts_of_a_few_tokens_are_zero_past_their_length_and_train_on_those_rows_alone(tmp_path, monkeypatch):
    """--prompt-tokens: each synthetic prompt zero past its own length (the longest that many rows), the null
    prompt one row. The trainer finds the rows every prompt fits in (`prompt_rows`), runs the cross-attention's text
    K and V on them, and trains to the same losses as on the whole context."""
    from dzmodel.model.conditioning import prompt_rows
    from dzmodel.train.config import TrainConfig
    from dzmodel.train.trainer import Trainer, train

    cache = tmp_path / "cache"
    assert main(["cache", "--synthetic", "8", "--preset", "tiny", "--latent-hw", "4,6", "--prompt-tokens", "6",
                 "--out", str(cache)]) == 0
    windows = CachedWindows(cache)
    used = (windows.text.abs().amax(-1) != 0).sum(-1).tolist()
    assert max(used) == 6 and all(3 <= n <= 6 for n in used) and len(used) == 4
    assert (windows.null_context.abs().amax(-1) != 0).sum().item() == 1
    assert json.loads((cache / "index.json").read_text())["prompt_tokens"] == 6
    assert prompt_rows(windows.text, windows.null_context) == 6

    def cfg(name, **kw):
        return TrainConfig(preset="tiny", cache=str(cache), steps=2, micro_batch=2, global_batch=2, save_every=0,
                           out_dir=str(tmp_path / name), progress=False, lr=1e-3, **kw)

    trainer = Trainer(cfg("probe", prompt_dropout=0.5))
    trainer.build_model()
    trainer.build_data()
    assert trainer.step.text_rows == 6
    # a held-out cache with longer prompts: the rows cover its prompts too
    held_out = tmp_path / "held_out"
    assert main(["cache", "--synthetic", "4", "--preset", "tiny", "--latent-hw", "4,6", "--prompt-tokens", "9",
                 "--set", "seed=1", "--out", str(held_out)]) == 0
    trainer = Trainer(cfg("probe_val", val_cache=str(held_out)))
    trainer.build_model()
    trainer.build_data()
    assert trainer.step.text_rows == 9

    from dzmodel.model.wam import DreamZeroWAM

    passed, forward = [], DreamZeroWAM.forward
    monkeypatch.setattr(DreamZeroWAM, "forward",
                        lambda self, *a, **kw: passed.append(kw.get("text_rows")) or forward(self, *a, **kw))
    rows = [r["loss"] for r in train(cfg("rows"))]
    assert passed and set(passed) == {6}  # every step's forward left the padding rows out
    import dzmodel.train.trainer as trainer_module

    monkeypatch.setattr(trainer_module, "prompt_rows", lambda *tables: preset("tiny").text_len)  # the whole context
    assert rows == pytest.approx([r["loss"] for r in train(cfg("whole"))], rel=1e-5)


def test_prompt_tokens_without_synthetic_or_past_text_len_is_one_clear_error(tmp_path, capsys):
    assert main(["cache", "--prompt-tokens", "6", "--preset", "tiny", "--out", str(tmp_path / "c")]) != 0
    assert "--prompt-tokens shapes a synthetic cache's prompts: it goes with --synthetic N" in capsys.readouterr().err
    text_len = preset("tiny").text_len
    assert main(["cache", "--synthetic", "2", "--preset", "tiny", "--prompt-tokens", str(text_len + 1),
                 "--out", str(tmp_path / "c")]) != 0
    assert f"prompt_tokens must be in [1, {text_len}]" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()
