"""The `dz` command line: one code path for people, Prefect tasks and dvc.yaml.

    dz model parity FIXTURE [FIXTURE ...]   reproduce reference fixtures (exit 1 above tolerance)
    dz model info [--preset NAME]           parameter counts of the presets
    dz model manifest                       check our modules against the WAN checkpoint manifest
    dz model tokenizer OUT                  build the small offline tokenizer of the embedded default
    dz data fetch|synth|metadata|check ...  datasets (see `dz data -h`)
    dz data record libero --suite S --out D LIBERO demonstrations from the scripted expert (DART noise, DAgger)
    dz train [--config FILE] [--set k=v]    SFT; under torchrun: FSDP2 over all ranks; resumes from out_dir
    dz convert RUN|CKPT --out DIR           DCP -> config.json + model.safetensors (+ experiment_cfg/)
    dz eval libero RUN|MODEL --out DIR      LIBERO success rate across checkpoint steps
    dz eval oracle DATASET --out DIR        replay recorded episodes through the eval path (exit 1 below 95 %)
    dz eval action-error RUN|MODEL --out DIR   held-out action error vs the mean predictor and the untrained model
    dz eval previews MODEL --out DIR          the predicted video of held-out windows beside the real frames
    dz eval probe DATASET --vae V --out DIR   linear probes from VAE latents to the eef/object positions (held out)
    dz package MODEL --robot R --version V --out DIR   versioned Franka bundle + tarball
    dz serve BUNDLE|models:/NAME@ALIAS      the policy server (openpi/RoboArena protocol; token in DZ_SERVE_TOKEN)
    dz client URL [--dry-run]               drive the LIBERO Panda through a server (or print its actions)
    dz cache --config FILE --out DIR        precomputed encoder outputs; train with train.cache=DIR
    dz bench model ...                      bf16 forward+backward timing on a GPU
    dz bench data ...                       video decode and loader throughput
    dz params check|show|train-config       validate params.yaml; print a profile; write its TrainConfig
    dz stage NAME [--profile P]             one pipeline stage from params.yaml (what dvc.yaml runs)
    dz pipeline|deploy|promote ...          Prefect/MLflow commands, added by the flows package when installed
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


class CLIError(Exception):
    """A user error: printed as one line, exit code 2."""


def _deliberate(exc: BaseException) -> bool:
    """One of the project's own error classes (DataError, ParamsError, ...) or a missing file: what users cause."""
    return isinstance(exc, FileNotFoundError) or (
        type(exc) is not ValueError and type(exc).__module__.split(".")[0] in ("dzmodel", "tasks", "flows"))


def _claim_out(ns: argparse.Namespace, command: str) -> None:
    """--out as a directory of this command's (absent, empty, or written by dz; --overwrite: any directory)."""
    from .outputs import claim_dir

    claim_dir(ns.out, command, overwrite=ns.overwrite)


# --- dz model --------------------------------------------------------------------

def cmd_model_parity(ns: argparse.Namespace) -> int:
    from .model.parity import FixtureError, run_parity

    failed = False
    for path in ns.fixtures:
        try:
            result = run_parity(path, tolerance=ns.tolerance)
        except FixtureError as exc:
            raise CLIError(str(exc)) from exc
        print(result.report())
        failed |= not result.ok
    return EXIT_FAIL if failed else EXIT_OK


def cmd_model_info(ns: argparse.Namespace) -> int:
    import torch

    from .model.args import PRESETS, DreamZeroArgs, preset
    from .model.wam import DreamZeroWAM
    from .model.wan_dit import WanModel

    names = [ns.preset] if ns.preset else list(PRESETS)
    print(f"{'preset':<16} {'params':>16} {'dim':>6} {'layers':>6} {'heads':>5} {'ffn':>6}")
    for name in names:
        try:
            args = preset(name)
        except KeyError as exc:
            raise CLIError(str(exc.args[0])) from exc
        with torch.device("meta"):
            model = DreamZeroWAM(args) if isinstance(args, DreamZeroArgs) else WanModel(args)
        n = sum(p.numel() for p in model.parameters())
        print(f"{name:<16} {n:>16,} {args.dim:>6} {args.num_layers:>6} {args.num_heads:>5} {args.ffn_dim:>6}")
    return EXIT_OK


def cmd_model_manifest(ns: argparse.Namespace) -> int:
    from .model.checks import manifest_report

    ok, text = manifest_report()
    print(text)
    return EXIT_OK if ok else EXIT_FAIL


def cmd_model_tokenizer(ns: argparse.Namespace) -> int:
    from .model.tokenizer import build_tiny_tokenizer, load_tokenizer

    out = build_tiny_tokenizer(ns.out, vocab_size=ns.vocab_size)
    tok = load_tokenizer(out)
    ids, mask = tok(["pick up the red block and place it in the basket"], max_length=16)
    print(f"wrote a {tok.vocab_size}-token tokenizer to {out}")
    print(f"example ids: {ids[0, : int(mask.sum())].tolist()}")
    return EXIT_OK


# --- dz data ----------------------------------------------------------------------

def _registry(ns: argparse.Namespace):
    from .data.embodiments import load_embodiments

    return load_embodiments(ns.embodiments or ())


def cmd_data_fetch(ns: argparse.Namespace) -> int:

    from .data.fetch import fetch_dataset
    from .eval.libero_record import record_into

    synth = {"num_episodes": ns.synth_episodes, "seed": ns.seed} if ns.source == "synthetic" else None
    path = fetch_dataset(ns.source, Path(ns.dest), revision=ns.revision, allow_patterns=ns.allow or None,
                         synth_kwargs=synth, name=ns.name, retries=ns.retries, retry_delay_s=ns.retry_delay,
                         skip_missing=ns.skip_missing, recorder=record_into)
    print(f"dataset ready: {path}")
    return EXIT_OK


def cmd_data_synth(ns: argparse.Namespace) -> int:
    from .data.synth import make_synthetic_dataset, summarize

    codec = {"av1": "libsvtav1", "h264": "libx264"}[ns.codec]
    path = make_synthetic_dataset(ns.out, num_episodes=ns.episodes, episode_length=ns.length,
                                  image_size=ns.image_size, codec=codec, seed=ns.seed, overwrite=ns.overwrite,
                                  motion=ns.motion, embodiment=ns.embodiment)
    print(summarize(path))
    return EXIT_OK


def cmd_data_record_libero(ns: argparse.Namespace) -> int:
    from .eval.libero_env import LiberoNotInstalled
    from .eval.libero_record import RecordConfig, record_libero

    cfg = RecordConfig(suite=ns.suite, tasks=_int_list(ns.tasks, "--tasks"), episodes=ns.episodes, init=ns.init,
                       max_shift_m=ns.max_shift, min_shift_m=ns.min_shift, image_size=ns.image_size, seed=ns.seed,
                       workers=ns.workers, codec={"av1": "libsvtav1", "h264": "libx264"}[ns.codec], gop=ns.gop,
                       max_steps=ns.max_steps, dart_noise=ns.dart_noise, dagger=ns.dagger, dagger_beta=ns.dagger_beta,
                       dagger_device=ns.device, dagger_solver_steps=ns.solver_steps, dagger_cfg_scale=ns.cfg_scale,
                       actions_per_chunk=ns.actions_per_chunk, keep=ns.keep)
    try:
        record_libero(cfg, ns.out, overwrite=ns.overwrite, progress=not ns.no_progress)
    except LiberoNotInstalled as exc:
        raise CLIError(str(exc)) from None
    return EXIT_OK


