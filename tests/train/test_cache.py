"""`dz cache --synthetic`: a cache of a preset's real shapes without data or encoders, that `dz train` trains from
(how `dz train` is measured on a GPU; docs/performance.md)."""

import json

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
