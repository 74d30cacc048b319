"""The pipeline's stages as library functions: fetch → metadata → vision → cache → train → convert → eval →
package.

`dz stage NAME` (what dvc.yaml runs) and the Prefect tasks call the same `run_stage`, so there is one code
path. Every stage reads its section of one params.yaml profile, writes at fixed places (`StagePaths`, the
paths dvc.yaml names), and returns a JSON-able result: its outputs, a few headline numbers and the files
that hold its metrics and plots. Promotion is not a stage here: it acts on the MLflow registry
(`tasks/registry.py`); `promotion_decision` is its pure gate.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .atomic import atomic_write_text
from .config import Profile, StagePaths, profile_dict, train_config
from .dirlock import directory_lock
from .outputs import OWNER_MARKER, fresh_stage_dir, mark, owner, publish_dir
from .proctree import kill_tree
from .stages import STAGES
from .stages import stage_params as _params_of

class StageError(RuntimeError):
    """A stage failed for a reason already reported (e.g. torchrun's exit code after its log)."""


Log = Callable[[str], None]


def _print(line: str) -> None:
    print(line, flush=True)


def _write_json(path: Path, data: Any) -> Path:
    atomic_write_text(path, json.dumps(data, indent=1, sort_keys=True, default=str) + "\n")
    return path


def _write_csv(path: Path, rows: list[dict]) -> Path:
    buf = io.StringIO()
    if rows:
        w = csv.DictWriter(buf, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    atomic_write_text(path, buf.getvalue())
    return path


def _fresh_dir(path: Path) -> Path:
    """An empty directory at `path` (a stage's output is rebuilt whole, as DVC does); an earlier one is removed
    only if dz wrote it."""
    return fresh_stage_dir(path, "pipeline")


def _stage_output(path: Path):
    """Build a stage's whole output in a temporary sibling, renamed over `path` when done (dzmodel/outputs.py)."""
    return publish_dir(path, "pipeline", flag="stage output", override="")


def files_under(root: Path) -> list[tuple[str, Path]]:
    """(name relative to `root`, path) of every file under a directory, or the file itself; [] if absent."""
    root = Path(root)
    if root.is_file():
        return [(root.name, root)]
    return [(str(p.relative_to(root)), p) for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != OWNER_MARKER] if root.exists() else []  # the marker is not an output


def fingerprint(*paths: Path) -> str:
    """A cheap content fingerprint of files/directories: relative path, size and mtime of every file."""
    h = hashlib.sha256()
    for root in paths:
        h.update(str(Path(root).name).encode())
        for name, f in files_under(root):
            st = f.stat()
            h.update(f"{name}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


# --- stages -----------------------------------------------------------------------------------------------

def stage_fetch(prof: Profile, paths: StagePaths, log: Log = _print) -> dict:
    from .data.fetch import fetch_dataset
    from .data.lerobot_format import open_dataset

    f = prof.fetch
    synth = ({"num_episodes": f.synth_episodes, "episode_length": f.synth_length, "seed": f.seed}
             if f.source == "synthetic" else None)
    if synth is not None and f.synth_motion != "walk":  # absent by default: existing fetch markers stay valid
        synth["motion"] = f.synth_motion
    source = (str(paths.root / f.source) if f.source not in ("synthetic", "libero") and (paths.root / f.source).exists()
              else f.source)
    log(f"fetch: {source} -> {paths.dataset}")
    record = dict(vars(f.record), seed=f.seed) if f.source == "libero" else None
    if record is not None:  # options added later, absent where they change nothing: those fetch markers stay valid
        if record.get("dart_noise") == 0:
            record.pop("dart_noise")
        if record.get("init") == "standard":
            record.pop("min_shift_m", None)
    dest = fetch_dataset(source, paths.data, revision=f.revision, allow_patterns=f.allow or None,
                         synth_kwargs=synth, name="dataset", record_kwargs=record, retries=f.retries,
                         retry_delay_s=f.retry_delay_s, skip_missing=f.skip_missing)
    reader = open_dataset(dest)
    frames = sum(e.length for e in reader.episodes)
    log(f"fetch: {len(reader.episodes)} episodes, {frames} frames at {reader.fps:g} fps, views {reader.video_keys}")
    return {"dataset": str(dest), "episodes": len(reader.episodes), "frames": frames, "fps": reader.fps,
            "views": list(reader.video_keys)}


def stage_metadata(prof: Profile, paths: StagePaths, log: Log = _print) -> dict:
    from .data.dataset import embodiment_metadata
    from .data.embodiments import get_embodiment, load_embodiments

    m = prof.metadata
    emb = get_embodiment(m.embodiment, load_embodiments([str(paths.root / f) for f in m.embodiment_files]))
    out = _fresh_dir(paths.metadata.parent)
    # the statistics leave out the episodes training holds out, so the held-out evaluation stays unseen
    heldout = train_config(prof, paths).heldout_episodes
    doc = embodiment_metadata(paths.dataset, emb, paths.metadata, max_episodes=m.max_episodes, heldout_episodes=heldout)
    rows = []
    for group, entries in doc[emb.tag]["statistics"].items():
        for key, st in entries.items():
            for i in range(len(st["mean"])):
                rows.append({"group": group, "key": key, "dim": i, "mean": round(st["mean"][i], 5),
                             "std": round(st["std"][i], 5), "q01": round(st["q01"][i], 5), "q99": round(st["q99"][i], 5)})
    _write_csv(out / "statistics.csv", rows)
    entry = doc[emb.tag]
    log(f"metadata: {paths.metadata} [{emb.tag}], {len(rows)} normalised dims, from {entry['statistics_episodes']} "
        f"episodes (held out: {entry['heldout_episodes'] or 'none'})")
    return {"metadata": str(paths.metadata), "embodiment": emb.tag, "statistics": rows,
            "statistics_episodes": entry["statistics_episodes"], "heldout_episodes": entry["heldout_episodes"]}


def stage_vision(prof: Profile, paths: StagePaths, log: Log = _print) -> dict:
    """The offline presets' VAE pretrained on the dataset's frames (dzmodel/train/vision.py): cache and train load
    it through train.encoder_weights.vae (`train_config`). Disabled: an empty marker, and they keep their VAE."""
    out, v = paths.stage("vision"), prof.vision
    metrics_file = paths.run / "metrics" / "vision.json"
    if not v.enabled:
        _fresh_dir(out)
        atomic_write_text(out / "DISABLED", "vision.enabled is false: cache and train use the preset's seeded random "
                                            "VAE, or train.encoder_weights.vae\n")
        _write_json(metrics_file, {"pretrained": False})
        log("vision: disabled (vision.enabled: false)")
        return {"vision": None}
    from .train.vision import VAE_FILE, pretrain_vae

    assert paths.vision_vae.name == VAE_FILE
    with _stage_output(out) as tmp:
        report = pretrain_vae(train_config(prof, paths, vision_vae=False), tmp, steps=v.steps, batch_size=v.batch_size,
                              lr=v.lr, clip_frames=v.clip_frames, kl_weight=v.kl_weight,
                              heldout_episodes=v.heldout_episodes, device=v.device, num_workers=v.num_workers,
                              frame_cache_mib=v.frame_cache_mib, log=log)
    headline = {k: report[k] for k in ("steps", "heldout_mse", "heldout_mse_random", "heldout_mse_ratio",
                                       "heldout_mse_mean_colour", "seconds")}
    _write_json(metrics_file, {"pretrained": True, **headline})
    return {"vision": str(out), "vae": str(paths.vision_vae), **headline}


def _require_vision(prof: Profile, paths: StagePaths, stage: str) -> None:
    if prof.vision.enabled and not paths.vision_vae.is_file():
        raise FileNotFoundError(f"{stage}: vision.enabled, but {paths.vision_vae} is missing (run the vision stage)")


def stage_cache(prof: Profile, paths: StagePaths, log: Log = _print) -> dict:
    out = paths.stage("cache")
    if not prof.cache.enabled:
        _fresh_dir(out)
        atomic_write_text(out / "DISABLED", "cache.enabled is false: train encodes each batch online\n")
        log("cache: disabled (cache.enabled: false)")
        return {"cache": None}
    from .train.cache import build_cache

    from .model.args import OFFLINE_PRESETS
    from .model.tokenizer import build_tiny_tokenizer

    _require_vision(prof, paths, "cache")
    cfg = train_config(prof, paths)  # offline presets: tokenizer = runs/<profile>/tokenizer, built here
    cfg.cache = None
    if not cfg.tokenizer:
        raise ValueError(f"profiles.{paths.profile}.train.tokenizer: the cache needs the tokenizer directory")
    if cfg.preset in OFFLINE_PRESETS and Path(cfg.tokenizer) == paths.run / "tokenizer":
        build_tiny_tokenizer(paths.run / "tokenizer")  # deterministic bytes: rebuilding changes nothing
    build_cache(cfg, out, stride=prof.cache.stride, batch_size=prof.cache.batch_size,
                device="cuda" if _cuda() else "cpu", command="pipeline")
    log(f"cache: wrote {out}")
    return {"cache": str(out)}


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def torchrun_command(config: Path, nproc_per_node: int, nnodes: int = 1) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc_per_node}"]
    if nnodes > 1:  # several nodes: the rendezvous comes from the environment (Slurm/PyTorchJob set it)
        cmd += [f"--nnodes={nnodes}", "--rdzv_backend=c10d",
                f"--rdzv_endpoint={os.environ.get('DZ_RDZV_ENDPOINT', 'localhost:29400')}",
                f"--rdzv_id={os.environ.get('DZ_RDZV_ID', 'dz-train')}"]
    else:
        cmd += ["--standalone"]
    return cmd + ["-m", "dzmodel.cli", "train", "--config", str(config)]


TERM_GRACE_S = 30.0  # how long an interrupted command may take to stop after SIGTERM before it is killed


def run_streaming(cmd: list[str], log: Log, env: dict | None = None, cwd: Path | None = None,
                  on_poll: Callable[[], None] | None = None) -> int:
    """Run `cmd`, passing each output line (tqdm's carriage-return updates included) to `log`."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                            start_new_session=True)
    assert proc.stdout is not None
    done = threading.Event()

    def poll():
        while not done.wait(2.0):
            on_poll()

    poller = threading.Thread(target=poll, daemon=True) if on_poll else None
    if poller:
        poller.start()
    buf = b""
    try:
        while chunk := proc.stdout.read1(65536) if hasattr(proc.stdout, "read1") else proc.stdout.read(4096):
            buf += chunk
            *lines, buf = re.split(rb"[\r\n]", buf)
            for line in lines:
                if line.strip():
                    log(line.decode(errors="replace"))
        if buf.strip():
            log(buf.decode(errors="replace"))
        return proc.wait()
    except BaseException:  # interrupted: take the command down with us (torchrun forwards SIGTERM to its workers)
        import signal

        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=TERM_GRACE_S)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:  # the whole tree: torchrun's workers are in other process groups
            kill_tree(proc.pid)
            try:  # and, as before, the group: members whose parent already exited are no longer in the tree
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        raise
    finally:
        done.set()
        if poller:
            poller.join()
        if on_poll:
            on_poll()


def read_metrics(path: Path) -> list[dict]:
    """metrics.jsonl rows, the last one per step (a resumed run re-logs the steps after its checkpoint)."""
    if not path.is_file():
        return []
    by_step: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            by_step[int(row["step"])] = row
    return [by_step[s] for s in sorted(by_step)]


class MetricsFollower:
    """Calls `on_rows(new_rows)` with metrics.jsonl rows not seen before (for live MLflow logging)."""

    def __init__(self, path: Path, on_rows: Callable[[list[dict]], None]):
        self.path, self.on_rows, self.offset = path, on_rows, 0

    def __call__(self) -> None:
        if not self.path.is_file():
            return
        with self.path.open() as f:
            f.seek(self.offset)
            text = f.read()
        complete = text[: text.rfind("\n") + 1]
        self.offset += len(complete.encode())
        rows = [json.loads(line) for line in complete.splitlines() if line.strip()]
        if rows:
            self.on_rows(rows)


def stage_train(prof: Profile, paths: StagePaths, log: Log = _print,
                on_metrics: Callable[[list[dict]], None] | None = None) -> dict:
    _require_vision(prof, paths, "train")
    cfg = train_config(prof, paths)
    _start_fresh_if_changed(cfg, paths, log)
    _write_json(paths.train_config, cfg.to_dict())
    launch = prof.launch
    cmd = torchrun_command(paths.train_config, launch["nproc_per_node"], launch["nnodes"])
    log("train: " + " ".join(cmd))
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONUNBUFFERED="1",
               TQDM_MININTERVAL=os.environ.get("TQDM_MININTERVAL", "5"))
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    follower = MetricsFollower(Path(cfg.out_dir) / "metrics.jsonl", on_metrics) if on_metrics else None
    started = time.time()
    rc = run_streaming(cmd, log, env=env, on_poll=follower)
    if rc != 0:
        raise StageError(f"train: torchrun exited with code {rc} (its log is above; the run resumes from "
                           f"{cfg.out_dir} when restarted)")
    return summarize_training(paths, cfg.out_dir, time.time() - started, prof)


def content_fingerprint(*paths: Path, small: int = 1 << 20) -> str:
    """Like `fingerprint` but blind to mtimes: small files by content, large ones by size."""
    h = hashlib.sha256()
    for root in paths:
        for name, f in files_under(root):
            size = f.stat().st_size
            h.update(f"{name}:{size}:".encode())
            if size <= small:
                h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _start_fresh_if_changed(cfg, paths: StagePaths, log: Log) -> None:
    """Resume a run only under the config and the data it started with: its checkpoints belong to that
    trajectory. After a change in either (any field, `steps` too: it shapes the schedule) the old run is moved
    aside to runs/<profile>/superseded/ (never deleted) and a clean one starts. A run the pipeline did not start
    (Slurm, a PyTorchJob) is adopted when its newest checkpoint was saved under the same config."""
    out = Path(cfg.out_dir)
    inputs = {"config": _trajectory(cfg.to_dict()),
              "data": content_fingerprint(paths.dataset, paths.metadata, *([Path(cfg.cache)] if cfg.cache else []))}
    if cfg.encoder_weights.get("vae") == str(paths.vision_vae) and paths.vision_vae.is_file():
        # a retrained VAE keeps its path: its bytes say whether the checkpoints were trained on it
        inputs["vision_vae"] = hashlib.sha256(paths.vision_vae.read_bytes()).hexdigest()[:16]
    record = paths.run / "train_inputs.json"
    if out.exists() and any(out.iterdir()):
        old = json.loads(record.read_text()) if record.is_file() else None
        if old is None:
            from .train.checkpoint import latest_checkpoint

            ckpt = latest_checkpoint(out)
            state = ckpt / "trainer_state.json" if ckpt is not None else None
            saved = json.loads(state.read_text()).get("config") if state is not None and state.is_file() else None
            if saved is not None and _trajectory(saved) == inputs["config"]:
                old = inputs  # started outside the pipeline with this very config: continue it
        if old == inputs:
            log(f"train: resuming {out} (same config and data) from its newest checkpoint, if any")
            _write_json(record, inputs)
            return
        stamp = time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())
        aside, n = paths.run / "superseded" / f"train-{stamp}", 1
        while aside.exists():
            aside, n = paths.run / "superseded" / f"train-{stamp}-{n}", n + 1
        aside.parent.mkdir(parents=True, exist_ok=True)
        with directory_lock(out, wait=False, what="a running `dz train`"):  # never move a live run's directory
            out.replace(aside)
        log(f"train: the train config or its data changed since {out} was written; it moved to {aside}, "
            "and a fresh run starts")
    _write_json(record, inputs)


def _trajectory(config: dict) -> dict:
    """The config fields that shape the training trajectory (not the progress bar or a stop-early point)."""
    d = json.loads(json.dumps(config))
    for key in ("progress", "stop_at"):
        d.pop(key, None)
    return d


def summarize_training(paths: StagePaths, out_dir: str | Path, wall_s: float | None = None,
                       prof: Profile | None = None) -> dict:
    from .train.checkpoint import list_checkpoints

    rows = read_metrics(Path(out_dir) / "metrics.jsonl")
    if not rows:
        raise StageError(f"{out_dir}/metrics.jsonl: training logged no steps")
    steady = rows[1:] or rows  # the first step includes compilation and warm-up
    mean = lambda key: sum(r[key] for r in steady) / len(steady)  # noqa: E731
    summary = {
        "steps": rows[-1]["step"], "loss": rows[-1]["loss"], "action_loss": rows[-1]["action_loss"],
        "dynamics_loss": rows[-1]["dynamics_loss"], "samples_per_s_per_gpu": round(mean("samples_per_s_per_gpu"), 4),
        "mfu": round(mean("mfu"), 5) if all("mfu" in r for r in steady) else None,  # None: CPU or unknown GPU
        "peak_mem_gib": round(max(r["peak_mem_gib"] for r in rows), 3),
        "checkpoints": [s for s, _ in list_checkpoints(out_dir)],
    }
    if wall_s is not None:
        summary["wall_s"] = round(wall_s, 1)
    if prof is not None:
        summary["world_size"] = prof.launch["nproc_per_node"] * prof.launch["nnodes"]
    _write_json(paths.run / "metrics" / "train.json", summary)
    plots = paths.run / "plots"
    _write_csv(plots / "train_losses.csv", [{"step": r["step"], "loss": r["loss"], "action_loss": r["action_loss"],
                                              "dynamics_loss": r["dynamics_loss"]} for r in rows])
    _write_csv(plots / "train_throughput.csv", [{"step": r["step"], "samples_per_s_per_gpu": r["samples_per_s_per_gpu"],
                                                  "mfu": r.get("mfu"), "peak_mem_gib": r["peak_mem_gib"]} for r in rows])
    images = plot_training(rows, plots)
    return {"train_dir": str(out_dir), "summary": summary, "metrics_file": str(paths.run / "metrics" / "train.json"),
            "plots": [str(p) for p in images]}


def plot_training(rows: list[dict], out: Path) -> list[Path]:
    """losses.png (loss, action, dynamics vs step) and throughput.png (samples/s/GPU and MFU vs step)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    steps = [r["step"] for r in rows]
    written = []
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, style in (("loss", "-"), ("action_loss", "--"), ("dynamics_loss", ":")):
        ax.plot(steps, [r[key] for r in rows], style, marker=".", label=key)
    ax.set_xlabel("step"), ax.set_ylabel("flow-matching loss"), ax.set_title("training losses")
    ax.grid(alpha=0.3), ax.legend()
    written.append(_save(fig, out / "losses.png"))
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r["samples_per_s_per_gpu"] for r in rows], marker=".", color="tab:blue")
    ax.set_xlabel("step"), ax.set_ylabel("samples/s/GPU", color="tab:blue"), ax.set_title("throughput")
    if all("mfu" in r for r in rows):
        ax2 = ax.twinx()
        ax2.plot(steps, [100 * r["mfu"] for r in rows], marker=".", color="tab:orange")
        ax2.set_ylabel("MFU (%)", color="tab:orange")
    ax.grid(alpha=0.3)
    written.append(_save(fig, out / "throughput.png"))
    plt.close("all")
    return written


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    tmp.replace(path)
    return path