def _is_metadata_json(path: Path) -> bool:
    """A metadata.json that `dz data metadata` wrote: a JSON object of embodiment entries with statistics."""
    import json

    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(doc, dict) and bool(doc) and all(isinstance(v, dict) and "statistics" in v for v in doc.values())


def cmd_data_metadata(ns: argparse.Namespace) -> int:
    from .data.dataset import embodiment_metadata
    from .data.embodiments import get_embodiment

    from .outputs import check_output_file

    check_output_file(ns.out, _is_metadata_json, overwrite=ns.overwrite, what="a metadata.json")  # --merge too
    emb = get_embodiment(ns.embodiment, _registry(ns))
    doc = embodiment_metadata(ns.dataset, emb, ns.out, merge=ns.merge, max_episodes=ns.max_episodes,
                              heldout_episodes=ns.heldout_episodes)
    stats = doc[emb.tag]["statistics"]
    print(f"wrote {ns.out} [{emb.tag}], statistics from {doc[emb.tag]['statistics_episodes']} episodes")
    for group, entries in stats.items():
        for key, st in entries.items():
            print(f"  {group}.{key}: {len(st['mean'])} dims, q01 {[round(v, 3) for v in st['q01'][:4]]}..., "
                  f"q99 {[round(v, 3) for v in st['q99'][:4]]}...")
    return EXIT_OK


def cmd_data_check(ns: argparse.Namespace) -> int:
    from .data.dataset import WindowDataset
    from .data.embodiments import get_embodiment
    from .data.errors import DataError
    from .data.lerobot_format import open_dataset
    from .data.sampling import WindowSpec

    reader = open_dataset(ns.dataset)
    print(f"{reader.root}: LeRobot {reader.version}, {len(reader.episodes)} episodes, "
          f"{sum(e.length for e in reader.episodes)} frames at {reader.fps:g} fps, views {reader.video_keys}")
    try:
        reader.check()
        print("all promised data and video files are present")
    except DataError as exc:
        if not ns.skip_missing:
            raise
        print(f"warning: {exc}")
    from .data.check import dataset_problems, deep_check, raise_problems

    raise_problems(reader, deep_check(reader) if ns.deep else dataset_problems(reader), shown=None)
    print("every data file's footer opens, every number in it is finite and every video is a video container"
          + ("; every video frame decodes and frame counts match the episode table" if ns.deep else ""))
    if reader.version == "v3.0":
        from .data.lerobot_format import crosscheck_with_lerobot

        print(crosscheck_with_lerobot(reader))
    if ns.embodiment:
        emb = get_embodiment(ns.embodiment, _registry(ns))
        spec = WindowSpec(ns.chunks, emb.action_horizon, 4 * ns.frames_per_block, emb.sampling)
        ds = WindowDataset(reader, emb, spec, statistics=None, train=False, skip_missing=ns.skip_missing)
        if ds.missing:
            print(f"skipping {len({ep for ep, _ in ds.missing})} episodes with missing video files")
        sample = ds.sample(0)
        print(f"embodiment {emb.tag}: {len(ds)} anchors ({len(ds.index.skipped)} segments too short), "
              f"state {ds.keys.state_dim} dims, action {ds.keys.action_dim} dims, "
              f"frames {tuple(sample['images'].shape)}")
        print(f"prompt: {sample['prompt']}")
    return EXIT_OK


# --- dz train --------------------------------------------------------------------

def load_train_config(ns: argparse.Namespace):
    import json

    from .train.config import TrainConfig

    raw: dict = {}
    if ns.config:
        path = Path(ns.config)
        if not path.is_file():
            raise CLIError(f"config file not found: {path}")
        text = path.read_text()
        if path.suffix in (".yaml", ".yml"):
            import yaml

            raw = yaml.safe_load(text) or {}
        else:
            raw = json.loads(text)
    for item in ns.set or []:
        if "=" not in item:
            raise CLIError(f"--set wants key=value, got {item!r}")
        key, value = item.split("=", 1)
        try:
            raw[key] = json.loads(value)
        except json.JSONDecodeError:
            raw[key] = value
    for key in ("preset", "embodiment", "metadata", "steps", "out_dir", "skip_missing"):
        value = getattr(ns, key, None)
        if value is not None:
            raw[key] = value
    if ns.dataset:
        raw["datasets"] = ns.dataset
    if getattr(ns, "embodiments", None):
        raw["embodiment_files"] = list(raw.get("embodiment_files") or []) + ns.embodiments
    try:
        return TrainConfig.from_dict(raw)
    except (TypeError, ValueError) as exc:
        raise CLIError(str(exc)) from exc


def cmd_train(ns: argparse.Namespace) -> int:
    from .train.launch import run

    run(load_train_config(ns), overwrite=ns.overwrite)
    return EXIT_OK


def _int_list(text: str | None, flag: str) -> list[int] | None:
    if not text:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise CLIError(f"{flag} must be comma-separated integers, got {text!r}") from None


def cmd_package(ns: argparse.Namespace) -> int:
    from .serve.package import RobotConfig, build_package

    bundle, tarball = build_package(ns.model, ns.out, RobotConfig.load(ns.robot), ns.version, ns.eval_dir, ns.name,
                                    overwrite=ns.overwrite, sign_key=ns.sign)
    print(f"bundle {bundle}\ntarball {tarball}")
    return EXIT_OK


def read_token(token_file: str | None) -> str | None:
    """The shared secret from --token-file or DZ_SERVE_TOKEN (never the command line, which `ps` shows)."""
    if token_file:
        path = Path(token_file)
        if not path.is_file():
            raise CLIError(f"{path}: token file not found")
        token = path.read_text().strip()
        if not token:
            raise CLIError(f"{path}: the token file is empty")
        return token
    return os.environ.get("DZ_SERVE_TOKEN") or None


def resolve_bundle_source(source: str) -> tuple[str, str | None]:
    """A bundle path as given, or a URI (models:/<name>@<alias>) resolved by a `dz.bundle_resolvers` entry point
    (the pipeline package resolves models:/ through MLflow; the library itself imports no MLflow). Returns
    (path, the MANIFEST sha256 the registry pinned, or None)."""
    from importlib.metadata import entry_points

    scheme = source.split(":/", 1)[0] if ":/" in source else None
    if scheme is None or (len(scheme) == 1 and sys.platform == "win32"):
        return source, None
    found = [ep for ep in entry_points(group="dz.bundle_resolvers") if ep.name == scheme]
    if not found:
        raise CLIError(f"{source}: nothing resolves {scheme}:/ URIs here (models:/ needs the pipeline extras, "
                       "i.e. MLflow: `make setup`)")
    try:
        resolved = found[0].load()(source)
        path, digest = resolved if isinstance(resolved, tuple) else (resolved, None)
        return str(path), digest
    except ImportError as exc:
        raise CLIError(f"{source}: {scheme}:/ URIs need {exc.name} (the pipeline extras: `make setup`)") from None


