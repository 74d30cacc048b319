"""`dz bench data --trainer-loader`: dz train's own DataLoader over a DROID-shaped dataset (3 cameras at 180x320)."""

import json
import os

import pytest

from dzmodel.bench.loader_bench import run_loader_bench
from dzmodel.cli import main
from dzmodel.data.video import video_info


def test_the_trainer_loader_bench_reads_droid_windows_through_the_trainers_loader(tmp_path):
    rows = run_loader_bench(tmp_path, workers=(0,), batches=1, micro_batch=1, episodes=1)
    row, = rows
    assert row["samples"] == 1 and row["samples_per_s"] > 0 and row["workers"] == 0
    assert row["images"] == [1, 33, 352, 640, 3]  # the 5B's 33 frames of DROID's layout (wrist stretched on top)
    videos = sorted((tmp_path / "droid_h264_g2").rglob("*.mp4"))
    assert len(videos) == 3 and (video_info(videos[0])["height"], video_info(videos[0])["width"]) == (180, 320)


def test_droid_in_the_5b_frame_lays_the_same_videos_out_at_176x320(tmp_path):
    row, = run_loader_bench(tmp_path, workers=(0,), batches=1, micro_batch=1, episodes=1, embodiment="oxe_droid_5b")
    assert row["images"] == [1, 33, 176, 320, 3] and row["embodiment"] == "oxe_droid_5b"
    assert (tmp_path / "droid_h264_g2.oxe_droid_5b.metadata.json").is_file()  # beside oxe_droid's, not over it
    assert not (tmp_path / "droid_h264_g2.metadata.json").exists()
    assert row["cpu_count"] == len(os.sched_getaffinity(0))  # the cores taskset leaves, not the machine's
    with pytest.raises(ValueError, match="embodiment must be one of oxe_droid, oxe_droid_5b, got 'libero_sim'"):
        run_loader_bench(tmp_path, workers=(0,), batches=1, micro_batch=1, episodes=1, embodiment="libero_sim")


def test_the_cli_appends_one_line_per_worker_count(tmp_path, capsys):
    out = tmp_path / "rows.jsonl"
    assert main(["bench", "data", "--trainer-loader", "--workdir", str(tmp_path), "--workers", "0",
                 "--batches", "1", "--micro-batch", "1", "--episodes", "1", "--out", str(out)]) == 0
    assert [json.loads(line)["workers"] for line in out.read_text().splitlines()] == [0]
    assert main(["bench", "data", "--trainer-loader", "--workdir", str(tmp_path), "--workers", "0", "--batches", "1",
                 "--micro-batch", "1", "--episodes", "1", "--embodiment", "oxe_droid_5b", "--out", str(out)]) == 0
    assert json.loads(out.read_text().splitlines()[-1])["images"] == [1, 33, 176, 320, 3]
    assert main(["bench", "data", "--trainer-loader", "--workers", "two"]) != 0
    assert "--workers takes comma-separated integers" in capsys.readouterr().err
    assert main(["bench", "data", "--trainer-loader", "--video-decode", "nvdec", "--decode-threads", "1,x"]) != 0
    assert "--decode-threads takes comma-separated integers, got '1,x'" in capsys.readouterr().err
    assert main(["bench", "data", "--trainer-loader", "--video-decode", "nvdec", "--decode-threads", "0"]) != 0
    assert "--decode-threads must be >= 1" in capsys.readouterr().err
    assert main(["bench", "data", "--workers", "1,two"]) != 0  # the decode bench reads the same flag
    assert "--workers takes comma-separated integers, got '1,two'" in capsys.readouterr().err
