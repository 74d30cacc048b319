"""Runs the pipeline's stages: fetch → metadata → vision → cache → train → convert → eval → package.

`dz stage NAME` (what dvc.yaml runs) and the Prefect tasks call the same `run_stage`, so there is one code
path. Each stage's code is its own module of `dzmodel/stages/` (the table there names it); every stage reads
its section of one params.yaml profile, writes at fixed places (`StagePaths`, the paths dvc.yaml names), and
returns a JSON-able result: its outputs, a few headline numbers and the files that hold its metrics and plots.
Promotion is not a stage here: it acts on the MLflow registry (`tasks/registry.py`); `promotion_decision` is
its pure gate.
"""

from __future__ import annotations

import importlib
import re
import json
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

from .config import Profile, StagePaths, profile_dict
from .outputs import mark, owner
from .stages import STAGE_TABLE, STAGES
from .stages import stage_params as _params_of
from .stages.common import Log, fingerprint, print_line, write_json


class _StageFunctions(Mapping):
    """Each stage's function, imported from the module the stage table names when first used (so that importing
    the runner does not import every stage's code, and no stage's code dependencies include another's)."""

    def __getitem__(self, name: str) -> Callable[..., dict]:
        module, _, function = STAGE_TABLE[name].entry.partition(":")
        return getattr(importlib.import_module(module), function)

    def __iter__(self) -> Iterator[str]:
        return iter(STAGE_TABLE)

    def __len__(self) -> int:
        return len(STAGE_TABLE)


STAGE_FUNCTIONS: Mapping[str, Callable[..., dict]] = _StageFunctions()


def stage_outputs(name: str, paths: StagePaths) -> list[Path]:
    """What a stage writes (the outs dvc.yaml declares for it)."""
    return paths.outputs(name)


def _record(name: str, paths: StagePaths) -> Path:
    return paths.record(name)


# stages whose outputs are rebuilt whole (fetch has its own marker; train's run directory is resumed, never rebuilt)
REBUILT_STAGES = ("metadata", "vision", "cache", "convert", "eval", "package")


def _adopt_earlier_outputs(name: str, paths: StagePaths) -> None:
    """Outputs that this stage wrote before directories carried the ownership marker: its record says so."""
    if name not in REBUILT_STAGES or not _record(name, paths).is_file():
        return
    for out in stage_outputs(name, paths):
        if out.is_dir() and owner(out) is None:
            mark(out, "pipeline")


def run_stage(name: str, prof: Profile, paths: StagePaths, log: Log = print_line, **kwargs) -> dict:
    """Run one stage; record its result, with its outputs' fingerprint, in runs/<profile>/stages/<name>.json."""
    if name not in STAGE_FUNCTIONS:
        raise ValueError(f"unknown stage {name!r}; stages: {', '.join(STAGES)}")
    started = time.time()
    _adopt_earlier_outputs(name, paths)
    _record(name, paths).unlink(missing_ok=True)  # no record while its outputs are being rewritten
    result = STAGE_FUNCTIONS[name](prof, paths, log=log, **kwargs)
    result["stage"] = name
    result["seconds"] = round(time.time() - started, 2)
    result["outputs_fingerprint"] = fingerprint(*stage_outputs(name, paths))
    write_json(_record(name, paths), result)
    return result


# what holds a profile's folder while it shares it with DVC (the flow), as `dz stage` reports it when refused
WORKSPACE_WRITER = "a pipeline run (dz pipeline run) that shares this profile's DVC workspace"


def current_fingerprint(name: str, paths: StagePaths) -> str:
    """The fingerprint of the stage's outputs as they are now."""
    return fingerprint(*stage_outputs(name, paths))


def outputs_intact(name: str, paths: StagePaths) -> bool:
    """The stage's outputs are there and unchanged since its last recorded run (else a cached result lies)."""
    record = _record(name, paths)
    if not record.is_file() or not all(p.exists() for p in stage_outputs(name, paths)):
        return False
    try:
        recorded = json.loads(record.read_text()).get("outputs_fingerprint")
    except json.JSONDecodeError:
        return False
    return recorded == current_fingerprint(name, paths)