def cmd_serve(ns: argparse.Namespace) -> int:
    from .serve.bundles import TRUST_ENV, BundleError, load_trusted_key
    from .serve.protocol import RequestLimits
    from .serve.server import ServeError, ServerLimits, serve_bundle

    token = read_token(ns.token_file)
    if ns.no_auth:
        if token:
            raise CLIError("--no-auth and a token (DZ_SERVE_TOKEN or --token-file) contradict each other; pick one")
        token = None
    elif not token:
        raise CLIError("dz serve needs a token: set DZ_SERVE_TOKEN or pass --token-file FILE "
                       "(or --no-auth for clients that send none, such as RoboArena's evaluator)")
    trust = ns.trust or os.environ.get(TRUST_ENV) or None
    if trust:
        try:
            load_trusted_key(trust)  # a bad key file is refused before the model loads
        except BundleError as exc:
            raise CLIError(str(exc)) from None
    try:
        limits = ServerLimits(max_sessions=ns.max_sessions, sessions_per_connection=ns.sessions_per_connection,
                              max_connections=ns.max_connections, max_frame_bytes=int(ns.max_frame_mib * 2**20),
                              max_connections_per_client=ns.max_connections_per_client, idle_timeout_s=ns.idle_timeout,
                              request=RequestLimits(max_frames=ns.max_frames))
        bundle, manifest_sha256 = resolve_bundle_source(ns.bundle)
        serve_bundle(bundle, token, ns.host, ns.port, ns.device, limits, solver_from(ns), ns.certfile, ns.keyfile,
                     compile=False if ns.no_compile else None, trust=trust, manifest_sha256=manifest_sha256)
    except ServeError as exc:
        raise CLIError(str(exc)) from None
    return EXIT_OK


def cmd_client(ns: argparse.Namespace) -> int:
    import json

    from .serve.client import DryRunRobot, ServerError, load_test, run_client

    token = read_token(ns.token_file)
    try:
        if ns.load_test:
            print(json.dumps(load_test(ns.url, token, ns.load_test, ns.requests)))
            return EXIT_OK
        if ns.dry_run:
            run_client(ns.url, token, DryRunRobot(ns.prompt), ns.chunks)
            return EXIT_OK
        from .serve.libero_client import run_libero_client

        summary = run_libero_client(ns.url, token, suite=ns.suite, task=ns.task, episodes=ns.episodes,
                                    control_hz=ns.control_hz, max_steps=ns.max_steps, seed=ns.seed,
                                    camera_size=ns.camera_size, out=ns.out, overlap=not ns.sync)
        print(json.dumps(summary))
    except (ServerError, OSError) as exc:
        raise CLIError(str(exc)) from None
    return EXIT_OK


def cmd_eval_libero(ns: argparse.Namespace) -> int:
    from .eval.libero_env import LiberoNotInstalled
    from .eval.libero_eval import EvalConfig, evaluate_run
    from .eval.policy import PolicyLoadError

    _claim_out(ns, "eval libero")
    cfg = EvalConfig(suite=ns.suite, tasks=_int_list(ns.tasks, "--tasks"), episodes_per_task=ns.episodes,
                     max_steps=ns.max_steps, num_workers=ns.workers, camera_size=ns.camera_size,
                     actions_per_chunk=ns.actions_per_chunk, videos=ns.videos, seed=ns.seed,
                     batch_policy=not ns.no_batch_policy, context=ns.context, first_init_state=ns.first_init_state)
    try:
        rows = evaluate_run(ns.source, cfg, ns.out, steps=_int_list(ns.steps, "--steps"), device=ns.device,
                            solver=solver_from(ns), progress=not ns.no_progress, embodiment=ns.embodiment,
                            compile=ns.compile, weights=ns.weights)
    except (LiberoNotInstalled, PolicyLoadError) as exc:
        raise CLIError(str(exc)) from None
    print(f"{'step':>8} {'task':>5} {'episodes':>8} {'successes':>9} {'rate':>6}   95 % interval")
    for r in rows:
        print(f"{str(r['step']):>8} {str(r['task']):>5} {r['episodes']:>8} {r['successes']:>9} {r['rate']:>6.1%}   "
              f"{r['ci_low']:.1%}-{r['ci_high']:.1%}")
    print(f"results in {ns.out}: results.csv, episodes.csv, summary.json, success_vs_step.png, videos/")
    return EXIT_OK


def cmd_eval_action_error(ns: argparse.Namespace) -> int:
    from .eval.action_error import ActionErrorError, describe, evaluate_action_error
    from .eval.policy import PolicyLoadError

    _claim_out(ns, "eval action-error")
    try:
        result = evaluate_action_error(ns.source, ns.out, steps=_int_list(ns.steps, "--steps"), stride=ns.stride,
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
    from .eval.action_error import ActionErrorError
    from .eval.policy import PolicyLoadError
    from .eval.previews import describe_errors, write_previews

    _claim_out(ns, "eval previews")
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
    from .data.embodiments import get_embodiment, load_embodiments
    from .eval.probe import describe, parse_target, run_probe

    _claim_out(ns, "eval probe")
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
    from .eval.libero_env import LiberoNotInstalled
    from .eval.oracle import run_oracle

    _claim_out(ns, "eval oracle")
    try:
        summary = run_oracle(ns.dataset, ns.out, metadata=ns.metadata, embodiment=ns.embodiment,
                             max_episodes=ns.max_episodes, workers=ns.workers, camera_size=ns.camera_size,
                             videos=ns.videos, progress=not ns.no_progress)
    except LiberoNotInstalled as exc:
        raise CLIError(str(exc)) from None
    return EXIT_OK if summary["passed"] else EXIT_FAIL


def cmd_cache(ns: argparse.Namespace) -> int:
    from .train.cache import build_cache, synthetic_cache

    cfg = load_train_config(ns)
    if ns.synthetic is not None:
        if ns.synthetic < 1:
            raise CLIError(f"--synthetic wants a number of samples >= 1, got {ns.synthetic}")
        out = synthetic_cache(cfg.preset, ns.cache_out, ns.synthetic, _latent_hw(ns.latent_hw),
                              seed=cfg.seed, model_overrides=cfg.model_overrides, overwrite=ns.overwrite)
        print(f"wrote a synthetic cache of {ns.synthetic} random {cfg.preset} samples: {out}")
        return EXIT_OK
    if not cfg.tokenizer:
        raise CLIError("dz cache needs the tokenizer directory (train.tokenizer / --set tokenizer=DIR)")
    out = build_cache(cfg, ns.cache_out, stride=ns.stride, batch_size=ns.batch_size, overwrite=ns.overwrite)
    print(f"wrote the encoder cache {out}")
    return EXIT_OK


def cmd_convert(ns: argparse.Namespace) -> int:
    from .train.convert import convert_checkpoint, resolve_checkpoint

    ckpt = resolve_checkpoint(ns.checkpoint, ns.step)
    out = convert_checkpoint(ckpt, ns.out, max_shard_bytes=int(ns.max_shard_gib * 2**30),
                             adapters_only=ns.adapters_only, weights=ns.weights, overwrite=ns.overwrite)
    print(f"converted {ckpt} -> {out}")
    return EXIT_OK


# --- dz bench ----------------------------------------------------------------------

def cmd_bench_model(ns: argparse.Namespace) -> int:
    import torch

    from .bench.model_step import run

    device = ns.device or ("cuda" if torch.cuda.is_available() else "cpu")
    hw = _latent_hw(ns.latent_hw)
    if ns.check:
        from .bench.model_step import check_flex_vs_sdpa

        for name, layers, dt, chw in (("tiny", None, torch.float32, "4,6"), (ns.preset, 2, torch.bfloat16, ns.latent_hw)):
            errs = check_flex_vs_sdpa(name, layers, tuple(int(x) for x in chw.split(",")), dt, device)
            print(f"flex vs sdpa, {name} ({dt}): " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()))
    run(ns.preset, ns.layers, [int(b) for b in ns.batch.split(",")], ns.backend.split(","), hw,
        ns.steps, ns.warmup, device, ns.out)
    return EXIT_OK


def _latent_hw(text: str) -> tuple[int, int]:
    try:
        hw = tuple(int(x) for x in text.split(","))
    except ValueError:
        hw = ()
    if len(hw) != 2 or min(hw) < 1:
        raise CLIError(f"--latent-hw must be H,W (e.g. 11,20), got {text!r}")
    return hw


