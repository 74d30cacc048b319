"""The train stage: torchrun over `dz train`, resumed under the same config and data, and its summary and plots."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ..atomic import save_figure
from ..config import Profile, StagePaths, train_config
from ..dirlock import directory_lock
from ..proctree import kill_tree
from ..stage_table import STAGE_TABLE
from ..train import launch
from .common import (Log, StageError, content_fingerprint, cuda_available, print_line, require_vision, write_csv,
                     write_json)

LOSSES_PLOT, THROUGHPUT_PLOT = STAGE_TABLE["train"].plots  # declared in the stage table (dvc.yaml's plots)


def torchrun_command(config: Path, nproc_per_node: int, nnodes: int = 1) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc_per_node}"]
    if nnodes > 1:  # several nodes: the rendezvous comes from the environment (Slurm/PyTorchJob set it)
        cmd += [f"--nnodes={nnodes}", "--rdzv_backend=c10d",
                f"--rdzv_endpoint={os.environ.get('DZ_RDZV_ENDPOINT', 'localhost:29400')}",
                f"--rdzv_id={os.environ.get('DZ_RDZV_ID', 'dz-train')}"]
    else:
        cmd += ["--standalone"]
    return cmd + ["-m", launch.__name__, "--config", str(config)]  # the stage's code: what launch imports


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


def stage_train(prof: Profile, paths: StagePaths, log: Log = print_line,
                on_metrics: Callable[[list[dict]], None] | None = None) -> dict:
    require_vision(prof, paths, "train")
    cfg = train_config(prof, paths)
    _start_fresh_if_changed(cfg, paths, log)
    write_json(paths.train_config, cfg.to_dict())
    topology = prof.launch
    cmd = torchrun_command(paths.train_config, topology["nproc_per_node"], topology["nnodes"])
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
    record = paths.home("train") / "train_inputs.json"
    if out.exists() and any(out.iterdir()):
        old = json.loads(record.read_text()) if record.is_file() else None
        if old is None:
            from ..train.checkpoint import latest_checkpoint, read_trainer_state

            ckpt = latest_checkpoint(out)
            state = ckpt / "trainer_state.json" if ckpt is not None else None
            saved = read_trainer_state(ckpt).get("config") if state is not None and state.is_file() else None
            if saved is not None and _trajectory(saved) == inputs["config"]:
                old = inputs  # started outside the pipeline with this very config: continue it
        if old == inputs:
            log(f"train: resuming {out} (same config and data) from its newest checkpoint, if any")
            write_json(record, inputs)
            return
        stamp = time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())
        aside, n = paths.home("train") / "superseded" / f"train-{stamp}", 1
        while aside.exists():
            aside, n = paths.home("train") / "superseded" / f"train-{stamp}-{n}", n + 1
        aside.parent.mkdir(parents=True, exist_ok=True)
        with directory_lock(out, wait=False, what="a running `dz train`"):  # never move a live run's directory
            out.replace(aside)
        log(f"train: the train config or its data changed since {out} was written; it moved to {aside}, "
            "and a fresh run starts")
    write_json(record, inputs)


def _trajectory(config: dict) -> dict:
    """The config fields that shape the training trajectory (not the progress bar or a stop-early point)."""
    d = json.loads(json.dumps(config))
    for key in ("progress", "stop_at"):
        d.pop(key, None)
    return d


def summarize_training(paths: StagePaths, out_dir: str | Path, wall_s: float | None = None,
                       prof: Profile | None = None) -> dict:
    from ..train.checkpoint import list_checkpoints

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
    summary["throughput_unit"] = throughput_unit(cuda_available())  # train ran on this machine's devices
    if wall_s is not None:
        summary["wall_s"] = round(wall_s, 1)
    if prof is not None:
        summary["world_size"] = prof.launch["nproc_per_node"] * prof.launch["nnodes"]
    write_json(paths.metrics("train"), summary)
    plots = paths.plots("train")
    write_csv(plots / "train_losses.csv", [{"step": r["step"], "loss": r["loss"], "action_loss": r["action_loss"],
                                              "dynamics_loss": r["dynamics_loss"]} for r in rows])
    write_csv(plots / "train_throughput.csv", [{"step": r["step"], "samples_per_s_per_gpu": r["samples_per_s_per_gpu"],
                                                  "mfu": r.get("mfu"), "peak_mem_gib": r["peak_mem_gib"]} for r in rows])
    images = plot_training(rows, plots, summary["throughput_unit"])
    return {"train_dir": str(out_dir), "summary": summary, "metrics_file": str(paths.metrics("train")),
            "plots": [str(p) for p in images]}


def smoothed(values: list[float], span: int | None = None) -> list[float]:
    """An exponential moving average (span: a tenth of the series), started at the first value."""
    span = span or max(1, len(values) // 10)
    alpha, out, mean = 2 / (span + 1), [], None
    for v in values:
        mean = v if mean is None else alpha * v + (1 - alpha) * mean
        out.append(mean)
    return out


def throughput_unit(on_gpu: bool) -> str:
    """What samples_per_s_per_gpu counts: per GPU on a GPU run, per process (each torchrun worker) on a CPU."""
    return "samples/s per GPU" if on_gpu else "samples/s per process (CPU)"


def plot_training(rows: list[dict], out: Path, unit: str = "samples/s per GPU") -> list[Path]:
    """losses.png (loss, action, dynamics vs step: smoothed, the raw values faint behind) and throughput.png
    (samples/s per GPU, or per process on a CPU, and MFU vs step)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    steps = [r["step"] for r in rows]
    written = []
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, color in (("loss", "tab:blue"), ("action_loss", "tab:orange"), ("dynamics_loss", "tab:green")):
        raw = [r[key] for r in rows]
        ax.plot(steps, raw, color=color, alpha=0.25, linewidth=0.8)
        ax.plot(steps, smoothed(raw), color=color, linewidth=2, label=f"{key} (smoothed)")
    ax.set_xlabel("step"), ax.set_ylabel("flow-matching loss")
    ax.set_title("training losses (faint: each logged step)")
    ax.grid(alpha=0.3), ax.legend()
    written.append(save_figure(fig, out / LOSSES_PLOT))
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r["samples_per_s_per_gpu"] for r in rows], marker=".", color="tab:blue")
    ax.set_xlabel("step"), ax.set_ylabel(unit, color="tab:blue"), ax.set_title(f"throughput ({unit})")
    if all("mfu" in r for r in rows):
        ax2 = ax.twinx()
        ax2.plot(steps, [100 * r["mfu"] for r in rows], marker=".", color="tab:orange")
        ax2.set_ylabel("MFU (%)", color="tab:orange")
    ax.grid(alpha=0.3)
    written.append(save_figure(fig, out / THROUGHPUT_PLOT))
    plt.close("all")
    return written
