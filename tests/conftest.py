"""Shared test fixtures: where the reference fixtures live."""

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


def pytest_configure(config):
    # bundle tarballs extract into a per-run cache, not the user's ~/.cache (subprocess servers inherit it)
    import tempfile

    if "DZ_BUNDLE_CACHE" not in os.environ:
        config._dz_bundle_cache = os.environ["DZ_BUNDLE_CACHE"] = tempfile.mkdtemp(prefix="dz-bundle-cache-")
    from tests.leftovers import mark_session

    mark_session()


@pytest.hookimpl(trylast=True)  # after the session's fixtures are torn down (their servers stopped)
def pytest_sessionfinish(session, exitstatus):
    from tests.leftovers import MARK, end_leftovers

    found = end_leftovers(os.environ[MARK])
    cache = getattr(session.config, "_dz_bundle_cache", None)
    if cache:  # the per-run cache this process made (not one the caller named)
        import shutil

        shutil.rmtree(cache, ignore_errors=True)
    if found:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        lines = [f"processes started by the tests were still running at the end (killed now): {len(found)}"]
        lines += [f"  {pid}: {cmd[:300]}" for pid, cmd in sorted(found.items())]
        if reporter is not None:
            reporter.write_line("\n".join(lines), red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


FIXTURES_DIR = REPO_ROOT / "tests" / "fixtures"  # the reference fixtures the parity tests read (tests/fixtures/README.md)


def extra_fixture_files() -> list[Path]:
    """Reference fixtures of the same format from `$DZ_SHARED_DIR/fixtures`, when that variable is set: never needed,
    but each one found is reproduced too (other dims, other seeds). A set variable naming no such folder fails the
    tests that read it instead of being ignored."""
    root = os.environ.get("DZ_SHARED_DIR")
    if not root:
        return []
    path = Path(root) / "fixtures"
    if not path.is_dir():
        raise FileNotFoundError(f"DZ_SHARED_DIR={root}: no fixtures/ folder there (unset DZ_SHARED_DIR to use only "
                                f"the fixtures in {FIXTURES_DIR})")
    return sorted(path.glob("*.safetensors"))


def all_fixture_files() -> list[Path]:
    """The project's fixtures, then any extra ones whose content differs from all of them."""
    import hashlib

    files = sorted(FIXTURES_DIR.glob("*.safetensors"))
    seen = {hashlib.sha256(f.read_bytes()).hexdigest() for f in files}
    for f in extra_fixture_files():
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        if digest not in seen:
            seen.add(digest)
            files.append(f)
    return files


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    """The folder of the project's own reference fixtures (committed with the tests)."""
    if not FIXTURES_DIR.is_dir():
        pytest.fail(f"the reference fixtures are part of the checkout, but {FIXTURES_DIR} is missing")
    return FIXTURES_DIR


@pytest.fixture(scope="module")
def one_torch_thread():
    """One compute thread for a module: small convolutions (the tiny VAE's) run several times faster than on two
    shared cores."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def demo_repro(tmp_path_factory):
    """`dvc repro` of the demo, as params.yaml has it, on a fresh clone of the project: (clone, dvc's log). Shared by
    the DVC tests (tests/test_dvc.py, which go on to change it) and the demo's learnability tests, which read its
    trained and converted model (tests/eval/test_action_error_learnability.py): the demo trains once."""
    from tests.demo_clone import clone, run

    dest = clone(tmp_path_factory.mktemp("clone") / "project")
    return dest, run(["dvc", "repro"], dest)
