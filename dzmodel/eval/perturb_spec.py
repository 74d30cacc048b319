"""The names, settings and parsing of the robustness perturbations (`dz eval libero --perturb`, `eval.perturb` in
params.yaml). The params check imports this module, so it holds no simulator code: the perturbations themselves
are `dzmodel/eval/libero_perturb.py`."""

from __future__ import annotations

from dataclasses import dataclass

TABLE_COLOURS: dict[str, tuple[float, float, float, float]] = {
    "white": (0.92, 0.92, 0.92, 1.0),
    "black": (0.08, 0.08, 0.08, 1.0),
    "red": (0.70, 0.12, 0.10, 1.0),
    "green": (0.15, 0.55, 0.20, 1.0),
    "blue": (0.15, 0.25, 0.70, 1.0),
    "grey": (0.50, 0.50, 0.50, 1.0),
}


MIN_DISTRACTORS, MAX_DISTRACTORS = 1, 5


class PerturbationError(ValueError):
    """A perturbation that cannot be made: a bad name or value, or a start it cannot move validly."""


@dataclass(frozen=True)
class Kind:
    default: object
    help: str
    scene: bool = True  # edits the simulator (else only what the policy is told)


def _distance(text: str) -> float:
    value = float(text)
    if not 0 < value <= 0.3:
        raise ValueError(f"a shift in metres in (0, 0.3], got {text}")
    return value


def _degrees(text: str) -> float:
    value = float(text)
    if not 0 < value <= 45:
        raise ValueError(f"an angle in degrees in (0, 45], got {text}")
    return value


def _factor(text: str) -> float:
    value = float(text)
    if not 0 < value < 1:
        raise ValueError(f"an intensity factor in (0, 1) (the light is scaled by it or by its inverse), got {text}")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"a whole number of extra objects, {MIN_DISTRACTORS} to {MAX_DISTRACTORS}, got {text!r}") \
            from None
    if not MIN_DISTRACTORS <= value <= MAX_DISTRACTORS:
        raise ValueError(f"a whole number of extra objects, {MIN_DISTRACTORS} to {MAX_DISTRACTORS}, got {text}")
    return value


def _choice(options):
    def parse(text: str) -> str:
        if text not in options:
            raise ValueError(f"one of {', '.join(options)}, got {text!r}")
        return text
    return parse


KINDS: dict[str, tuple[Kind, object]] = {
    "position": (Kind(0.05, "every movable object shifted by D metres in a seeded direction"), _distance),
    "swap": (Kind("task", "two movable objects exchange their x/y (task: one of them named by the goal)"),
             _choice(("task", "any"))),
    "camera": (Kind(10.0, "the agentview camera orbited by A degrees (azimuth), A/2 (elevation)"), _degrees),
    "light": (Kind(0.5, "light intensity times F or 1/F, directions tilted"), _factor),
    "table": (Kind("random", "the work surface in a plain colour"), _choice(("random", *TABLE_COLOURS))),
    "paraphrase": (Kind("random", "the instruction replaced by a hand-written paraphrase", scene=False),
                   _choice(("random", "1", "2", "3"))),
    "distractor": (Kind(2, "N extra objects, of kinds not in the task, on the work surface"), _count),
}


@dataclass(frozen=True)
class Perturbation:
    name: str
    value: object

    @property
    def label(self) -> str:
        """`name=value`, as the results name it (`none` is the unperturbed baseline)."""
        value = f"{self.value:g}" if isinstance(self.value, float) else str(self.value)
        return f"{self.name}={value}"

    @property
    def slug(self) -> str:
        """The label as a file-name part."""
        return self.label.replace("=", "-")

    @property
    def scene(self) -> bool:
        return KINDS[self.name][0].scene


def parse_perturbations(items, where: str = "--perturb") -> list[Perturbation]:
    """`NAME` or `NAME=VALUE` items (each may hold several, comma-separated) -> perturbations, in order; a bad name
    or value is one PerturbationError naming `where`."""
    if isinstance(items, str):
        items = [items]
    out: list[Perturbation] = []
    for item in items or []:
        if not isinstance(item, str):
            raise PerturbationError(f"{where}: expected NAME or NAME=VALUE strings, got {item!r}")
        for part in (p.strip() for p in item.split(",")):
            if not part:
                continue
            name, sep, text = part.partition("=")
            name = name.strip()
            if name not in KINDS:
                raise PerturbationError(f"{where}: unknown perturbation {name!r}; known: {', '.join(KINDS)}")
            kind, parse = KINDS[name]
            if sep:
                try:
                    value = parse(text.strip())
                except ValueError as exc:
                    raise PerturbationError(f"{where}: {name}: {exc}") from None
            else:
                value = kind.default
            p = Perturbation(name, value)
            if any(q.label == p.label for q in out):
                raise PerturbationError(f"{where}: {p.label} is listed twice")
            out.append(p)
    return out
