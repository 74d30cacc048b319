"""The eval stage: held-out action error, world-model previews and LIBERO success of every converted step."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ..atomic import atomic_write_text
from ..config import Profile, StagePaths
from ..stage_table import STAGE_TABLE
from .common import Log, fresh_dir, print_line, write_csv, write_json

(ACTION_ERROR_PLOT,) = STAGE_TABLE["eval"].plots  # declared in the stage table (dvc.yaml's plots)


def action_error_metrics(action: dict | None) -> dict:
    """The held-out action error's headline numbers (the last step) for metrics/eval.json."""
    if not action or not action.get("measured"):
        return {"action_error_measured": False}
    last = action["last"]
    return {"action_error_measured": True, "action_error": last["trained"], "action_error_ratio": last["ratio"],
            "action_error_step": last["step"], "action_error_mean_predictor": action["mean_predictor"],
            "action_error_untrained": action["untrained"], "action_error_windows": action["windows"]}


def converted_models(paths: StagePaths) -> list[Path]:
    """The converted steps' model directories, oldest first."""
    return sorted(p for p in paths.stage("converted").glob("step_*") if (p / "config.json").is_file())


def eval_solver(e):
    """The flow solver the eval section sets (steps, CFG scale, DiT schedule)."""
    from ..model.sampler import SolverConfig

    return SolverConfig(num_steps=e.solver_steps, cfg_scale=e.cfg_scale, dit_steps=e.dit_steps)


def stage_action_error(prof: Profile, paths: StagePaths, out: Path, log: Log = print_line) -> dict:
    """The held-out action error of every converted step (part of the eval stage); skipped, saying why, when the
    run held no episode out."""
    from ..eval.action_error import describe, evaluate_action_error, plot_action_error
    from ..policy.policy import read_train_config

    e = prof.eval
    converted = converted_models(paths)
    if not converted:
        raise FileNotFoundError(f"{paths.stage('converted')}: no converted model (run the convert stage)")
    if not read_train_config(converted[-1])[0].heldout_episodes:
        reason = "train.heldout_episodes is 0: no held-out episodes to measure the action error on"
        log(f"eval: action error skipped ({reason})")
        return {"measured": False, "reason": reason}
    result = evaluate_action_error(paths.stage("converted"), out, steps=e.steps, stride=e.action_error_stride,
                                   max_windows=e.action_error_windows, device=e.device, seed=e.seed,
                                   solver=eval_solver(e))
    write_csv(paths.plots("eval") / "action_error_vs_step.csv",
               [{"step": r["step"], "action_error": r["trained"], "mean_predictor": result["mean_predictor"],
                 "untrained": result["untrained"]} for r in result["steps"]])
    plot_action_error(result, paths.plots("eval") / ACTION_ERROR_PLOT)
    log("eval: " + describe(result))
    return {"measured": True, **result}


def stage_previews(prof: Profile, paths: StagePaths, out: Path, log: Log = print_line) -> list[dict] | None:
    """World-model previews of every converted step (part of the eval stage); skipped, saying why, when the run
    held no episode out."""
    from ..policy.policy import read_train_config
    from ..eval.previews import describe_errors, write_previews

    e = prof.eval
    converted = converted_models(paths)
    if not converted or not read_train_config(converted[-1])[0].heldout_episodes:
        log("eval: previews skipped (no converted model with held-out episodes)")
        return None
    solver = eval_solver(e)
    done = [write_previews(m, out / m.name, windows=e.previews, stride=e.action_error_stride, device=e.device,
                           solver=solver, seed=e.seed) for m in converted]
    log(f"eval: world-model previews of {len(converted)} steps -> {out}: "
        + ", ".join(f"step {d['step']}: {describe_errors(d) or 'no latent error'}" for d in done))
    return done