def stage_params(prof: Profile, name: str) -> dict:
    """The params a stage reads (dzmodel/stages/), for its cache key."""
    return _params_of(profile_dict(prof), name)


def promotion_decision(success_rate: float | None, min_success: float | None,
                       action_error_ratio: float | None = None,
                       max_action_error_ratio: float | None = None) -> tuple[bool, str]:
    """Whether a packaged step may take the deployment alias, and why (recorded with the decision).

    Each gate that is set must pass: LIBERO success >= min_success, and the held-out action error over the mean
    predictor's <= max_action_error_ratio. A gate set on a measure the step lacks refuses; no gate set refuses."""
    if min_success is None and max_action_error_ratio is None:
        return False, "refused: no gate is set (min_success and max_action_error_ratio are both unset)"
    passed, refused = [], []
    if max_action_error_ratio is not None:
        if action_error_ratio is None:
            refused.append("the packaged step has no held-out action error (train.heldout_episodes 0, or eval "
                           "not run)")
        elif action_error_ratio <= max_action_error_ratio:
            passed.append(f"held-out action error ratio {action_error_ratio:.2f} (vs the mean predictor) <= gate "
                          f"{max_action_error_ratio:.2f}")
        else:
            refused.append(f"held-out action error ratio {action_error_ratio:.2f} (vs the mean predictor) > gate "
                           f"{max_action_error_ratio:.2f}")
    if min_success is not None:
        if success_rate is None:
            refused.append("the packaged step has no LIBERO evaluation (eval disabled or not run)")
        elif success_rate >= min_success:
            passed.append(f"LIBERO success {success_rate:.1%} >= gate {min_success:.1%}")
        else:
            refused.append(f"LIBERO success {success_rate:.1%} < gate {min_success:.1%}")
    if refused:
        return False, "refused: " + "; ".join(refused)
    return True, "passed: " + "; ".join(passed)


def head_to_head_decision(comparison: dict | None, max_regression: float | None) -> tuple[bool, str]:
    """The candidate against the model that holds the alias, on the same held-out windows
    (`eval.action_error.compare_action_error`): it may not be worse by more than `max_regression` (a fraction of
    the current model's error). Without a comparison (`{"compared": False, "reason": ...}`, or None) it passes,
    saying why, and the absolute gate alone decides."""
    if max_regression is None:
        return True, "not compared with the current model (promote.max_regression is null)"
    if not comparison or not comparison.get("compared"):
        why = (comparison or {}).get("reason", "no current model")
        return True, f"not compared with the current model ({why})"
    cand, cur, version = comparison["candidate"], comparison["current"], comparison["current_version"]
    limit = cur * (1 + max_regression)
    text = (f"held-out action error {cand:.4g} vs {cur:.4g} for the current v{version}, on the same "
            f"{comparison['windows']} windows")
    if cand <= limit:
        return True, f"{text} (<= {limit:.4g}, {max_regression:.0%} over it)"
    return False, f"{text}: worse by more than {max_regression:.0%}"


def dvc_missing_stages(text: str) -> list[str]:
    """The table's stages that dvc.yaml's `text` has no entry for, in table order."""
    present = set(re.findall(r"^  ([A-Za-z_]+):", text, flags=re.M))
    return [name for name in STAGE_TABLE if name not in present]


def dvc_stage_entry(name: str) -> str:
    """dvc.yaml's entry for a table stage that has none yet: its command, deps, params and outputs, as the stage
    table declares them (its metrics and plots follow, `dvc_yaml_with_computed_deps`; options such as `persist` are
    added by hand where wanted)."""
    from .stages import dvc_deps, dvc_params

    as_dvc = StagePaths(Path("."), "${profile}")
    deps = dvc_deps(name, lambda up: [str(p) for p in stage_outputs(up, as_dvc)])
    lines = [f"  {name}:", f"    cmd: dz stage {name}", "    deps:", *(f"      - {d}" for d in deps)]
    if STAGE_TABLE[name].params:
        lines += ["    params:", *(f"      - {p}" for p in dvc_params(name))]
    lines += ["    outs:", *(f"      - {o}" for o in stage_outputs(name, as_dvc))]
    return "\n".join(lines) + "\n\n"