# The best measured 5B configuration on one H200 (docs/performance.md).
OPTIMISED_VARIANT = {"name": "optimised", "micro_batch": 21, "accumulation": 1, "compile": True, "ac": "elementwise",
                     "attention": "segments", "encoders": "cache"}


def parse_variant(text: str) -> dict:
    """'name=opt,mbs=32,compile=1,ac=full,attn=flex,encoders=cache,lora=64,ema=0.999' -> run_config kwargs."""
    keys = {"name": "name", "mbs": "micro_batch", "accum": "accumulation", "compile": "compile", "ac": "ac",
            "attn": "attention", "encoders": "encoders", "lora": "lora_rank", "ema": "ema_decay"}
    out = dict(OPTIMISED_VARIANT)
    for part in text.split(","):
        if "=" not in part:
            raise CLIError(f"variant field {part!r} is not key=value")
        k, v = part.split("=", 1)
        if k not in keys:
            raise CLIError(f"variant key {k!r} is not one of {sorted(keys)}")
        try:
            out[keys[k]] = (int(v) if k in ("mbs", "accum", "lora") else float(v) if k == "ema"
                            else (v in ("1", "true", "yes")) if k == "compile" else v)
        except ValueError:
            raise CLIError(f"variant field {part!r}: {v!r} is not a number") from None
    return out


def cmd_bench_train(ns: argparse.Namespace) -> int:
    from .bench.train_bench import run

    configs = [parse_variant(v) for v in (ns.variant or ["name=optimised"])]
    if not ns.no_baseline:  # last, so its encoders never share the GPU with an optimised configuration
        configs.append({"name": "baseline", "micro_batch": 1, "compile": False, "ac": "none", "attention": "sdpa",
                        "encoders": "online_per_sample"})
    # Before the first CUDA allocation: large, varying activation sets fragment the default allocator.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    run(ns.preset, ns.layers or None, configs, _latent_hw(ns.latent_hw), ns.steps, ns.warmup, ns.out, fsdp=ns.fsdp,
        against_run=ns.against_run)
    return EXIT_OK


def cmd_bench_profile(ns: argparse.Namespace) -> int:
    import json

    from .bench.train_profile import block_parts, print_parts, print_summary, profile_step

    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    hw = _latent_hw(ns.latent_hw)
    v = parse_variant(ns.variant)
    result = {}
    if ns.parts or ns.parts_only:
        rows = block_parts(ns.preset, hw, v["micro_batch"])
        print(f"one block's pieces alone ({ns.preset}, latent {hw}, micro-batch {v['micro_batch']}):")
        print_parts(rows)
        result["parts"] = rows
    if not ns.parts_only:
        s = profile_step(ns.preset, ns.layers or None, v["micro_batch"], v["compile"], v["ac"], v["attention"], hw,
                         ns.trace, fsdp=ns.fsdp)
        if s is None:  # not rank 0
            return EXIT_OK
        print(f"one training step, {ns.preset} {ns.layers or 'all'} layers, {ns.variant}:")
        print_summary(s)
        result["step"] = {"step_ms": s.step_ms, "compute_busy_ms": s.compute_busy_ms, "exposed_comm_ms": s.exposed_comm_ms, "by_category": s.by_category, "top": s.top}
    if ns.out:
        with open(ns.out, "a") as f:
            f.write(json.dumps({"preset": ns.preset, "layers": ns.layers, "variant": ns.variant, **result}) + "\n")
    return EXIT_OK


def cmd_bench_policy(ns: argparse.Namespace) -> int:
    import json

    import torch

    from .bench.policy_bench import PolicySetting, ladder, run_policy_bench

    device = ns.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        batches = tuple(int(b) for b in ns.batch.split(","))
    except ValueError:
        raise CLIError(f"--batch takes comma-separated integers, got {ns.batch!r}") from None
    if ns.ladder:
        settings = ladder()
    else:
        settings = [PolicySetting(name=ns.name, weights=ns.weights or ("bf16" if device.startswith("cuda") else "fp32"),
                                  solver_steps=ns.solver_steps, cfg_scale=ns.cfg_scale, batch_cfg=not ns.no_batch_cfg,
                                  dit_steps=ns.dit_steps, text_cache=not ns.no_text_cache,
                                  cuda_graphs=not ns.no_cuda_graphs, compile=ns.compile)]

    def emit(row: dict) -> None:
        print(json.dumps(row), flush=True)
        if ns.out:
            with open(ns.out, "a") as f:
                f.write(json.dumps(row) + "\n")

    run_policy_bench(ns.preset, device, settings, batches, ns.calls, ns.warmup, ns.breakdown_calls, progress=emit)
    return EXIT_OK


def cmd_bench_data(ns: argparse.Namespace) -> int:
    import json

    from .bench.data_bench import run_data_bench

    result = run_data_bench(ns.workdir, workers=tuple(int(w) for w in ns.workers.split(",")),
                            decode_samples=ns.samples, loader_samples=ns.loader_samples)
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(result, f, indent=1, default=str)
    return EXIT_OK



# --- dz params / dz stage (the pipeline's stages, as dvc.yaml and the Prefect tasks run them) ----------------

def _load_params(ns: argparse.Namespace):
    from .config import load_params

    return load_params(ns.params, ns.set or [], ns.profile)


def cmd_params_check(ns: argparse.Namespace) -> int:
    params = _load_params(ns)
    width = max(map(len, params.profiles))
    for name, prof in params.profiles.items():
        launch = prof.launch
        mark = "*" if name == (ns.profile or params.profile) else " "
        print(f"{mark} {name:<{width}} {prof.train.get('preset', 'tiny'):<14} {launch['nnodes']} node(s) x "
              f"{launch['nproc_per_node']} process(es)  {prof.description}")
    print(f"{ns.params}: valid ({len(params.profiles)} profiles; * = selected)")
    return EXIT_OK


def cmd_params_show(ns: argparse.Namespace) -> int:
    import json

    from .config import profile_dict

    params = _load_params(ns)
    print(json.dumps(profile_dict(params.selected(ns.profile)), indent=1))
    return EXIT_OK


def cmd_params_train_config(ns: argparse.Namespace) -> int:
    import json

    from .atomic import atomic_write_text
    from .config import StagePaths, train_config

    params = _load_params(ns)
    name = ns.profile or params.profile
    cfg = train_config(params.selected(name), StagePaths(Path(ns.root), name))
    atomic_write_text(ns.out, json.dumps(cfg.to_dict(), indent=1))
    print(f"wrote {ns.out} (profile {name}: {cfg.preset}, {cfg.steps} steps, out_dir {cfg.out_dir})")
    return EXIT_OK


def cmd_params_dvc(ns: argparse.Namespace) -> int:
    from .atomic import atomic_write_text
    from .pipeline import dvc_yaml_with_computed_deps

    path = Path(ns.dvc_yaml)
    if not path.is_file():
        raise CLIError(f"{path}: no such file")
    text = path.read_text()
    wanted = dvc_yaml_with_computed_deps(text)
    if wanted == text:
        print(f"{path}: every stage's deps match the stage table")
        return EXIT_OK
    if not ns.write:
        print(f"{path}: stage deps differ from the stage table (the code each stage imports); "
              "`dz params dvc --write` rewrites them", file=sys.stderr)
        return EXIT_FAIL
    atomic_write_text(path, wanted)
    print(f"{path}: rewrote the stages' deps from the stage table")
    return EXIT_OK


