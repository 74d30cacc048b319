"""Prefect artifacts for the pipeline's stages: markdown tables and embedded plots in the Prefect UI."""

from __future__ import annotations

import base64
from pathlib import Path

from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact


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


def eval_artifact(profile: str, result: dict, plots: Path | None = None) -> None:
    """Tables (Prefect table artifacts: success per task and step, held-out action error per step) and a markdown
    summary with the plots."""
    action = result.get("action_error") or {}
    md = ""
    if action.get("measured"):
        rows = [{"step": r["step"], "action_error": r["trained"], "ratio_vs_mean_predictor": r["ratio"]}
                for r in action["steps"]]
        references = (f"mean predictor {action['mean_predictor']:.4g}"
                      + (f", untrained {action['untrained']:.4g}" if action.get("untrained") is not None else ""))
        create_table_artifact(rows, key=_key(profile, "action-error"),
                              description=f"held-out action error per step ({action['windows']} windows; {references})")
        md += (f"### Held-out action error per checkpoint step\n\n{action['windows']} windows; {references}\n\n"
               + _table(rows, ["step", "action_error", "ratio_vs_mean_predictor"]))
        md += _image(plots / "action_error_vs_step.png" if plots else None, "action error vs step")
    if not result.get("evaluated"):
        md = "### LIBERO evaluation\n\ndisabled in this profile\n\n" + md
        create_markdown_artifact(md, key=_key(profile, "eval"), description="LIBERO disabled; held-out action error")
        return
    rows = result.get("curve") or result["rows"]  # every evaluated step, the curve's earlier ones included
    columns = ["step", "task", "task_name", "episodes", "successes", "rate", "ci_low", "ci_high"]
    create_table_artifact([{c: r.get(c) for c in columns} for r in rows], key=_key(profile, "eval-success"),
                          description="LIBERO success per task and checkpoint step, with 95 % Wilson intervals")
    md = "### LIBERO success rate per checkpoint step\n\n" + _table(rows, columns) + _image(
        result.get("plot"), "success vs step") + ("\n" + md if md else "")
    create_markdown_artifact(md, key=_key(profile, "eval"), description="success rate across checkpoint steps")


def package_artifact(profile: str, result: dict, decision: dict | None) -> None:
    md = (f"### Franka deployment package\n\n- tarball: `{result['tarball']}`\n- step {result['step']}, "
          f"LIBERO success {_cell(result['success_rate'])}\n")
    if decision:
        md += (f"- registry: `{decision['registered_model']}` version {decision['version']}; "
               f"alias `{decision['alias']}`: **{decision['reason']}**\n")
    create_markdown_artifact(md, key=_key(profile, "package"), description="bundle and promotion")


def summary_artifact(profile: str, stage: str, result: dict) -> None:
    """A stage's headline numbers (its result's `summary`), for a stage with no artifact of its own."""
    summary = result.get("summary") or {}
    rows = [{"metric": k, "value": v} for k, v in summary.items() if isinstance(v, (int, float, str))]
    if rows:
        create_markdown_artifact(f"### {stage}\n\n" + _table(rows, ["metric", "value"]), key=_key(profile, stage),
                                 description=f"the {stage} stage's summary")


def stage_artifact(profile: str, stage: str, result: dict, paths, mlflow_link: str | None) -> None:
    """The Prefect artifact of a stage that just finished: its own (`STAGE_ARTIFACTS`), else its summary's numbers.
    """
    made = STAGE_ARTIFACTS.get(stage)
    if made is None:
        summary_artifact(profile, stage, result)
    else:
        made(profile, result, paths, mlflow_link)


STAGE_ARTIFACTS = {
    "metadata": lambda profile, result, paths, link: metadata_artifact(profile, result),
    "train": lambda profile, result, paths, link: train_artifact(profile, result, link),
    "eval": lambda profile, result, paths, link: eval_artifact(profile, result, paths.plots("eval")),
    # after registration instead (`package_artifact`, with the promotion decision)
    "package": lambda profile, result, paths, link: None,
}


def mlflow_link_artifact(profile: str, link: str) -> None:
    create_link_artifact(link, link_text="the pipeline's MLflow run", key=_key(profile, "mlflow-run"))
