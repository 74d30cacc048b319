"""`dz package` and figure writes in a folder where someone planted links at the temporary names, or where
several runs build the same version at once: a user's file is never written through a link, and a published
version is complete (and verifies) or absent."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

import dzmodel.serve.package as package
from dzmodel.outputs import claim_dir
from dzmodel.serve.package import PackageError, RobotConfig, build_package, load_package, verify_package
from tests.serve.test_package import ROBOT, model  # noqa: F401  (the tiny converted model fixture)

NAME = "dreamzero-tabletop_pusher"
THESIS = b"Chapter 1. " * 4000


def user_files(tmp_path: Path) -> tuple[Path, Path]:
    """A user's file and a user's folder holding a config.json, outside the releases folder."""
    thesis = tmp_path / "home" / "thesis.txt"
    project = tmp_path / "home" / "project"
    project.mkdir(parents=True)
    thesis.write_bytes(THESIS)
    (project / "config.json").write_text('{"mine": true}\n')
    return thesis, project


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_links_planted_at_the_temporary_names_are_never_written_through(model, tmp_path):  # noqa: F811
    _, hf = model
    out = tmp_path / "releases"
    build_package(hf, out, RobotConfig.from_dict(ROBOT), "1.0.0")  # a releases folder of dz's own
    thesis, project = user_files(tmp_path)
    before = snapshot(thesis.parent)
    version = f"{NAME}-1.0.1"
    for planted, target in ((f".{version}.tmp", project), (f".{version}.tar.gz.tmp", thesis),
                            (f"{version}.tmp", project), (f"{version}.tar.gz.tmp", thesis)):
        (out / planted).symlink_to(target)
    bundle, tarball = build_package(hf, out, RobotConfig.from_dict(ROBOT), "1.0.1")
    assert snapshot(thesis.parent) == before
    assert not bundle.is_symlink() and not tarball.is_symlink()
    assert verify_package(bundle) > 5
    assert load_package(tarball, tmp_path / "cache").root.name == version
    assert oct(bundle.stat().st_mode & 0o777) == oct(0o777 & ~current_umask())


def current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_a_file_appearing_at_the_versions_name_while_building_is_never_replaced(model, tmp_path,
                                                                                monkeypatch):  # noqa: F811
    _, hf = model
    out = tmp_path / "releases"
    build_package(hf, out, RobotConfig.from_dict(ROBOT), "1.0.0")
    tarball = out / f"{NAME}-1.0.1.tar.gz"
    lines = package._manifest_lines

    def then_a_file_appears(root):
        tarball.write_bytes(THESIS)  # someone else's file, created while this build runs
        return lines(root)

    monkeypatch.setattr(package, "_manifest_lines", then_a_file_appears)
    with pytest.raises(PackageError, match=rf"{NAME}-1\.0\.1.*already exists") as err:
        build_package(hf, out, RobotConfig.from_dict(ROBOT), "1.0.1")
    assert "\n" not in str(err.value)
    assert tarball.read_bytes() == THESIS
    assert not (out / f"{NAME}-1.0.1").exists()
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".dreamzero")) == []  # no temporaries left


def test_concurrent_builds_of_one_version_publish_it_complete_or_fail_in_one_line(model, tmp_path):  # noqa: F811
    _, hf = model
    for trial in range(4):
        out = tmp_path / f"releases{trial}"
        if trial % 2:  # a releases folder dz already writes to; else a new one, claimed by the runs themselves
            claim_dir(out, "package")
        start = threading.Barrier(3)
        results: list = [None] * 3

        def build(i):
            start.wait()
            try:
                results[i] = build_package(hf, out, RobotConfig.from_dict(ROBOT), "2.0.0")
            except Exception as exc:  # noqa: BLE001  (what each run ends with is the subject of the test)
                results[i] = exc

        threads = [threading.Thread(target=build, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        built = [r for r in results if isinstance(r, tuple)]
        failed = [r for r in results if not isinstance(r, tuple)]
        assert len(built) == 1, f"trial {trial}: {results}"
        for exc in failed:
            assert isinstance(exc, PackageError), f"trial {trial}: {exc!r}"
            assert f"{NAME}-2.0.0" in str(exc) and "\n" not in str(exc)
        bundle, tarball = built[0]
        assert verify_package(bundle) > 5
        assert load_package(tarball, tmp_path / f"cache{trial}").files == verify_package(bundle)
        assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".dz")) == \
            [f"{NAME}-2.0.0", f"{NAME}-2.0.0.tar.gz"]


def test_save_figure_never_writes_through_a_planted_link(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dzmodel.atomic import save_figure

    thesis, _ = user_files(tmp_path)
    out = tmp_path / "plots"
    out.mkdir()
    (out / ".losses.png.tmp.png").symlink_to(thesis)
    (out / "losses.png.tmp").symlink_to(thesis)
    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    path = save_figure(fig, out / "losses.png")
    plt.close(fig)
    assert thesis.read_bytes() == THESIS
    assert not path.is_symlink() and path.read_bytes().startswith(b"\x89PNG")
    assert sorted(p.name for p in out.iterdir()) == [".losses.png.tmp.png", "losses.png", "losses.png.tmp"]


def test_the_success_plot_never_writes_through_a_planted_link(tmp_path):
    from dzmodel.eval.libero_eval import plot_success

    thesis, _ = user_files(tmp_path)
    (tmp_path / ".success.png.tmp.png").symlink_to(thesis)
    rows = [{"step": s, "task": "all", "episodes": 10, "successes": n, "rate": n / 10} for s, n in ((1, 2), (2, 5))]
    path = plot_success(rows, tmp_path / "success.png", "t")
    assert thesis.read_bytes() == THESIS
    assert path.read_bytes().startswith(b"\x89PNG")