def cmd_stage(ns: argparse.Namespace) -> int:

    from .config import StagePaths
    from .pipeline import run_stage

    params = _load_params(ns)
    name = ns.profile or params.profile
    result = run_stage(ns.stage, params.selected(name), StagePaths(Path(ns.root), name))
    print(f"stage {ns.stage} [{name}] done in {result['seconds']:.1f} s")
    return EXIT_OK


def _add_params_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--params", default="params.yaml", help="the parameters file (default params.yaml)")
    p.add_argument("--profile", help="the profile to use (default: params.yaml's `profile`)")
    p.add_argument("--set", action="append", metavar="STAGE.KEY=VALUE",
                   help="override one parameter of the profile, e.g. train.steps=20 (value parsed as YAML)")


def _add_plugin_commands(sub) -> None:
    """Commands that need Prefect/MLflow live outside the library (`dz.commands` entry points)."""
    from importlib.metadata import entry_points

    for ep in entry_points(group="dz.commands"):
        try:
            ep.load()(sub)
        except ImportError as exc:  # e.g. the GPU image: no Prefect/MLflow; the command says so instead of vanishing
            why = f"importing {ep.value.split(':')[0]} failed: {exc}"

            def unavailable(ns, name=ep.name, why=why):
                raise CLIError(f"`dz {name}` (and the Prefect/MLflow commands that come with it) is unavailable "
                               f"here: {why}. Install the pipeline extras (`make setup`).")

            p = sub.add_parser(ep.name, help=f"unavailable: {why}")
            p.add_argument("args", nargs=argparse.REMAINDER)
            p.set_defaults(func=unavailable)

# --- parser ----------------------------------------------------------------------------

def add_solver_arguments(p: argparse.ArgumentParser, dit_steps: str = "") -> None:
    p.add_argument("--solver-steps", type=int, default=16, help="Euler steps of the flow solver")
    p.add_argument("--cfg-scale", type=float, default=5.0, help="classifier-free guidance on the video (1 = off)")
    p.add_argument("--dit-steps", default=dit_steps, help="which solver steps run the DiT (T) or reuse its velocity "
                   "(F), e.g. TTTFFFTFFFTFFTTT; 'upstream' = that 16-step schedule (8 DiT forwards); '' = every step"
                   + ("; 'auto' (default) = upstream at 16 solver steps, else every step" if dit_steps == "auto" else
                      " (default)"))