def stage_convert(prof: Profile, paths: StagePaths, log: Log = _print) -> dict:
    from .train.checkpoint import list_checkpoints
    from .train.convert import convert_checkpoint
    from .train.metrics import Progress

    saved = list_checkpoints(paths.stage("train"))
    if not saved:
        raise FileNotFoundError(f"{paths.stage('train')}: no complete checkpoint to convert (run the train stage)")
    out = paths.stage("converted")
    with _stage_output(out) as tmp:
        progress = Progress(len(saved), desc="convert", unit="ckpt")
        for step, ckpt in saved:
            convert_checkpoint(ckpt, tmp / f"step_{step:07d}", max_shard_bytes=int(prof.convert.max_shard_gib * 2**30),
                               weights=prof.convert.weights)
            progress.update()
        progress.close()
    log(f"convert: {len(saved)} checkpoints -> {out}")
    return {"converted": str(out), "steps": [s for s, _ in saved]}


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
    from .model.inference import SolverConfig

    return SolverConfig(num_steps=e.solver_steps, cfg_scale=e.cfg_scale, dit_steps=e.dit_steps)


def stage_action_error(prof: Profile, paths: StagePaths, out: Path, log: Log = _print) -> dict:
    """The held-out action error of every converted step (part of the eval stage); skipped, saying why, when the
    run held no episode out."""
    from .eval.action_error import describe, evaluate_action_error
    from .eval.policy import read_train_config

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
    _write_csv(paths.run / "plots" / "action_error_vs_step.csv",
               [{"step": r["step"], "action_error": r["trained"], "mean_predictor": result["mean_predictor"],
                 "untrained": result["untrained"]} for r in result["steps"]])
    log("eval: " + describe(result))
    return {"measured": True, **result}


