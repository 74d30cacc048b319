"""The user docs (README.md, docs/*.md; docs/history/ is the measurement log) speak to users: no issue numbers,
no sections of documents users never see, no paths outside the project, no names of the team's development tools."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
USER_DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
INTERNAL = {
    "an issue number": re.compile(r"\bissues? #?[0-9]", re.I),
    "a section sign (reference sections)": re.compile("§"),
    "a path outside the checkout": re.compile(r"\.\./shared"),
    "a development machine kind": re.compile(r"nvidia-h[12]00(-x[0-9])?\b"),
    "a development tool": re.compile(r"\b(farm-studio|device tool)\b"),
}


def internal_references(text: str) -> list[str]:
    return [f"{what}: {m.group(0)!r}" for what, pattern in INTERNAL.items() for m in pattern.finditer(text)]


@pytest.mark.parametrize("doc", USER_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_user_docs_name_nothing_internal(doc):
    assert internal_references(doc.read_text()) == []


def test_the_check_finds_each_kind_of_internal_reference():
    text = "fixed in issue 14 (reference §5.1); fixtures in ../shared/fixtures; ran on nvidia-h100-x1 via farm-studio"
    assert len(internal_references(text)) == 5


# --- the new-robot walkthrough (docs/data.md "Adding a robot", docs/deploy.md "A new robot, end to end") -------------

def _section(doc: Path, heading: str) -> str:
    text = doc.read_text()
    start = text.index(f"## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


WALKTHROUGHS = [(ROOT / "docs" / "data.md", "Adding a robot"), (ROOT / "docs" / "deploy.md", "A new robot, end to end")]


def _dz_commands(section: str) -> list[list[str]]:
    """Every `dz ...` line of the section's bash blocks (continuations joined, comments dropped), as argv."""
    import shlex

    commands = []
    for block in re.findall(r"```bash\n(.*?)```", section, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words[:1] == ["dz"]:
                commands.append(words[1:])
    return commands


@pytest.mark.parametrize("doc, heading", WALKTHROUGHS, ids=lambda v: getattr(v, "name", v))
def test_the_new_robot_walkthrough_runs_commands_and_flags_that_exist(doc, heading):
    from dzmodel.cli import build_parser

    commands = _dz_commands(_section(doc, heading))
    assert [c[0] for c in commands] == ["embodiment", "data", "data", "train", "convert", "package", "serve"]
    assert ["--preset", "tiny"] == commands[0][commands[0].index("--preset"):][:2]
    assert "--embodiments" in commands[5]  # packaged with the reviewed embodiment
    parser = build_parser()
    for argv in commands:
        parser.parse_args(argv)  # an unknown command or flag exits


def test_the_walkthroughs_train_config_and_horizons_are_the_codes():
    import yaml

    from dzmodel.data.embodiment_draft import LIMIT_MARGIN
    from dzmodel.model.args import action_horizons, preset
    from dzmodel.train.config import TrainConfig

    section = _section(ROOT / "docs" / "data.md", "Adding a robot")
    cfg = TrainConfig.from_dict(yaml.safe_load(re.findall(r"```yaml\n(.*?)```", section, flags=re.S)[0]))
    assert cfg.preset == "tiny" and cfg.embodiment_files == ["robot_emb.yaml"] and cfg.skip_missing
    table = ", ".join(f"{name} {n}" for name, n in action_horizons().items())
    assert f"({table};" in " ".join(section.split())
    assert f"widened by {LIMIT_MARGIN:.0%}".replace("%", " %") in " ".join(section.split())
    deploy = (ROOT / "docs" / "deploy.md").read_text()
    assert f"action_horizon: {preset('tiny').num_action_per_block}      # the tiny preset's" in deploy
