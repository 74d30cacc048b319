"""The LIBERO recording of the scripted expert's demonstrations, declared once: which episodes, and how each runs.

The fetch stage's `fetch.record:` section is a `RecordParams` (`config.FetchParams.record`), `dz data record libero`
builds its options from its fields (`add_record_arguments`), and the recorder takes a `libero_record.RecordConfig`,
which extends it with what only the recorder knows (DAgger, which episodes to keep, the seed). The same field has
the same name, range and help everywhere; its range is checked from the field's metadata (`schema.field_problems`),
the rules between fields by `RecordParams.problems`. Standard library only.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass, field
from typing import Callable, Literal

from ..schema import field_problems
from .rollout import check_suite_tasks

SUITES = ("object", "spatial", "goal", "10")
INIT_MODES = ("standard", "perturbed", "sampled")
CODECS = ("libsvtav1", "libx264")
# LIBERO-Object's init regions are small (3 of the 7 objects sit at fixed spots, the others vary by about a
# centimetre), so a sampled start is typically ~5 mm from its nearest standard start: the default distance it must keep
SAMPLED_MIN_DISTANCE_M = 0.002


def option(name: str) -> str:
    """The command-line option of a field: `--max-shift-m` for max_shift_m."""
    return "--" + name.replace("_", "-")


@dataclass
class RecordParams:
    """LIBERO demonstrations recorded in simulation by the scripted expert (fetch.source "libero",
    `dz data record libero`). Each field's `help` is its command-line help. A field added after recordings existed is
    marked `absent_at_default`: the fetch stage leaves it out of what it hands the recorder (and of its cache marker)
    while it has its default, so the markers of those recordings stay valid; a new field needs the mark."""
    suite: Literal["object", "spatial", "goal", "10"] = field(default="object", metadata={
        "choices": SUITES, "help": "the LIBERO suite (a task with a goal term the expert has no skill for is "
                                   "refused by name)"})
    tasks: list[int] | None = field(default=None, metadata={  # null = every task of the suite
        "min": 0, "help": "task indices, e.g. 0,1,2 (default: every task of the suite)"})
    episodes: int = field(default=10, metadata={
        "min": 1, "max": 10_000, "help": "expert attempts per task; only successes are kept"})
    # perturbed and sampled keep min_shift_m from every standard init state
    init: Literal["standard", "perturbed", "sampled"] = field(default="standard", metadata={
        "choices": INIT_MODES, "help": "standard: the evaluation's init states 0..N-1; perturbed: seeded shifts of "
                                       "them by [min_shift_m, max_shift_m]; sampled: fresh draws from the task's "
                                       "init distribution"})
    max_shift_m: float = field(default=0.02, metadata={
        "min": 0, "max": 0.1, "help": "perturbed: bound of each object's x/y shift, in metres"})
    min_shift_m: float | None = field(default=None, metadata={
        "min": 0, "max": 0.1, "help": "perturbed: every object moves at least this much; perturbed and sampled: "
                                      "every standard init state is at least this far, in metres (default: "
                                      f"max_shift_m / 2 perturbed, {SAMPLED_MIN_DISTANCE_M} sampled)"})
    dart_noise: float = field(default=0.0, metadata={
        "min": 0, "max": 1, "absent_at_default": True, "metavar": "SIGMA",
        "help": "DART: execute the expert's action + N(0, SIGMA^2) on the 6 arm dims (clipped to [-1, 1]); the "
                "clean expert action is recorded"})
    retries: int = field(default=0, metadata={
        "min": 0, "max": 10, "absent_at_default": True,
        "help": "a failed attempt is tried again from the same start, with fresh expert and noise seeds, up to "
                "this many times; the start counts once"})
    retry_noise_scale: float = field(default=1.0, metadata={
        "min": 0, "max": 1, "absent_at_default": True, "metavar": "F",
        "help": "DART: each retry's SIGMA is the previous try's times F"})
    noise_pilot: int = field(default=0, metadata={
        "min": 0, "max": 10_000, "absent_at_default": True, "metavar": "N",
        "help": "DART with retries: the first N starts of each task are pilots; if none succeeded at the full "
                "SIGMA, the task's other starts begin at the SIGMA of the lowest retry where one did (0: off)"})
    # noise slows the expert: at σ 0.6 its successes take ~2x the steps
    max_steps: int | None = field(default=None, metadata={
        "min": 1, "max": 5000, "absent_at_default": True,
        "help": "steps per attempt (default: the suite's standard limit)"})
    image_size: int = field(default=256, metadata={
        "min": 32, "max": 1024, "help": "camera height and width in pixels, even (the public datasets use 256)"})
    workers: int = field(default=2, metadata={
        "min": 0, "max": 256, "help": "parallel env processes (0: one per CPU core)"})
    codec: Literal["libsvtav1", "libx264"] = field(default="libsvtav1", metadata={
        "choices": CODECS, "aliases": {"av1": "libsvtav1", "h264": "libx264"},
        "help": "the video codec; libx264 also decodes with OpenCV (av1 and h264 are accepted for them)"})
    gop: int = field(default=2, metadata={
        "min": 1, "max": 1000, "help": "keyframe interval (lerobot writes 2; longer = smaller files, slower seeks)"})

    def __post_init__(self) -> None:
        problems = ["record." + p for p in self.problems()]
        if problems:
            raise ValueError("; ".join(problems))

    def problems(self, name: Callable[[str], str] = str) -> list[str]:
        """What this recording's fields refuse: each field's range (its metadata), then the rules between fields;
        each problem names the field by `name(field)` (`option` for the command line's spelling)."""
        problems = [re.sub(r"^\w+", lambda m: name(m.group()), p, count=1) for p in field_problems(self)]
        if problems:  # the rules below read values inside their ranges
            return problems
        try:
            check_suite_tasks(self.tasks, self.suite, name("tasks"))
        except ValueError as exc:
            problems.append(str(exc))
        if self.image_size % 2:
            problems.append(f"{name('image_size')}: must be even (the videos are yuv420p), got {self.image_size}")
        if self.min_shift_m is not None and self.min_shift_m > self.max_shift_m:
            problems.append(f"{name('min_shift_m')}: must be <= {name('max_shift_m')} ({self.max_shift_m}), got "
                            f"{self.min_shift_m}")
        elif self.init == "perturbed" and not self.min_shift > 0:
            problems.append(f"{name('min_shift_m')}: a perturbed start must move every object, so 0 < min shift <= "
                            f"max shift ({self.max_shift_m} m); got {self.min_shift}")
        if self.noise_pilot and not (self.dart_noise > 0 and self.retries and self.retry_noise_scale < 1):
            problems.append(f"{name('noise_pilot')} {self.noise_pilot}: chooses the σ a task's starts begin at, so "
                            f"it needs {name('dart_noise')} > 0, {name('retries')} >= 1 and "
                            f"{name('retry_noise_scale')} < 1 (got {self.dart_noise}, {self.retries}, "
                            f"{self.retry_noise_scale})")
        return problems

    @property
    def min_shift(self) -> float:
        """The effective minimum shift / distance from the standard init states (0 for standard starts)."""
        if self.init == "standard":
            return 0.0
        if self.min_shift_m is not None:
            return self.min_shift_m
        return self.max_shift_m / 2 if self.init == "perturbed" else SAMPLED_MIN_DISTANCE_M

    def recorder_options(self) -> dict:
        """The RecordParams fields by name, as the fetch stage hands them to the recorder (and keys its cache on
        them): a field marked `absent_at_default` is left out at its default, and min_shift_m for standard starts
        (it changes nothing there), so the markers of recordings made before those fields existed stay valid."""
        out = {}
        for f in dataclasses.fields(RecordParams):
            value = getattr(self, f.name)
            if f.metadata.get("absent_at_default") and value == f.default:
                continue
            if f.name == "min_shift_m" and self.init == "standard":
                continue
            out[f.name] = value
        return out


def add_record_arguments(parser: argparse.ArgumentParser) -> None:
    """One option per RecordParams field (`--max-shift-m` for max_shift_m), with its default and help; `--tasks` is
    comma-separated."""
    for f in dataclasses.fields(RecordParams):
        meta = f.metadata
        kind = f.type if isinstance(f.type, str) else str(f.type)
        extra = {"metavar": meta["metavar"]} if "metavar" in meta else {}
        if "choices" in meta:
            aliases = meta.get("aliases", {})
            parser.add_argument(option(f.name), choices=meta["choices"], default=f.default, help=meta["help"],
                                type=lambda v, aliases=aliases: aliases.get(v, v), **extra)
        elif kind.startswith("list"):
            parser.add_argument(option(f.name), help=meta["help"], **extra)
        else:
            parser.add_argument(option(f.name), type=float if kind.startswith("float") else int, default=f.default,
                                help=meta["help"], **extra)