def stage_previews(prof: Profile, paths: StagePaths, out: Path, log: Log = _print) -> list[dict] | None:
    """World-model previews of every converted step (part of the eval stage); skipped, saying why, when the run
    held no episode out."""
    from .eval.policy import read_train_config
    from .eval.previews import describe_errors, write_previews

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


def stage_eval(prof: Profile, paths: StagePaths, log: Log = _print) -> dict:
    e = prof.eval
    out = _fresh_dir(paths.stage("eval"))
    metrics_file = paths.run / "metrics" / "eval.json"
    plots = paths.run / "plots"
    action = stage_action_error(prof, paths, out / "action_error", log) if e.action_error else None
    previews = stage_previews(prof, paths, out / "previews", log) if e.previews else None
    if action is None or not action["measured"]:
        _write_csv(plots / "action_error_vs_step.csv", [])
    if not e.enabled:
        atomic_write_text(out / "DISABLED", "eval.enabled is false (LIBERO rollouts)\n")
        _write_json(metrics_file, {"evaluated": False, **action_error_metrics(action)})
        _write_csv(plots / "success_vs_step.csv", [])
        log("eval: LIBERO disabled (eval.enabled: false)")
        return {"eval_dir": str(out), "evaluated": False, "rows": [], "best": None, "action_error": action,
                "previews": previews}
    from .eval.libero_eval import EvalConfig, evaluate_run

    from .eval.libero_eval import pooled

    cfg = EvalConfig(suite=e.suite, tasks=e.tasks, episodes_per_task=e.episodes, max_steps=e.max_steps,
                     num_workers=e.workers, camera_size=e.camera_size, actions_per_chunk=e.actions_per_chunk,
                     videos=e.videos, seed=e.seed, context=e.context)

    def evaluate(config: EvalConfig, where: Path, steps: list[int] | None) -> list[dict]:
        return evaluate_run(paths.stage("converted"), config, where, steps=steps, device=e.device,
                            solver=eval_solver(e), embodiment=prof.metadata.embodiment)

    picked = None
    if e.select_episodes:  # pick on init states the reported number never sees
        selection = evaluate(dataclasses.replace(cfg, first_init_state=e.episodes, episodes_per_task=e.select_episodes,
                                                 videos=0), out / "selection", e.steps)
        picked = max((r for r in selection if r["task"] == "all"), key=lambda r: (r["rate"], r["step"] or 0))
        log(f"eval: step {picked['step']} picked on init states {e.episodes}..{e.episodes + e.select_episodes - 1} "
            f"({picked['rate']:.0%})")
        rows = evaluate(cfg, out, [picked["step"]] if picked["step"] is not None else None)
    else:
        rows = evaluate(cfg, out, e.steps)
    overall = [r for r in rows if r["task"] == "all"]
    best = max(overall, key=lambda r: (r["rate"], r["step"] or 0)) if overall else None
    if picked is not None:
        final = overall[-1]
        rule = (f"step {picked['step']}, picked on init states {e.episodes}..{e.episodes + e.select_episodes - 1}, "
                f"reported on 0..{e.episodes - 1}")
    else:
        last = [r["step"] for r in overall][-3:]
        final = pooled(overall, last) if overall else None
        rule = f"the last {len(last)} checkpoints pooled (none picked)"
    _write_json(metrics_file, {"evaluated": True, "suite": e.suite, "best_step": best["step"] if best else None,
                               "best_success_rate": best["rate"] if best else None,
                               "last_success_rate": overall[-1]["rate"] if overall else None,
                               "episodes_per_step": overall[-1]["episodes"] if overall else 0,
                               "picked_step": picked["step"] if picked else None,
                               "final_success_rate": final["rate"] if final else None,
                               "final_ci_low": final["ci_low"] if final else None,
                               "final_ci_high": final["ci_high"] if final else None,
                               "final_rule": rule,
                               **action_error_metrics(action)})
    _write_csv(plots / "success_vs_step.csv", [{"step": r["step"], "success_rate": r["rate"]} for r in overall])
    if (out / "success_vs_step.png").is_file():
        shutil.copyfile(out / "success_vs_step.png", plots / "success_vs_step.png")
    log("eval: " + ", ".join(f"step {r['step']}: {r['rate']:.0%}" for r in overall)
        + (f"; final {final['rate']:.1%} (95 % {final['ci_low']:.0%}-{final['ci_high']:.0%}): {rule}" if final else ""))
    return {"eval_dir": str(out), "evaluated": True, "rows": rows, "best": best, "action_error": action,
            "previews": previews,
            "plot": str(plots / "success_vs_step.png") if (plots / "success_vs_step.png").is_file() else None}