def dvc_yaml_with_computed_deps(text: str) -> str:
    """dvc.yaml's text with each stage's `deps:` list replaced by the stage table's (upstream outputs, other files
    read, then the computed code files), its `metrics:` and `plots:` lists by the table's (`_with_metrics_and_plots`),
    and an entry (`dvc_stage_entry`) added, before the track stage, for each table stage it lacks; everything else,
    comments included, is kept."""
    from .stages import TRACK_STAGE, dvc_deps, dvc_track_deps

    as_dvc = StagePaths(Path("."), "${profile}")
    missing = dvc_missing_stages(text)
    lines = text.splitlines(keepends=True)
    out: list[str] = []
    stage = None
    i = 0
    while i < len(lines):
        line = lines[i]
        header = re.match(r"^  ([A-Za-z_]+):", line)
        if header:
            stage = header[1]
            if stage == TRACK_STAGE and missing:
                while out and out[-1].lstrip().startswith("#"):  # the track stage's comment stays with it
                    i -= 1
                    out.pop()
                out.extend(dvc_stage_entry(name) for name in missing)
                missing = []
                line = lines[i]
        out.append(line)
        i += 1
        if line.rstrip() == "    deps:" and (stage in STAGE_TABLE or stage == TRACK_STAGE):
            while i < len(lines) and lines[i].startswith("      - "):
                i += 1  # the old list
            outputs = lambda up: [str(p) for p in stage_outputs(up, as_dvc)]  # noqa: E731
            deps = (dvc_deps(stage, outputs) if stage in STAGE_TABLE
                    else dvc_track_deps(outputs, lambda s: str(as_dvc.record(s))))
            out.extend(f"      - {d}\n" for d in deps)
    return _with_metrics_and_plots("".join(out))


def _with_metrics_and_plots(text: str) -> str:
    """Each table stage's `metrics:` (committed to git: `cache: false`) and `plots:` (images, DVC-cached) lists as
    the table declares them: rewritten where present, added at the end of its entry where missing, dropped where it
    declares none."""
    from .stages import dvc_metrics, dvc_plots

    as_dvc = StagePaths(Path("."), "${profile}")
    declared = {"metrics": dvc_metrics, "plots": dvc_plots}
    items = {"metrics": lambda p: f"      - {p}:\n          cache: false\n", "plots": lambda p: f"      - {p}\n"}
    lines = text.splitlines(keepends=True)
    out: list[str] = []
    stage, seen = None, set()

    def close() -> None:  # the end of a stage's entry: the blocks it declares but lacks
        if stage not in STAGE_TABLE:
            return
        blocks = [f"    {kind}:\n" + "".join(items[kind](p) for p in paths) for kind, make in declared.items()
                  if kind not in seen and (paths := make(stage, as_dvc))]
        at = len(out)
        while at and not out[at - 1].strip():
            at -= 1
        out[at:at] = blocks

    i = 0
    while i < len(lines):
        line = lines[i]
        header = re.match(r"^  ([A-Za-z_]+):", line)
        if header or re.match(r"^\S", line):  # a stage's entry, or a top-level key, begins
            close()
            stage, seen = (header[1] if header else None), set()
        block = re.match(r"^    (metrics|plots):", line)
        if block and stage in STAGE_TABLE:
            seen.add(block[1])
            i += 1
            while i < len(lines) and lines[i].startswith(("      - ", "          ")):
                i += 1  # the old list
            paths = declared[block[1]](stage, as_dvc)
            if paths:
                out.append(line)
                out.extend(items[block[1]](p) for p in paths)
            continue
        out.append(line)
        i += 1
    close()
    return "".join(out)
