"""`dz eval ...` (LIBERO success, the oracle, action error, previews, probes) and `dz data record libero`."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..clitools import EXIT_FAIL, EXIT_OK, CLIError, claim_out, example, int_list
from ..model.cli import add_solver_arguments, solver_from
from .record_params import add_record_arguments
from .rollout import add_rollout_arguments


def cmd_eval_libero(ns: argparse.Namespace) -> int:
    from ..eval.libero_env import LiberoNotInstalled
    from ..eval.libero_eval import EnvStartError, EvalConfig, evaluate_run
    from ..eval.perturb_spec import PerturbationError, parse_perturbations
    from ..policy.policy import PolicyLoadError

    try:
        parse_perturbations(ns.perturb or [], "--perturb")
    except PerturbationError as exc:
        raise CLIError(str(exc)) from None
    claim_out(ns, "eval libero")
    try:
        cfg = EvalConfig(**rollout_options(ns), batch_policy=not ns.no_batch_policy,
                         first_init_state=ns.first_init_state)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    try:
        rows = evaluate_run(ns.source, cfg, ns.out, steps=int_list(ns.steps, "--steps"), device=ns.device,
                            solver=solver_from(ns), progress=not ns.no_progress, embodiment=ns.embodiment,
                            compile=ns.compile, weights=ns.weights)
    except (LiberoNotInstalled, PolicyLoadError, PerturbationError, EnvStartError) as exc:
        raise CLIError(str(exc)) from None
    print(f"{'step':>8} {'task':>5} {'episodes':>8} {'successes':>9} {'rate':>6}   95 % interval")
    for r in rows:
        print(f"{str(r['step']):>8} {str(r['task']):>5} {r['episodes']:>8} {r['successes']:>9} {r['rate']:>6.1%}   "
              f"{r['ci_low']:.1%}-{r['ci_high']:.1%}")
    if cfg.perturb:
        _print_robustness(Path(ns.out))
    print(f"results in {ns.out}: results.csv, episodes.csv, summary.json, success_vs_step.png, videos/"
          + (", robustness.csv" if cfg.perturb else ""))
    return EXIT_OK


def _print_robustness(out: Path) -> None:
    """The perturbation x success table (all tasks) of robustness.csv."""
    import csv

    rows = [r for r in csv.DictReader((out / "robustness.csv").open()) if r["task"] == "all"]
    print(f"\n{'step':>8} {'perturbation':<20} {'episodes':>8} {'successes':>9} {'rate':>6}   95 % interval")
    for r in rows:
        print(f"{r['step']:>8} {r['perturbation']:<20} {r['episodes']:>8} {r['successes']:>9} "
              f"{float(r['rate']):>6.1%}   {float(r['ci_low']):.1%}-{float(r['ci_high']):.1%}")


def cmd_eval_action_error(ns: argparse.Namespace) -> int:
    from ..eval.action_error import ActionErrorError, describe, evaluate_action_error
    from ..policy.policy import PolicyLoadError

    claim_out(ns, "eval action-error")
    try:
        result = evaluate_action_error(ns.source, ns.out, steps=int_list(ns.steps, "--steps"), stride=ns.stride,
                                       max_windows=ns.max_windows, device=ns.device, seed=ns.seed,
                                       solver=solver_from(ns),
                                       untrained=not ns.no_untrained, progress=not ns.no_progress)
    except (ActionErrorError, PolicyLoadError) as exc:
        raise CLIError(str(exc)) from None
    print(f"{'step':>8} {'trained':>9} {'ratio':>7}   ({result['windows']} held-out windows of episodes "
          f"{result['episodes']}; mean predictor {result['mean_predictor']:.4g}, untrained "
          f"{'-' if result['untrained'] is None else format(result['untrained'], '.4g')})")
    for r in result["steps"]:
        print(f"{str(r['step']):>8} {r['trained']:>9.4g} {r['ratio']:>7.3f}")
    print(describe(result))
    print(f"results in {ns.out}: action_error.json, action_error.csv")
    return EXIT_OK


def cmd_eval_previews(ns: argparse.Namespace) -> int:
    from ..eval.action_error import ActionErrorError
    from ..policy.policy import PolicyLoadError
    from ..eval.previews import describe_errors, write_previews

    claim_out(ns, "eval previews")
    if ns.windows < 1:
        raise CLIError(f"--windows must be >= 1, got {ns.windows}")
    try:
        result = write_previews(ns.model, ns.out, windows=ns.windows, stride=ns.stride, device=ns.device,
                                solver=solver_from(ns), seed=ns.seed)
    except (ActionErrorError, PolicyLoadError) as exc:
        raise CLIError(str(exc)) from None
    kind = "training (the run held no episode out)" if result["seen_in_training"] else "held-out"
    print(f"step {result['step']}: {result['windows']} {kind} windows -> {ns.out}: "
          + ", ".join(Path(v).name for v in result["videos"]) + ", grid.png, previews.json; "
          + (describe_errors(result) or "no latent error (every window's episode ends within the predicted block)"))
    return EXIT_OK


def cmd_eval_probe(ns: argparse.Namespace) -> int:
    from ..data.embodiments import get_embodiment, load_embodiments
    from ..eval.probe import describe, parse_target, run_probe

    claim_out(ns, "eval probe")
    try:
        targets = [parse_target(t) for t in ns.target] if ns.target else None
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    emb = get_embodiment(ns.embodiment, load_embodiments(ns.embodiments or []))
    result = run_probe(ns.dataset, emb, ns.vae or ["random"], ns.out, preset_name=ns.preset, seed=ns.seed,
                       targets=targets, heldout_episodes=ns.heldout_episodes, stride=ns.stride, device=ns.device,
                       progress=not ns.no_progress)
    print("\n".join(describe(result)))
    print(f"fit on episodes {result['fit_episodes']}, scored on {result['heldout_episodes']} -> {ns.out}/probe.json")
    return EXIT_OK


def cmd_eval_oracle(ns: argparse.Namespace) -> int:
    from ..eval.libero_env import LiberoNotInstalled
    from ..eval.oracle import run_oracle

    claim_out(ns, "eval oracle")
    try:
        summary = run_oracle(ns.dataset, ns.out, metadata=ns.metadata, embodiment=ns.embodiment,
                             max_episodes=ns.max_episodes, workers=ns.workers, camera_size=ns.camera_size,
                             videos=ns.videos, progress=not ns.no_progress)
    except LiberoNotInstalled as exc:
        raise CLIError(str(exc)) from None
    return EXIT_OK if summary["passed"] else EXIT_FAIL



def cmd_data_record_libero(ns: argparse.Namespace) -> int:
    from ..eval.libero_env import LiberoNotInstalled
    from ..eval.libero_record import RecordConfig, record_libero

    cfg = RecordConfig(**record_options(ns), dagger=ns.dagger, dagger_beta=ns.dagger_beta, dagger_device=ns.device,
                       dagger_solver_steps=ns.solver_steps, dagger_cfg_scale=ns.cfg_scale,
                       actions_per_chunk=ns.actions_per_chunk, keep=ns.keep, seed=ns.seed)
    try:
        record_libero(cfg, ns.out, overwrite=ns.overwrite, progress=not ns.no_progress)
    except LiberoNotInstalled as exc:
        raise CLIError(str(exc)) from None
    return EXIT_OK


def record_options(ns: argparse.Namespace) -> dict:
    """The RecordParams fields from `dz data record libero`'s options (`add_record_arguments`)."""
    import dataclasses

    from ..eval.record_params import RecordParams

    out = {f.name: getattr(ns, f.name) for f in dataclasses.fields(RecordParams)}
    out.update(tasks=int_list(ns.tasks, "--tasks"))
    return out


