"""Prefect artifacts for the pipeline's stages: markdown tables and embedded plots in the Prefect UI."""

from __future__ import annotations

import base64
from pathlib import Path

from prefect.artifacts import create_link_artifact, create_markdown_artifact


def _key(profile: str, name: str) -> str:
    # keys: lowercase letters, digits and dashes; the same key across runs makes a history in the UI
    return f"{profile}-{name}".lower().replace("_", "-")


def _table(rows: list[dict], columns: list[str]) -> str:
    head = "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns) + "\n"
    return head + "".join("| " + " | ".join(_cell(r.get(c)) for c in columns) + " |\n" for r in rows)


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


def _image(path: str | Path | None, alt: str) -> str:
    """A PNG inlined as a data URI (the Prefect UI renders markdown; it cannot reach the runner's files)."""
    if not path or not Path(path).is_file():
        return ""
    data = base64.b64encode(Path(path).read_bytes()).decode()
    return f"\n![{alt}](data:image/png;base64,{data})\n"


def metadata_artifact(profile: str, result: dict) -> None:
    rows = result["statistics"]
    md = f"### Normalisation statistics ({result['embodiment']})\n\n`{result['metadata']}`\n\n"
    md += _table(rows, ["group", "key", "dim", "mean", "std", "q01", "q99"])
    create_markdown_artifact(md, key=_key(profile, "metadata-stats"), description="per-dimension statistics")


def train_artifact(profile: str, result: dict, mlflow_link: str | None) -> None:
    s = result["summary"]
    rows = [{"metric": k, "value": s[k]} for k in ("steps", "loss", "action_loss", "dynamics_loss",
                                                     "samples_per_s_per_gpu", "mfu", "peak_mem_gib",
                                                     "world_size", "wall_s") if s.get(k) is not None]
    md = "### Training\n\n" + _table(rows, ["metric", "value"])
    md += f"\ncheckpoints at steps {s['checkpoints']} in `{result['train_dir']}`\n"
    if mlflow_link:
        md += f"\nMLflow: {mlflow_link}\n"
    for plot in result.get("plots", []):
        md += _image(plot, Path(plot).stem)
    create_markdown_artifact(md, key=_key(profile, "train"), description="losses, throughput, MFU")


def eval_artifact(profile: str, result: dict) -> None:
    if not result.get("evaluated"):
        create_markdown_artifact("### LIBERO evaluation\n\ndisabled in this profile", key=_key(profile, "eval"))
        return
    rows = [r for r in result["rows"]]
    md = "### LIBERO success rate per checkpoint step\n\n" + _table(rows, ["step", "task", "task_name", "episodes",
                                                                          "successes", "rate"])
    md += _image(result.get("plot"), "success vs step")
    create_markdown_artifact(md, key=_key(profile, "eval"), description="success rate across checkpoint steps")


def package_artifact(profile: str, result: dict, decision: dict | None) -> None:
    md = (f"### Franka deployment package\n\n- tarball: `{result['tarball']}`\n- step {result['step']}, "
          f"LIBERO success {_cell(result['success_rate'])}\n")
    if decision:
        md += (f"- registry: `{decision['registered_model']}` version {decision['version']}; "
               f"alias `{decision['alias']}`: **{decision['reason']}**\n")
    create_markdown_artifact(md, key=_key(profile, "package"), description="bundle and promotion")


def mlflow_link_artifact(profile: str, link: str) -> None:
    create_link_artifact(link, link_text="the pipeline's MLflow run", key=_key(profile, "mlflow-run"))
