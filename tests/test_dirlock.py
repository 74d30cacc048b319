"""The directory lock: exclusive between open descriptors, released when its holder exits, even by kill -9."""

import subprocess
import sys
import textwrap

import pytest

from dzmodel.dirlock import DirectoryBusy, directory_lock


def test_a_second_holder_is_refused_and_the_lock_comes_back_after_release(tmp_path):
    with directory_lock(tmp_path / "run"):
        with pytest.raises(DirectoryBusy, match="run: another `dz train` is writing"):
            with directory_lock(tmp_path / "run", wait=False, what="another `dz train`"):
                pass
    with directory_lock(tmp_path / "run", wait=False):
        pass
    assert list((tmp_path / "run").iterdir()) == []  # no lock file left behind


def test_a_holder_killed_with_sigkill_releases_it(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from dzmodel.dirlock import directory_lock
        with directory_lock({str(tmp_path)!r}):
            print("held", flush=True)
            time.sleep(600)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(DirectoryBusy):
            with directory_lock(tmp_path, wait=False):
                pass
    finally:
        holder.kill()
        holder.wait()
    with directory_lock(tmp_path, wait=False):
        pass