def chosen_step(prof: Profile, paths: StagePaths) -> tuple[int, float | None]:
    """The converted step to package (`package.checkpoint`: best = the step picked on the selection init states,
    else the best by eval success, ties to the later step; or the last one) and the success rate the promotion
    gate reads: the eval's final number (picked on other init states, or the last 3 checkpoints pooled)."""
    converted = sorted(int(p.name.split("_")[1]) for p in paths.stage("converted").glob("step_*")
                       if (p / "config.json").is_file())
    if not converted:
        raise FileNotFoundError(f"{paths.stage('converted')}: no converted model (run the convert stage)")
    metrics = paths.run / "metrics" / "eval.json"
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


def stage_package(prof: Profile, paths: StagePaths, log: Log = _print) -> dict:
    from .serve.package import RobotConfig, build_package

    step, rate = chosen_step(prof, paths)
    model = paths.stage("converted") / f"step_{step:07d}"
    out = paths.stage("package")
    eval_dir = paths.stage("eval")
    has_eval = (eval_dir / "results.csv").is_file()
    with _stage_output(out) as tmp:
        bundle, tarball = build_package(model, tmp, RobotConfig.from_dict(prof.package.robot, "package.robot"),
                                        prof.package.version, eval_dir if has_eval else None, prof.package.name)
    bundle, tarball = out / bundle.relative_to(tmp), out / tarball.relative_to(tmp)
    action = packaged_action_error(paths, step)
    _write_json(out / "PACKAGE.json", {"step": step, "success_rate": rate, "bundle": bundle.name,
                                       "tarball": tarball.name, "version": prof.package.version,
                                       "action_error": action})
    log(f"package: step {step} -> {tarball}")
    return {"bundle": str(bundle), "tarball": str(tarball), "step": step, "success_rate": rate,
            "model": str(model), "version": prof.package.version, "action_error": action}


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


