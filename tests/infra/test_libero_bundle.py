"""infra/libero_bundle.py: what a GPU machine's LIBERO bundle keeps. With `--distractor N` the traced files include
the object models that the robustness evaluation's `distractor=N` adds to the task, so that `dz eval libero` with
that setting can build its scenes there (without it they are missing and the evaluation refuses)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _bundle_module():
    spec = importlib.util.spec_from_file_location("libero_bundle", REPO / "infra" / "libero_bundle.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_parse_tasks():
    mod = _bundle_module()
    assert mod.parse_tasks("0-3,7,2") == [0, 1, 2, 3, 7]
    for bad in ("", "3-1", "x", "-1"):
        with pytest.raises(ValueError):
            mod.parse_tasks(bad)


def test_trace_with_distractors_keeps_their_models():
    pytest.importorskip("libero", reason="LIBERO is not installed (make libero)")
    from dzmodel.eval.libero_env import ensure_libero_config, list_tasks
    from dzmodel.eval.libero_perturb import distractor_asset, distractor_kinds

    ensure_libero_config()
    mod = _bundle_module()
    task = list_tasks("goal")[0]
    kinds = distractor_kinds(Path(task.bddl_file).read_text(), 2, (0, "goal", 0))
    wanted = {str(distractor_asset(k)) for k in kinds}

    def found(traced):
        return {w for w in wanted if any(str(p).endswith(w) for p in traced)}

    plain = mod.trace_task("goal", 0)
    assert found(plain) == set(), "the task's own scene should not open the distractors' models"
    with_distractors = mod.trace_task("goal", 0, distractor=2, eval_seed=0)
    assert found(with_distractors) == wanted
    def installed(traced):  # leaves out the trace's own temporary files and /proc
        return {p for p in traced if "site-packages" in p.parts}

    assert installed(plain) <= installed(with_distractors)  # the task's own files stay
    assert len(with_distractors) > len(plain)


def test_negative_distractor_count_is_refused(monkeypatch, capsys):
    mod = _bundle_module()
    monkeypatch.setattr(sys, "argv", ["libero_bundle.py", "--suite", "goal", "--tasks", "0", "--distractor", "-1",
                                      "--out", "/nonexistent/never-written"])
    with pytest.raises(SystemExit) as e:
        mod.main()
    assert "--distractor" in str(e.value)
    assert not Path("/nonexistent/never-written").exists()
