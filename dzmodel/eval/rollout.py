"""The LIBERO rollouts of a policy, declared once: which episodes, and how each runs.

The eval stage's `eval:` section extends `RolloutParams` (`config.EvalParams`), `dz eval libero` builds its options
from its fields (`add_rollout_arguments`), and the evaluator takes a `libero_eval.EvalConfig`, which extends it with
what only the evaluator knows. The same field has the same name, range and help everywhere. Standard library only.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from ..schema import SEED

# Tasks per LIBERO suite (LIBERO's benchmarks libero_spatial/object/goal/10 each have 10 tasks): the static bounds of
# eval.tasks and fetch.record.tasks.
LIBERO_SUITE_TASKS = {"spatial": 10, "object": 10, "goal": 10, "10": 10}


def check_suite_tasks(tasks: list[int] | None, suite: str, where: str) -> None:
    """Task indices inside the suite, each once; `where` names the field ("eval.tasks")."""
    size = LIBERO_SUITE_TASKS[suite]
    for i, task in enumerate(tasks or []):
        if not 0 <= task < size:
            raise ValueError(f"{where}[{i}]: task {task} is not in LIBERO-{suite} (tasks 0..{size - 1})")
    for task in tasks or []:
        if tasks.count(task) > 1:
            raise ValueError(f"{where}: task {task} is listed twice")


@dataclass
class RolloutParams:
    """LIBERO rollouts of a policy: which episodes, and how each runs. Declared once: the eval stage's `eval:` section
    extends it (EvalParams), `dz eval libero` builds its options from it, and the evaluator takes it (EvalConfig).
    Each field's `help` is its command-line help."""
    suite: Literal["spatial", "object", "goal", "10"] = field(
        default="spatial", metadata={"choices": ("spatial", "object", "goal", "10"), "help": "the LIBERO suite"})
    tasks: list[int] | None = field(  # task indices; null = every task of the suite
        default=None, metadata={"min": 0, "help": "task indices, e.g. 0,1 (default: all tasks of the suite)"})
    episodes: int = field(default=1, metadata={  # per task
        "min": 1, "max": 10_000, "help": "episodes per task (the standard init states 0..N-1)"})
    max_steps: int | None = field(default=None, metadata={  # null = the suite's standard limit
        "min": 1, "help": "policy steps per episode (default: the suite's standard limit)"})
    workers: int = field(default=2, metadata={  # env processes; 0: one per CPU core
        "min": 0, "max": 256, "help": "env worker processes (0: one per CPU core)"})
    camera_size: int = field(default=128, metadata={
        "min": 16, "max": 1024, "help": "height and width of the sim cameras, in pixels"})
    actions_per_chunk: int | None = field(default=None, metadata={
        "min": 1, "help": "execute this many actions of each chunk (default: all)"})
    # episode: one KV-cache session per episode fed the frames since the last query; frame: restart every query
    context: Literal["episode", "frame"] = field(default="episode", metadata={
        "choices": ("episode", "frame"), "help": "episode: one session per episode, each query sends the frames since the last (the KV cache holds the "
                "history, as in training); frame: restart from the current frame at every query"})
    videos: int = field(default=2, metadata={
        "min": 0, "max": 1000, "help": "record this many episodes per step as mp4"})
    seed: int = field(default=0, metadata={
        **SEED, "help": "random seed of the env resets, the perturbations and the policy's sampling noise"})
    # robustness perturbations (dzmodel/eval/libero_perturb.py), each NAME or NAME=VALUE: position, swap, camera,
    # light, table, paraphrase, distractor; the reported episodes run again under each (robustness.csv). Empty: none.
    perturb: list[str] = field(default_factory=list, metadata={
        "help": "robustness: also run the same episodes under each perturbation (repeatable): position[=M], "
                "swap[=task|any], camera[=DEG], light[=F], table[=COLOUR|random], paraphrase[=1|2|3|random], "
                "distractor[=N]; writes robustness.csv (docs/eval.md, Robustness)"})

    def rollout(self) -> dict:
        """This object's RolloutParams fields by name (what EvalConfig is built from)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(RolloutParams)}


def add_rollout_arguments(parser: argparse.ArgumentParser) -> None:
    """One option per RolloutParams field (`--max-steps` for max_steps), with its default and help; lists are
    comma-separated (`--tasks 0,1`) except `--perturb`, which repeats."""
    for f in dataclasses.fields(RolloutParams):
        flag = "--" + f.name.replace("_", "-")
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        kind = f.type if isinstance(f.type, str) else str(f.type)
        if f.name == "perturb":
            parser.add_argument(flag, action="append", metavar="NAME[=VALUE][,...]", help=f.metadata["help"])
        elif "choices" in f.metadata:
            parser.add_argument(flag, choices=f.metadata["choices"], default=default, help=f.metadata["help"])
        elif kind.startswith("list"):
            parser.add_argument(flag, help=f.metadata["help"])
        else:
            parser.add_argument(flag, type=int, default=default, help=f.metadata["help"])