def solver_from(ns: argparse.Namespace):
    from .model.inference import SolverConfig

    dit_steps = ns.dit_steps
    if dit_steps == "auto":  # dz serve: upstream's schedule at its 16 steps, every step otherwise
        dit_steps = "upstream" if ns.solver_steps == 16 else ""
    try:
        return SolverConfig(num_steps=ns.solver_steps, cfg_scale=ns.cfg_scale, dit_steps=dit_steps)
    except ValueError as exc:
        raise CLIError(f"--solver-steps/--dit-steps: {exc}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dz", description="DreamZero fine-tuning pipeline")
    parser.add_argument("--debug", action="store_true", help="show the traceback of any error")
    sub = parser.add_subparsers(dest="group", required=True)

    model = sub.add_parser("model", help="model library checks").add_subparsers(dest="cmd", required=True)
    p = model.add_parser("parity", help="reproduce reference fixtures (DiT, VAE or WAM, detected from the file)")
    p.add_argument("fixtures", nargs="+", metavar="FIXTURE")
    p.add_argument("--tolerance", type=float, default=1e-4)
    p.set_defaults(func=cmd_model_parity)
    p = model.add_parser("info", help="parameter counts of the presets")
    p.add_argument("--preset")
    p.set_defaults(func=cmd_model_info)
    p = model.add_parser("tokenizer", help="build the small offline tokenizer of the embedded default")
    p.add_argument("out", help="directory to write (tokenizer.json, tokenizer_config.json, special_tokens_map.json)")
    p.add_argument("--vocab-size", type=int, default=640)
    p.set_defaults(func=cmd_model_tokenizer)
    p = model.add_parser("manifest", help="check module keys/shapes against the WAN checkpoint manifest")
    p.set_defaults(func=cmd_model_manifest)

    data = sub.add_parser("data", help="datasets: fetch, synth, metadata, check").add_subparsers(dest="cmd", required=True)
    p = data.add_parser("fetch", help="fetch a dataset (hub id at a revision, a local path, or 'synthetic')")
    p.add_argument("source")
    p.add_argument("--dest", default="data/datasets", help="the project's data directory (DVC-tracked)")
    p.add_argument("--revision", help="required for hub ids: a commit sha or tag")
    p.add_argument("--allow", action="append", help="allow-pattern (repeatable), e.g. 'meta/*' 'data/*'")
    p.add_argument("--name", help="directory name under --dest")
    p.add_argument("--retries", type=int, default=3, help="hub downloads: retries of transient errors (network, 5xx)")
    p.add_argument("--retry-delay", type=float, default=10.0, help="seconds before the first retry (doubles each time)")
    p.add_argument("--skip-missing", action="store_true",
                   help="accept a dataset that lacks some video files (train with --skip-missing to skip their episodes)")
    p.add_argument("--synth-episodes", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_data_fetch)
    p = data.add_parser("synth", help="generate the embedded LIBERO-like (or DROID-like) LeRobot v3.0 dataset")
    p.add_argument("out")
    p.add_argument("--episodes", type=int, default=8)
    p.add_argument("--length", type=int, default=96)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--codec", choices=["av1", "h264"], default="av1")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--motion", choices=["walk", "orbit"], default="walk",
                   help="orbit: actions predictable from one frame (the demo's); walk: random walks")
    p.add_argument("--embodiment", choices=["libero_sim", "oxe_droid"], default="libero_sim",
                   help="oxe_droid: DROID's three views, 14-dim state and 21-dim action columns")
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(func=cmd_data_synth)
    rec = data.add_parser("record", help="record demonstrations in simulation").add_subparsers(dest="sim", required=True)
    p = rec.add_parser("libero", help="LIBERO demonstrations from the scripted expert -> a LeRobot v3.0 dataset")
    p.add_argument("--suite", default="object", help="object | spatial (pick-and-place; goal/10 tasks that are "
                   "single pick-and-place goals too)")
    p.add_argument("--tasks", help="task indices, e.g. 0,1,2 (default: every task of the suite)")
    p.add_argument("--episodes", type=int, default=10, help="expert attempts per task; only successes are kept")
    p.add_argument("--init", choices=["standard", "perturbed", "sampled"], default="standard",
                   help="the standard init states 0..N-1 (the evaluation's), seeded perturbations of them, or fresh "
                   "draws from the task's init distribution")
    p.add_argument("--max-shift", type=float, default=0.02, help="perturbed: object x/y shift bound in metres")
    p.add_argument("--min-shift", type=float, help="perturbed: every object moves at least this much; perturbed and "
                   "sampled: every standard init state is at least this far (default: max shift / 2)")
    p.add_argument("--max-steps", type=int, help="steps per attempt (default: the suite's standard limit)")
    p.add_argument("--dart-noise", type=float, default=0.0, metavar="SIGMA",
                   help="DART: execute the expert's action + N(0, SIGMA^2) on the 6 arm dims (clipped to [-1, 1]); "
                   "the clean expert action is recorded")
    p.add_argument("--dagger", metavar="MODEL_DIR", help="DAgger: a converted model whose policy acts (per chunk, "
                   "with probability 1 - beta); every row is labelled with the expert's action at that state")
    p.add_argument("--dagger-beta", type=float, default=0.5, help="DAgger: probability that the expert acts a chunk")
    p.add_argument("--actions-per-chunk", type=int, help="DAgger: steps per chunk (default: the policy's horizon)")
    p.add_argument("--device", default="cpu", help="DAgger: where the policy runs")
    p.add_argument("--solver-steps", type=int, default=16, help="DAgger: Euler steps of the policy's flow solver")
    p.add_argument("--cfg-scale", type=float, default=5.0, help="DAgger: classifier-free guidance (1 = off)")
    p.add_argument("--keep", choices=["successes", "all"], help="which episodes to write (default: successes; all "
                   "with --dagger)")
    p.add_argument("--image-size", type=int, default=256, help="camera size (the public datasets use 256)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=2, help="parallel env processes (0: one per CPU core)")
    p.add_argument("--codec", choices=["av1", "h264"], default="av1", help="h264 also decodes with OpenCV")
    p.add_argument("--gop", type=int, default=2, help="keyframe interval (lerobot writes 2; longer = smaller)")
    p.add_argument("--out", required=True, help="the dataset directory (written atomically)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_data_record_libero)
    p = data.add_parser("metadata", help="normalisation stats (metadata.json) for a dataset + embodiment")
    p.add_argument("dataset")
    p.add_argument("--embodiment", required=True)
    p.add_argument("--embodiments", action="append", help="extra embodiment YAML file(s)")
    p.add_argument("--out", required=True, help="metadata.json to write (never inside the dataset)")
    p.add_argument("--overwrite", action="store_true", help="replace an --out file that is not a metadata.json written by dz")
    p.add_argument("--merge", action="store_true", help="merge into an existing metadata.json")
    p.add_argument("--max-episodes", type=int)
    p.add_argument("--heldout-episodes", type=int, default=0,
                   help="leave out the last N episodes (train.heldout_episodes): statistics of the training episodes")
    p.set_defaults(func=cmd_data_metadata)
    p = data.add_parser("check", help="verify a dataset's files and, with --embodiment, its keys and one sample")
    p.add_argument("dataset")
    p.add_argument("--embodiment")
    p.add_argument("--embodiments", action="append", help="extra embodiment YAML file(s)")
    p.add_argument("--chunks", type=int, default=4, help="action chunks per window (the model's max_chunk_size)")
    p.add_argument("--frames-per-block", type=int, default=2)
    p.add_argument("--skip-missing", action="store_true", help="report missing video files, use the other episodes")
    p.add_argument("--deep", action="store_true",
                   help="also decode every frame of every video (strict): the first frame that does not decode, "
                        "frame counts against the episode table")
    p.set_defaults(func=cmd_data_check)

    p = sub.add_parser("train", help="SFT training (one process, or under torchrun with FSDP2)")
    p.add_argument("--config", help="YAML/JSON file of train settings (dzmodel.train.config.TrainConfig fields)")
    p.add_argument("--set", action="append", help="override one field: key=value (value parsed as JSON when it can be)")
    p.add_argument("--preset")
    p.add_argument("--dataset", action="append", help="LeRobot dataset directory (repeatable: a mixture)")
    p.add_argument("--embodiment")
    p.add_argument("--metadata")
    p.add_argument("--steps", type=int)
    p.add_argument("--out", dest="out_dir")
    p.add_argument("--skip-missing", action="store_true", default=None,
                   help="train on the other episodes when some view videos are missing (they are listed)")
    p.add_argument("--embodiments", action="append", help="extra embodiment YAML file(s), as the data commands take")
    p.add_argument("--overwrite", action="store_true",
                   help="train into an out_dir that dz did not write (by default refused unless empty)")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("cache", help="precompute frozen-encoder outputs (VAE, umT5, CLIP) per sample window")
    p.add_argument("--config", help="the train config (datasets, embodiment, metadata, tokenizer, preset)")
    p.add_argument("--set", action="append")
    p.add_argument("--preset")
    p.add_argument("--dataset", action="append")
    p.add_argument("--embodiment")
    p.add_argument("--metadata")
    p.add_argument("--embodiments", action="append", help="extra embodiment YAML file(s)")
    p.add_argument("--out", dest="cache_out", required=True, help="cache directory to write")
    p.add_argument("--stride", type=int, default=1, help="cache every stride-th anchor")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--synthetic", type=int, metavar="N",
                   help="no data or encoders: N random samples of the preset's real shapes (to measure dz train)")
    p.add_argument("--latent-hw", default="11,20", help="with --synthetic: latent H,W (5B DROID 11,20)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace --out even if dz did not write it (by default only an earlier dz output is replaced)")
    p.set_defaults(func=cmd_cache, steps=None, out_dir=None)

    p = sub.add_parser("package", help="a versioned, checksummed Franka deployment bundle (+ .tar.gz)")
    p.add_argument("model", help="a converted model directory (dz convert)")
    p.add_argument("--robot", required=True, help="robot config (YAML or JSON): robot_ip, camera_serials, "
                   "target_ee_pose, workspace_min, workspace_max, control_rate_hz, gripper_threshold")
    p.add_argument("--version", required=True)
    p.add_argument("--eval", dest="eval_dir", help="a dz eval libero output directory to ship as evidence")
    p.add_argument("--name", help="bundle name (default dreamzero-<embodiment>)")
    p.add_argument("--out", required=True)
    p.add_argument("--overwrite", action="store_true", help="write into an --out folder that dz did not write")
    p.add_argument("--sign", metavar="KEYFILE", help="sign the MANIFEST (MANIFEST.sig) with this ed25519 private "
                   "key (PEM: `openssl genpkey -algorithm ed25519 -out lab.key`); `dz serve --trust` checks it")
    p.set_defaults(func=cmd_package)

    p = sub.add_parser("serve", help="serve a bundle's policy over WebSocket + msgpack-numpy (openpi and RoboArena "
                                     "clients; docs/deploy.md)")
    p.add_argument("bundle", help="a dz package directory or .tar.gz (verified against its MANIFEST), or "
                                  "models:/<name>@<alias> (the MLflow registry)")
    p.add_argument("--token-file", help="a file holding the shared token (default: the DZ_SERVE_TOKEN variable)")
    p.add_argument("--no-auth", action="store_true",
                   help="accept clients without a token (RoboArena's evaluator sends none); prints a warning")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default localhost only; 0.0.0.0 for all)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--certfile", help="TLS certificate (PEM): serve wss:// instead of ws://")
    p.add_argument("--keyfile", help="TLS private key (PEM), if not inside --certfile")
    p.add_argument("--trust", metavar="PUBKEY", help="refuse any bundle without a valid MANIFEST.sig by this ed25519 "
                   "public key (PEM: `openssl pkey -in lab.key -pubout -out lab.pub`); default: DZ_TRUST_KEY")
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-sessions", type=int, default=64, help="KV-cache sessions across all connections")
    p.add_argument("--sessions-per-connection", type=int, default=4,
                   help="beyond it, a connection's least recently used session ends")
    p.add_argument("--max-connections", type=int, default=64)
    p.add_argument("--max-connections-per-client", type=int, default=16,
                   help="per remote address (loopback, e.g. a reverse proxy, is not capped)")
    p.add_argument("--idle-timeout", type=float, default=600.0,
                   help="seconds without a request before a connection is closed (0: never)")
    p.add_argument("--max-frame-mib", type=float, default=32.0,
                   help="cap on a request frame; the limit follows the bundle's views and --max-frames")
    p.add_argument("--max-frames", type=int, default=33, help="most camera frames per view in one request")
    p.add_argument("--no-compile", action="store_true", help="on CUDA: skip torch.compile of the DiT block "
                   "(faster start, slower chunks; CUDA graphs stay on)")
    add_solver_arguments(p, dit_steps="auto")  # the deployed setting: upstream's 8 of 16 DiT steps
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("client", help="drive the LIBERO Panda (the sim Franka) through a policy server; "
                                      "--dry-run prints the actions without a robot")
    p.add_argument("url", help="e.g. ws://127.0.0.1:8000 (wss:// behind TLS)")
    p.add_argument("--token-file", help="a file holding the server's token (default: DZ_SERVE_TOKEN; none sent if unset)")
    p.add_argument("--dry-run", action="store_true", help="synthetic observations; print the chunks, move nothing")
    p.add_argument("--chunks", type=int, default=3, help="--dry-run: chunks to request")
    p.add_argument("--prompt", default="pick up the cube and place it in the bowl", help="--dry-run: the instruction")
    p.add_argument("--suite", default="object", help="LIBERO suite (spatial, object, goal, 10, 90)")
    p.add_argument("--task", type=int, default=0, help="task index within the suite")
    p.add_argument("--episodes", type=int, default=1)
    p.add_argument("--control-hz", type=float, default=20.0, help="the rate actions are executed at")
    p.add_argument("--max-steps", type=int, default=300)
    p.add_argument("--camera-size", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sync", action="store_true",
                   help="wait for each chunk and execute all of it (as dz eval libero), instead of inferring the next "
                        "chunk while one executes")
    p.add_argument("--out", help="write summary.json and episodes.csv here")
    p.add_argument("--load-test", type=int, metavar="SESSIONS", help="instead: this many concurrent sessions")
    p.add_argument("--requests", type=int, default=4, help="requests per session in the load test")
    p.set_defaults(func=cmd_client)

    ev = sub.add_parser("eval", help="evaluation").add_subparsers(dest="cmd", required=True)
    p = ev.add_parser("libero", help="LIBERO success rate of a converted model, or of a run across its checkpoint steps")
    p.add_argument("source", help="a training run directory (every saved step, converted as needed) or a converted model")
    p.add_argument("--out", required=True, help="results.csv, episodes.csv, summary.json, success_vs_step.png, videos/")
    p.add_argument("--overwrite", action="store_true", help="write into an --out directory that dz did not write")
    p.add_argument("--suite", default="spatial", help="spatial | object | goal | 10")
    p.add_argument("--tasks", help="task indices, e.g. 0,1 (default: all tasks of the suite)")
    p.add_argument("--episodes", type=int, default=1, help="episodes per task (the standard init states 0..N-1)")
    p.add_argument("--first-init-state", type=int, default=0,
                   help="start at this standard init state (e.g. past the ones that picked the checkpoint)")
    p.add_argument("--context", choices=("episode", "frame"), default="episode",
                   help="episode: one session per episode, each query sends the frames since the last (the KV cache "
                        "holds the history, as in training); frame: restart from the current frame at every query")
    p.add_argument("--max-steps", type=int, help="policy steps per episode (default: the suite's standard limit)")
    p.add_argument("--steps", help="with a run directory: checkpoint steps to evaluate, e.g. 1000,2000 (default: all)")
    p.add_argument("--workers", type=int, default=2, help="env worker processes (0: one per CPU core)")
    p.add_argument("--camera-size", type=int, default=128)
    p.add_argument("--actions-per-chunk", type=int, help="execute this many actions of each chunk (default: all)")
    p.add_argument("--videos", type=int, default=2, help="record this many episodes per step as mp4")
    p.add_argument("--embodiment", help="refuse a checkpoint trained for another embodiment")
    p.add_argument("--weights", choices=("raw", "ema"), default="raw",
                   help="with a run directory: convert its checkpoints' raw weights or the EMA (train.ema_decay)")
    p.add_argument("--compile", action="store_true", help="torch.compile the DiT block (GPU; compiles per batch shape)")
    p.add_argument("--no-batch-policy", action="store_true",
                   help="query the policy once per episode instead of one batched forward per step (for comparison)")
    add_solver_arguments(p)
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_eval_libero)

    p = ev.add_parser("action-error", help="held-out action error of a converted model or of a run's steps, vs the "
                      "mean predictor and the untrained model")
    p.add_argument("source", help="a converted model, a `dz stage convert` directory, or a training run")
    p.add_argument("--out", required=True, help="action_error.json, action_error.csv")
    p.add_argument("--overwrite", action="store_true", help="write into an --out directory that dz did not write")
    p.add_argument("--steps", help="with a run directory: checkpoint steps to evaluate, e.g. 1000,2000 (default: all)")
    p.add_argument("--stride", type=int, default=4, help="frames between held-out window anchors")
    p.add_argument("--max-windows", type=int, help="at most this many windows (evenly spaced)")
    add_solver_arguments(p)
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-untrained", action="store_true", help="skip the untrained reference")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_eval_action_error)

    p = ev.add_parser("previews", help="a converted model's predicted video of held-out windows, decoded, beside the "
                      "real frames (mp4s and a PNG grid)")
    p.add_argument("model", help="a converted model directory (held-out windows; a run that held none out shows "
                   "training windows)")
    p.add_argument("--out", required=True, help="ep<E>_t<T>.mp4 per window and grid.png")
    p.add_argument("--overwrite", action="store_true", help="write into an --out directory that dz did not write")
    p.add_argument("--windows", type=int, default=2)
    p.add_argument("--stride", type=int, default=4, help="frames between held-out window anchors")
    add_solver_arguments(p)
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_eval_previews)

    p = ev.add_parser("probe", help="linear probes from VAE latents to the scene state (eef position, objects) on "
                      "held-out episodes: a random VAE vs a pretrained one")
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
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", required=True, help="probe.json and probe.txt")
    p.add_argument("--overwrite", action="store_true", help="write into an --out directory that dz did not write")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_eval_probe)

    p = ev.add_parser("oracle", help="replay recorded demonstrations through the evaluation path (exit 1 below 95%%)")
    p.add_argument("dataset", help="a dataset recorded by `dz data record libero`")
    p.add_argument("--out", required=True, help="summary.json (oracle_success_rate), results.csv, episodes.csv")
    p.add_argument("--overwrite", action="store_true", help="write into an --out directory that dz did not write")
    p.add_argument("--metadata", help="the run's metadata.json (q99 statistics); default: computed from the dataset")
    p.add_argument("--embodiment", default="libero_sim", help="libero_sim | libero_sim_tiny")
    p.add_argument("--max-episodes", type=int, help="replay N recorded episodes, evenly spread over the recording")
    p.add_argument("--workers", type=int, default=2, help="env worker processes (0: one per CPU core)")
    p.add_argument("--camera-size", type=int, help="default: the recorded image size")
    p.add_argument("--videos", type=int, default=0, help="write this many replays as mp4")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_eval_oracle)

    p = sub.add_parser("convert", help="DCP checkpoint -> HF-style directory (config.json + safetensors)")
    p.add_argument("checkpoint", help="a checkpoint directory, or a run directory (its newest checkpoint)")
    p.add_argument("--out", required=True)
    p.add_argument("--step", type=int, help="with a run directory: that step's checkpoint")
    p.add_argument("--max-shard-gib", type=float, default=5.0)
    p.add_argument("--adapters-only", action="store_true",
                   help="a LoRA run: write only the trainable tensors (adapters.safetensors), not merged weights")
    p.add_argument("--weights", choices=("raw", "ema"), default="raw",
                   help="the optimizer's weights, or the EMA a run with train.ema_decay kept")
    p.add_argument("--overwrite", action="store_true",
                   help="replace --out even if dz did not write it (by default only an earlier dz output is replaced)")
    p.set_defaults(func=cmd_convert)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="cmd", required=True)
    p = bench.add_parser("model", help="bf16 forward+backward of the WAM on the DROID token layout")
    p.add_argument("--preset", default="dreamzero_5b")
    p.add_argument("--layers", type=int, default=4, help="cut the preset to this many layers (0 = all)")
    p.add_argument("--batch", default="1", help="comma-separated micro-batch sizes")
    p.add_argument("--backend", default="flex", help="comma-separated: flex, segments, sdpa")
    p.add_argument("--latent-hw", default="11,20", help="latent H,W before patching (5B DROID: 11,20)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device")
    p.add_argument("--out", help="append JSON lines here")
    p.add_argument("--check", action="store_true", help="first compare FlexAttention with SDPA (outputs, grads)")
    p.set_defaults(func=cmd_bench_model)
    p = bench.add_parser("train", help="baseline vs optimised training steps, side by side (GPU)")
    p.add_argument("--preset", default="dreamzero_5b")
    p.add_argument("--layers", type=int, default=0, help="cut the preset to this many layers (0 = all)")
    p.add_argument("--latent-hw", default="11,20", help="latent H,W (5B DROID 11,20; 14B DROID 44,80)")
    p.add_argument("--variant", action="append",
                   help="an optimised config: name=..,mbs=..,accum=..,compile=0/1,ac=none|elementwise|selective|full|full:N,attn=segments|flex|sdpa,"
                        "encoders=cache|online_batched|online_per_sample,lora=RANK,ema=DECAY (repeatable)")
    p.add_argument("--no-baseline", action="store_true")
    p.add_argument("--fsdp", action="store_true", help="FSDP2 even with one process (its overhead without communication)")
    p.add_argument("--against-run", metavar="RUN_DIR",
                   help="a dz train run at the first variant's settings: compare its logged samples/s/GPU")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", help="append JSON lines here")
    p.set_defaults(func=cmd_bench_train)
    p = bench.add_parser("profile", help="where one training step's GPU time goes; --parts: each block piece alone")
    p.add_argument("--preset", default="dreamzero_5b")
    p.add_argument("--layers", type=int, default=2, help="cut the preset to this many layers (0 = all)")
    p.add_argument("--latent-hw", default="11,20", help="latent H,W (5B DROID 11,20; 14B DROID 44,80)")
    p.add_argument("--variant", default="name=optimised", help="one configuration, as in `dz bench train --variant`")
    p.add_argument("--parts", action="store_true", help="also time one block's GEMMs and attention kernels alone")
    p.add_argument("--parts-only", action="store_true", help="only the pieces, no profiled step")
    p.add_argument("--trace", help="keep the Chrome trace here")
    p.add_argument("--fsdp", action="store_true", help="FSDP2 even with one process")
    p.add_argument("--out", help="append a JSON line here")
    p.set_defaults(func=cmd_bench_profile)
    p = bench.add_parser("policy", help="latency of one action chunk on the serving path (p50/p95, per-stage breakdown)")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--device", default=None)
    p.add_argument("--name", default="custom", help="label of this setting in the JSON")
    p.add_argument("--weights", choices=["bf16", "fp32", "autocast"], default=None,
                   help="bf16 weights (GPU default), fp32 (CPU default), or fp32 under bf16 autocast (the old GPU path)")
    add_solver_arguments(p)
    p.add_argument("--no-batch-cfg", action="store_true",
                   help="run CFG's conditional and unconditional passes one after the other (the old path)")
    p.add_argument("--no-text-cache", action="store_true", help="encode the prompt with umT5 at every call")
    p.add_argument("--no-cuda-graphs", action="store_true", help="launch every kernel from Python (eager)")
    p.add_argument("--compile", action="store_true", help="torch.compile the DiT block (inside the CUDA graphs)")
    p.add_argument("--batch", default="1", help="sessions per call, comma-separated (e.g. 1,8,32): chunks/s per batch")
    p.add_argument("--ladder", action="store_true", help="each optimisation in turn, then the fast settings, one model")
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--breakdown-calls", type=int, default=3, help="extra calls timed per stage (synchronised)")
    p.add_argument("--out", help="append one JSON line per measurement here")
    p.set_defaults(func=cmd_bench_policy)
    p = bench.add_parser("data", help="video decode (torchcodec batched vs PyAV) and loader samples/s, DROID-like")
    p.add_argument("--workdir", default="build/bench_data", help="where the generated source videos are cached")
    p.add_argument("--workers", default="1,2,4")
    p.add_argument("--samples", type=int, default=5, help="decode samples to time (median)")
    p.add_argument("--loader-samples", type=int, default=16)
    p.add_argument("--out", help="write the numbers as JSON")
    p.set_defaults(func=cmd_bench_data)

    params = sub.add_parser("params", help="params.yaml: check, show a profile, write its train config")
    params = params.add_subparsers(dest="cmd", required=True)
    p = params.add_parser("check", help="validate the whole file; list the profiles")
    _add_params_args(p)
    p.set_defaults(func=cmd_params_check)
    p = params.add_parser("show", help="print one profile with every default filled in (JSON)")
    _add_params_args(p)
    p.set_defaults(func=cmd_params_show)
    p = params.add_parser("train-config", help="write the TrainConfig JSON the train stage runs (for torchrun)")
    _add_params_args(p)
    p.add_argument("--out", required=True)
    p.add_argument("--root", default=".", help="the project root the stage paths are under")
    p.set_defaults(func=cmd_params_train_config)
    p = params.add_parser("dvc", help="check dvc.yaml's stage deps against the stage table (the code each stage "
                                      "imports); --write rewrites them")
    p.add_argument("--dvc-yaml", default="dvc.yaml")
    p.add_argument("--write", action="store_true")
    p.set_defaults(func=cmd_params_dvc)

    from .pipeline import STAGES

    p = sub.add_parser("stage", help="run one pipeline stage from params.yaml (what dvc.yaml calls)")
    p.add_argument("stage", choices=STAGES)
    _add_params_args(p)
    p.add_argument("--root", default=".", help="the project root: data/<profile>/ and runs/<profile>/ go under it")
    p.set_defaults(func=cmd_stage)

    _add_plugin_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    if ns.debug:  # every error with its traceback
        return ns.func(ns)
    try:
        return ns.func(ns)
    except CLIError as exc:
        print(f"dz: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (ValueError, FileNotFoundError) as exc:  # DataError, ParamsError, ...: one clear message
        print(f"dz: error: {exc}", file=sys.stderr)
        if not _deliberate(exc):  # a ValueError we did not raise on purpose may be a bug
            print(f"dz: ({type(exc).__name__}; `dz --debug ...` shows where it came from)", file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:  # a full disk, or a file where a directory should be, deep inside some writer
        from .outputs import NO_SPACE

        if exc.errno in NO_SPACE:
            print(f"dz: error: {exc.filename or 'output'}: no space left on the device; a partial output was "
                  "removed and nothing earlier was replaced", file=sys.stderr)
        elif isinstance(exc, (NotADirectoryError, FileExistsError, IsADirectoryError)) and exc.filename:
            print(f"dz: error: {exc.filename}: {exc.strerror} (a file where a directory should be, or the "
                  "reverse)", file=sys.stderr)
        else:
            raise
        return EXIT_FAIL
    except RuntimeError as exc:
        from .dirlock import DirectoryBusy
        from .stages.common import StageError

        if not isinstance(exc, (StageError, DirectoryBusy)):
            raise
        print(f"dz: error: {exc}", file=sys.stderr)
        return EXIT_FAIL


if __name__ == "__main__":
    sys.exit(main())