def add_commands(sub) -> None:
    """`dz eval ...`."""
    ev = sub.add_parser("eval", help="evaluation").add_subparsers(dest="cmd", required=True)
    for add in (_add_libero, _add_action_error, _add_previews, _add_probe, _add_oracle):
        add(ev)


def _add_libero(ev) -> None:
    p = ev.add_parser("libero", help="LIBERO success rate of a converted model, or of a run across its checkpoint steps",
                      epilog=example("dz eval libero runs/x --suite spatial --tasks 0,1 --episodes 2 --max-steps 220 "
                                     "--out runs/x/eval",
                                     "dz eval libero runs/x/hf --suite object --perturb camera=10 --out runs/x/robust"))
    p.add_argument("source", help="a training run directory (every saved step, converted as needed) or a converted model")
    p.add_argument("--out", required=True, help="results.csv, episodes.csv, summary.json, success_vs_step.png, videos/")
    p.add_argument("--overwrite", action="store_true", help="write into an --out directory that dz did not write")
    add_rollout_arguments(p)  # --suite, --tasks, --episodes, ... as the eval stage's `eval:` section names them
    p.add_argument("--first-init-state", type=int, default=0,
                   help="start at this standard init state (e.g. past the ones that picked the checkpoint)")
    p.add_argument("--steps", help="with a run directory: checkpoint steps to evaluate, e.g. 1000,2000 (default: all)")
    p.add_argument("--embodiment", help="refuse a checkpoint trained for another embodiment")
    p.add_argument("--weights", choices=("raw", "ema"), default="raw",
                   help="with a run directory: convert its checkpoints' raw weights or the EMA (train.ema_decay)")
    p.add_argument("--compile", action="store_true", help="torch.compile the DiT block (GPU; compiles per batch shape)")
    p.add_argument("--no-batch-policy", action="store_true",
                   help="query the policy once per episode instead of one batched forward per step (for comparison)")
    add_solver_arguments(p)
    p.add_argument("--device", default="cpu", help="where the policy runs: cpu or cuda")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_eval_libero)


