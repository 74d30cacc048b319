"""Files that would break training are found before it starts: a truncated parquet, a git-LFS pointer in place of
an mp4, a video shorter than its episode. `dz data check --deep` names each; training refuses with one error."""

import shutil

import pytest

from dzmodel.data.check import deep_check, file_problems, verify_files
from dzmodel.data.errors import DataError
from dzmodel.data.lerobot_format import open_dataset
from tests.data.lerobot_writers import CAMERAS, write_test_arm_yaml, write_v21


@pytest.fixture()
def dataset(tmp_path):
    return write_v21(tmp_path / "v21", lengths=(12, 11, 13), codec="libx264")


def test_a_clean_dataset_passes_the_deep_check(dataset):
    reader = open_dataset(dataset)
    assert deep_check(reader) == []
    verify_files(reader)


def test_truncated_parquet_lfs_pointer_and_short_video_are_named(dataset, tmp_path):
    from dzmodel.cli import main

    reader = open_dataset(dataset)
    parquet = reader.data_file(0)
    parquet.write_bytes(parquet.read_bytes()[: parquet.stat().st_size // 2])  # a truncated download
    pointer = reader.video_file(1, CAMERAS[0])
    pointer.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:ab12\nsize 12345\n")
    short = reader.video_file(2, CAMERAS[-1])
    shutil.copy(reader.video_file(1, CAMERAS[-1]), short)  # 11 frames where episode 2 needs 13
    problems = file_problems(reader)
    assert any("episode_000000.parquet" in p and "parquet footer" in p for p in problems)
    assert any("git-LFS pointer" in p and "git lfs pull" in p for p in problems)
    deep = deep_check(reader)
    assert any(str(short) in p and "needs 13" in p for p in deep), deep
    with pytest.raises(DataError, match="git-LFS pointer"):
        verify_files(reader)
    assert main(["data", "check", str(dataset)]) == 2
    assert main(["data", "check", str(dataset), "--deep"]) == 2


def test_training_refuses_a_corrupt_file_before_its_first_step(dataset, tmp_path, capsys):
    from dzmodel.cli import main
    from dzmodel.data.dataset import embodiment_metadata
    from dzmodel.data.embodiments import get_embodiment, load_embodiments

    yaml_path = write_test_arm_yaml(tmp_path / "arm.yaml")
    embodiment_metadata(dataset, get_embodiment("test_arm", load_embodiments([yaml_path])), tmp_path / "meta.json")
    reader = open_dataset(dataset)
    reader.video_file(2, CAMERAS[0]).write_text("version https://git-lfs.github.com/spec/v1\noid sha256:cd34\n")
    code = main(["train", "--preset", "tiny", "--dataset", str(dataset), "--embodiment", "test_arm", "--metadata",
                 str(tmp_path / "meta.json"), "--steps", "2", "--out", str(tmp_path / "run"),
                 "--embodiments", str(yaml_path), "--set", "progress=false"])
    err = capsys.readouterr().err
    assert code == 2 and "git-LFS pointer" in err and "episode_000002.mp4" in err
    assert not (tmp_path / "run" / "checkpoints").exists()