STAGE_FUNCTIONS: dict[str, Callable[..., dict]] = {
    "fetch": stage_fetch, "metadata": stage_metadata, "vision": stage_vision, "cache": stage_cache, "train": stage_train,
    "convert": stage_convert, "eval": stage_eval, "package": stage_package,
}


def stage_outputs(name: str, paths: StagePaths) -> list[Path]:
    """What a stage writes (the outs dvc.yaml declares for it)."""
    return {"fetch": [paths.dataset], "metadata": [paths.metadata.parent]}.get(name, [paths.stage(
        {"convert": "converted"}.get(name, name))])


def _record(name: str, paths: StagePaths) -> Path:
    return paths.run / "stages" / f"{name}.json"


# stages whose outputs are rebuilt whole (fetch has its own marker; train's run directory is resumed, never rebuilt)
REBUILT_STAGES = ("metadata", "vision", "cache", "convert", "eval", "package")


def _adopt_earlier_outputs(name: str, paths: StagePaths) -> None:
    """Outputs that this stage wrote before directories carried the ownership marker: its record says so."""
    if name not in REBUILT_STAGES or not _record(name, paths).is_file():
        return
    for out in stage_outputs(name, paths):
        if out.is_dir() and owner(out) is None:
            mark(out, "pipeline")


def run_stage(name: str, prof: Profile, paths: StagePaths, log: Log = _print, **kwargs) -> dict:
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
    _write_json(_record(name, paths), result)
    return result


def outputs_intact(name: str, paths: StagePaths) -> bool:
    """The stage's outputs are there and unchanged since its last recorded run (else a cached result lies)."""
    record = _record(name, paths)
    if not record.is_file() or not all(p.exists() for p in stage_outputs(name, paths)):
        return False
    try:
        recorded = json.loads(record.read_text()).get("outputs_fingerprint")
    except json.JSONDecodeError:
        return False
    return recorded == fingerprint(*stage_outputs(name, paths))


def stage_params(prof: Profile, name: str) -> dict:
    """The params a stage reads (dzmodel/stages.py), for its cache key."""
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