def rollout_options(ns: argparse.Namespace) -> dict:
    """The RolloutParams fields from `dz eval libero`'s options (`add_rollout_arguments`)."""
    import dataclasses

    from ..eval.rollout import RolloutParams

    out = {f.name: getattr(ns, f.name) for f in dataclasses.fields(RolloutParams)}
    out.update(tasks=int_list(ns.tasks, "--tasks"), perturb=list(ns.perturb or []))
    return out


def _add_action_error(ev) -> None:
    p = ev.add_parser("action-error", help="held-out action error of a converted model or of a run's steps, vs the "
                      "mean predictor and the untrained model",
                      epilog=example("dz eval action-error runs/x --out runs/x/action_error",
                                     "dz eval action-error runs/x/hf --max-windows 32 --out runs/x/action_error_hf"))
    p.add_argument("source", help="a converted model, a `dz stage convert` directory, or a training run")
    p.add_argument("--out", required=True, help="action_error.json, action_error.csv")
    p.add_argument("--overwrite", action="store_true", help="write into an --out directory that dz did not write")
    p.add_argument("--steps", help="with a run directory: checkpoint steps to evaluate, e.g. 1000,2000 (default: all)")
    p.add_argument("--stride", type=int, default=4, help="frames between held-out window anchors")
    p.add_argument("--max-windows", type=int, help="at most this many windows (evenly spaced)")
    add_solver_arguments(p)
    p.add_argument("--device", default="cpu", help="where the policy runs: cpu or cuda")
    p.add_argument("--seed", type=int, default=0, help="random seed of the policy's sampling noise")
    p.add_argument("--no-untrained", action="store_true", help="skip the untrained reference")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_eval_action_error)


def _add_previews(ev) -> None:
    p = ev.add_parser("previews", help="a converted model's predicted video of held-out windows, decoded, beside the "
                      "real frames (mp4s and a PNG grid)",
                      epilog=example("dz eval previews runs/x/hf --windows 4 --out runs/x/previews"))
    p.add_argument("model", help="a converted model directory (held-out windows; a run that held none out shows "
                   "training windows)")
    p.add_argument("--out", required=True, help="ep<E>_t<T>.mp4 per window and grid.png")
    p.add_argument("--overwrite", action="store_true", help="write into an --out directory that dz did not write")
    p.add_argument("--windows", type=int, default=2, help="held-out windows to predict and show")
    p.add_argument("--stride", type=int, default=4, help="frames between held-out window anchors")
    add_solver_arguments(p)
    p.add_argument("--device", default="cpu", help="where the model runs: cpu or cuda")
    p.add_argument("--seed", type=int, default=0, help="random seed of the policy's sampling noise")
    p.set_defaults(func=cmd_eval_previews)


