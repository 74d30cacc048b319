"""The package stage: the chosen converted step as a versioned deployment bundle."""

from __future__ import annotations

import csv
import hashlib
import json
from pathlib import Path

from ..config import Profile, StagePaths
from .common import Log, print_line, stage_output, write_json


def chosen_step(prof: Profile, paths: StagePaths) -> tuple[int, float | None]:
    """The converted step to package (`package.checkpoint`: best = the step picked on the selection init states,
    else the best by eval success, ties to the later step; or the last one) and the success rate the promotion
    gate reads: the eval's final number (picked on other init states, or the last 3 checkpoints pooled)."""
    converted = sorted(int(p.name.split("_")[1]) for p in paths.stage("converted").glob("step_*")
                       if (p / "config.json").is_file())
    if not converted:
        raise FileNotFoundError(f"{paths.stage('converted')}: no converted model (run the convert stage)")
    metrics = paths.metrics("eval")
    summary = json.loads(metrics.read_text()) if metrics.is_file() else {}
    results = paths.stage("eval") / "results.csv"
    rates = {}
    if results.is_file():
        rates = {int(r["step"]): float(r["rate"]) for r in csv.DictReader(results.open()) if r["task"] == "all"}
    final = summary.get("final_success_rate")  # the gate's number: picked on other init states, or pooled
    if prof.package.checkpoint == "best" and summary.get("picked_step") in converted:
        return int(summary["picked_step"]), final
    if prof.package.checkpoint == "best" and summary.get("evaluated") and summary.get("best_step") in converted:
        step = int(summary["best_step"])
        return step, final if final is not None else rates.get(step)
    return converted[-1], final if final is not None else rates.get(converted[-1])


def stage_package(prof: Profile, paths: StagePaths, log: Log = print_line) -> dict:
    from ..serve.package import RobotConfig, build_package

    step, rate = chosen_step(prof, paths)
    model = paths.stage("converted") / f"step_{step:07d}"
    out = paths.stage("package")
    eval_dir = paths.stage("eval")
    has_eval = (eval_dir / "results.csv").is_file()
    weights = weights_sha256(model)
    # empty: the embodiment's robot: block describes the robot (a Franka embodiment refuses that, clearly); the
    # version names that description, so other limits give another version
    described = prof.package.robot or embodiment_robot(model)
    version = package_version(prof.package.version, weights, eval_dir if has_eval else None, described, step)
    with stage_output(out) as tmp:
        robot = RobotConfig.from_dict(prof.package.robot, "package.robot") if prof.package.robot else None
        bundle, tarball = build_package(model, tmp, robot, version, eval_dir if has_eval else None,
                                        prof.package.name)
    bundle, tarball = out / bundle.relative_to(tmp), out / tarball.relative_to(tmp)
    action = packaged_action_error(paths, step)
    write_json(out / "PACKAGE.json", {"step": step, "success_rate": rate, "bundle": bundle.name,
                                       "tarball": tarball.name, "version": version, "weights_sha256": weights,
                                       "action_error": action})
    log(f"package: step {step} -> {tarball}")
    return {"bundle": str(bundle), "tarball": str(tarball), "step": step, "success_rate": rate,
            "model": str(model), "version": version, "weights_sha256": weights, "action_error": action}


def embodiment_robot(model: Path) -> dict:
    """The robot: block of the embodiment a converted model trained on ({} for a Franka without one)."""
    from ..policy.policy import model_embodiment, read_train_config

    emb = model_embodiment(model, read_train_config(model)[0])
    return emb.robot.to_dict() if emb.robot is not None else {}


def package_version(base: str, weights_sha256: str, eval_dir: Path | None, robot: dict, step: int) -> str:
    """`base` with build metadata naming what the bundle holds: the weights' digest, then one over the evaluation
    files it carries, its robot config and step. Other weights or another evaluation of the same weights give
    another version string, so a registered version is the only one with its package version."""
    from ..serve.bundles import file_sha256
    from ..serve.package import EVAL_FILES

    h = hashlib.sha256(json.dumps({"robot": robot, "step": step}, sort_keys=True).encode())
    for name in EVAL_FILES if eval_dir is not None else ():
        if (eval_dir / name).is_file():
            h.update(f"{name}\0{file_sha256(eval_dir / name)}\n".encode())
    return f"{base}+{weights_sha256[:8]}.{h.hexdigest()[:6]}"


def weights_sha256(model: Path) -> str:
    """One sha256 over a converted model's weight files (*.safetensors, by relative path and content)."""
    from ..serve.bundles import file_sha256

    h = hashlib.sha256()
    for path in sorted(model.rglob("*.safetensors")):
        h.update(f"{path.relative_to(model)}\0{file_sha256(path)}\n".encode())
    return h.hexdigest()


def packaged_action_error(paths: StagePaths, step: int) -> dict | None:
    """The held-out action error of one converted step (with the run's references), None if not measured."""
    path = paths.stage("eval") / "action_error" / "action_error.json"
    if not path.is_file():
        return None
    result = json.loads(path.read_text())
    row = next((r for r in result["steps"] if r["step"] == step), None)
    if row is None:
        return None
    return {"step": step, "trained": row["trained"], "ratio": row["ratio"],
            "mean_predictor": result["mean_predictor"], "untrained": result["untrained"]}