def stage_eval(prof: Profile, paths: StagePaths, log: Log = print_line) -> dict:
    e = prof.eval
    out = fresh_dir(paths.stage("eval"))
    metrics_file = paths.metrics("eval")
    plots = paths.plots("eval")
    action = stage_action_error(prof, paths, out / "action_error", log) if e.action_error else None
    previews = stage_previews(prof, paths, out / "previews", log) if e.previews else None
    if action is None or not action["measured"]:
        from ..eval.action_error import plot_action_error

        write_csv(plots / "action_error_vs_step.csv", [])
        plot_action_error(action or {"measured": False, "reason": "eval.action_error is false"},
                          plots / ACTION_ERROR_PLOT)
    if not e.enabled:
        atomic_write_text(out / "DISABLED", "eval.enabled is false (LIBERO rollouts)\n")
        write_json(metrics_file, {"evaluated": False, **action_error_metrics(action)})
        write_csv(plots / "success_vs_step.csv", [])
        log("eval: LIBERO disabled (eval.enabled: false)")
        return {"eval_dir": str(out), "evaluated": False, "rows": [], "best": None, "action_error": action,
                "previews": previews}
    from ..eval.libero_eval import EvalConfig, evaluate_run, plot_success, pooled

    cfg = EvalConfig(**e.rollout())

    def evaluate(config: EvalConfig, where: Path, steps: list[int] | None) -> list[dict]:
        return evaluate_run(paths.stage("converted"), config, where, steps=steps, device=e.device,
                            solver=eval_solver(e), embodiment=prof.metadata.embodiment)

    picked, curve_rows = None, []
    if e.select_episodes:  # pick on init states the reported number never sees
        selection = evaluate(dataclasses.replace(cfg, first_init_state=e.episodes, episodes=e.select_episodes,
                                                 videos=0, perturb=[]), out / "selection", e.steps)
        picked = max((r for r in selection if r["task"] == "all"), key=lambda r: (r["rate"], r["step"] or 0))
        log(f"eval: step {picked['step']} picked on init states {e.episodes}..{e.episodes + e.select_episodes - 1} "
            f"({picked['rate']:.0%})")
        rows = evaluate(cfg, out, [picked["step"]] if picked["step"] is not None else None)
    elif e.checkpoints == "last":
        steps = [int(m.name.removeprefix("step_")) for m in converted_models(paths)]
        if not steps:
            raise FileNotFoundError(f"{paths.stage('converted')}: no converted checkpoint to evaluate")
        if e.curve_episodes and len(steps) > 1:  # the earlier checkpoints, for the curve only
            curve_rows = evaluate(dataclasses.replace(cfg, episodes=e.curve_episodes, videos=0, perturb=[]),
                                  out / "curve", steps[:-1])
        rows = evaluate(cfg, out, steps[-1:])
    else:
        rows = evaluate(cfg, out, e.steps)
    curve = curve_points(curve_rows + rows)
    overall = [r for r in rows if r["task"] == "all"]
    best = max(overall, key=lambda r: (r["rate"], r["step"] or 0)) if overall else None
    if picked is not None:
        final = overall[-1]
        rule = (f"step {picked['step']}, picked on init states {e.episodes}..{e.episodes + e.select_episodes - 1}, "
                f"reported on 0..{e.episodes - 1}")
    elif e.checkpoints == "last":
        final = overall[-1] if overall else None
        rule = f"the last checkpoint (step {final['step'] if final else None}), fixed in advance (none picked)"
    else:
        last = [r["step"] for r in overall][-3:]
        final = pooled(overall, last) if overall else None
        rule = f"the last {len(last)} checkpoints pooled (none picked)"
    write_json(metrics_file, {"evaluated": True, "suite": e.suite, "best_step": best["step"] if best else None,
                               "best_success_rate": best["rate"] if best else None,
                               "last_success_rate": overall[-1]["rate"] if overall else None,
                               "episodes_per_step": overall[-1]["episodes"] if overall else 0,
                               "picked_step": picked["step"] if picked else None,
                               "final_success_rate": final["rate"] if final else None,
                               "final_ci_low": final["ci_low"] if final else None,
                               "final_ci_high": final["ci_high"] if final else None,
                               "final_rule": rule, "curve_episodes": e.curve_episodes, "curve": curve,
                               **action_error_metrics(action)})
    write_csv(plots / "success_vs_step.csv", [{"step": p["step"], "episodes": p["episodes"],
                                               "successes": p["successes"], "success_rate": p["rate"],
                                               "ci_low": p["ci_low"], "ci_high": p["ci_high"]} for p in curve])
    (plots / "success_vs_step.png").unlink(missing_ok=True)
    plot_success(curve_rows + rows, plots / "success_vs_step.png", f"LIBERO-{e.suite}: success vs training step")
    log("eval: " + ", ".join(f"step {p['step']}: {p['rate']:.0%}"
                             + (f" (n={p['episodes']}, curve only)" if curve_rows and p is not curve[-1] else "")
                             for p in curve)
        + (f"; final {final['rate']:.1%} (95 % {final['ci_low']:.0%}-{final['ci_high']:.0%}): {rule}" if final else ""))
    return {"eval_dir": str(out), "evaluated": True, "rows": rows, "curve": curve_rows + rows, "best": best,
            "action_error": action, "previews": previews,
            "plot": str(plots / "success_vs_step.png") if (plots / "success_vs_step.png").is_file() else None}


def curve_points(rows: list[dict]) -> list[dict]:
    """The success curve: each evaluated step's `all` row (step, episodes, successes, rate, 95 % interval)."""
    keys = ("step", "episodes", "successes", "rate", "ci_low", "ci_high")
    return [{k: r.get(k) for k in keys} for r in rows if r["task"] == "all"]