def _add_probe(ev) -> None:
    p = ev.add_parser("probe", help="linear probes from VAE latents to the scene state (eef position, objects) on "
                      "held-out episodes: a random VAE vs a pretrained one",
                      epilog=example("dz eval probe data/demo/dataset --embodiment libero_sim_tiny --preset tiny "
                                     "--vae random --vae runs/demo/vision/vae.safetensors --out runs/demo/probe"))
    p.add_argument("dataset", help="a LeRobot dataset (the frames and the state to predict)")
    p.add_argument("--embodiment", required=True, help="views and layout the frames are seen through")
    p.add_argument("--embodiments", action="append", help="extra embodiment YAML file(s)")
    p.add_argument("--vae", action="append", help="repeatable: 'random' (the preset's seeded random VAE), a VAE "
                   ".safetensors (e.g. runs/<profile>/vision/vae.safetensors), or a converted model / bundle model "
                   "directory (the VAE it runs with); default: random")
    p.add_argument("--preset", help="the VAE's preset (tiny, small); read from a vision-stage file when absent")
    p.add_argument("--seed", type=int, default=0, help="with --vae random: the run's train.seed")
    p.add_argument("--target", action="append", metavar="NAME=COLUMN[A:B]",
                   help="what to predict (repeatable); default: LIBERO eef position and gripper (or each state key), "
                        "and observation.objects when the dataset has it")
    p.add_argument("--heldout-episodes", type=int, help="score on the last N episodes (default: a fifth, at least 1)")
    p.add_argument("--stride", type=int, default=2, help="every stride-th frame")
    p.add_argument("--device", default="cpu", help="where the VAE runs: cpu or cuda")
    p.add_argument("--out", required=True, help="probe.json and probe.txt")
    p.add_argument("--overwrite", action="store_true", help="write into an --out directory that dz did not write")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_eval_probe)


def _add_oracle(ev) -> None:
    p = ev.add_parser("oracle", help="replay recorded demonstrations through the evaluation path (exit 1 below 95%%)",
                      epilog=example("dz eval oracle data/libero_object/dataset --max-episodes 10 --out build/oracle"))
    p.add_argument("dataset", help="a dataset recorded by `dz data record libero`")
    p.add_argument("--out", required=True, help="summary.json (oracle_success_rate), results.csv, episodes.csv")
    p.add_argument("--overwrite", action="store_true", help="write into an --out directory that dz did not write")
    p.add_argument("--metadata", help="the run's metadata.json (q99 statistics); default: computed from the dataset")
    p.add_argument("--embodiment", default="libero_sim", help="libero_sim | libero_sim_5b (the 5B's 160x320 frame) | libero_sim_tiny")
    p.add_argument("--max-episodes", type=int, help="replay N recorded episodes, evenly spread over the recording")
    p.add_argument("--workers", type=int, default=2, help="env worker processes (0: one per CPU core)")
    p.add_argument("--camera-size", type=int, help="default: the recorded image size")
    p.add_argument("--videos", type=int, default=0, help="write this many replays as mp4")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_eval_oracle)


def add_data_commands(data) -> None:
    """`dz data record libero` (in the data group; it needs LIBERO)."""

    rec = data.add_parser("record", help="record demonstrations in simulation").add_subparsers(dest="sim", required=True)
    p = rec.add_parser("libero", help="LIBERO demonstrations from the scripted expert -> a LeRobot v3.0 dataset",
                       epilog=example("dz data record libero --suite object --tasks 0 --episodes 1 --image-size 64 "
                                      "--out build/libero_demo",
                                      "dz data record libero --suite object --tasks 0,1,2,3 --episodes 30 "
                                      "--init perturbed --max-shift-m 0.03 --dart-noise 0.1 --codec libx264 "
                                      "--out data/libero_object_demos"))
    add_record_arguments(p)  # --suite, --tasks, --episodes, ... as the fetch stage's `fetch.record:` section names them
    p.add_argument("--dagger", metavar="MODEL_DIR", help="DAgger: a converted model whose policy acts (per chunk, "
                   "with probability 1 - beta); every row is labelled with the expert's action at that state")
    p.add_argument("--dagger-beta", type=float, default=0.5, help="DAgger: probability that the expert acts a chunk")
    p.add_argument("--actions-per-chunk", type=int, help="DAgger: steps per chunk (default: the policy's horizon)")
    p.add_argument("--device", default="cpu", help="DAgger: where the policy runs")
    p.add_argument("--solver-steps", type=int, default=16, help="DAgger: Euler steps of the policy's flow solver")
    p.add_argument("--cfg-scale", type=float, default=5.0, help="DAgger: classifier-free guidance (1 = off)")
    p.add_argument("--keep", choices=["successes", "all"], help="which episodes to write (default: successes; all "
                   "with --dagger)")
    p.add_argument("--seed", type=int, default=0, help="random seed: the same seed writes the same episodes")
    p.add_argument("--out", required=True, help="the dataset directory (written atomically)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_data_record_libero)
