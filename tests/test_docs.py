"""The user docs speak to users about the product as it is now.

User docs are README.md and everything under docs/ except docs/archive/, the research archive (the rounds of
experiments, their raw files and GPU scripts, with its own index). The checks, each with a test that it can fail:
1. code and configuration (dzmodel/, tasks/, flows/, infra/, params.yaml, Makefile, dvc.yaml, ...) never point into
   the archive: user docs may link to it, nothing depends on it;
2. no "round N" outside the archive: user docs, README, params.yaml, code and test comments, Makefile;
3. no dates of work in user-doc headings;
4. no words about the machines the work was developed on (sessions' budgets, device calls, what was carried to a
   machine, a machine going back), nor issue numbers, reference sections, paths outside the checkout, machine kinds
   or development tools;
5. sizes: README.md at most 1,500 words; docs/performance.md at most 2,500 words and no table row over 400
   characters; docs/results.md at most 6,000 words;
6. docs/archive/README.md exists and names every top-level entry of docs/archive/."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ARCHIVE = ROOT / "docs" / "archive"
TEXT_SUFFIXES = {".md", ".py", ".sh", ".yaml", ".yml", ".toml", ".js", ".cfg", ".ini", ".txt"}  # prose and code,
# not the raw data files (csv, jsonl, logs) that the user docs cite


def _text_files(*roots: Path) -> list[Path]:
    files = []
    for root in roots:
        if root.is_file():
            files.append(root)
            continue
        for path in sorted(root.rglob("*")):
            if (path.is_file() and (path.suffix in TEXT_SUFFIXES or path.name == "Makefile") and ARCHIVE not in
                    path.parents and "__pycache__" not in path.parts):
                files.append(path)
    return files


USER_DOCS = [ROOT / "README.md", *[p for p in _text_files(ROOT / "docs") if p.suffix == ".md"]]
DOCS_TREE = [ROOT / "README.md", *_text_files(ROOT / "docs")]  # the user docs and the scripts beside them
CODE = _text_files(*(ROOT / d for d in ("dzmodel", "tasks", "flows", "infra", ".ci")),
                   *(ROOT / f for f in ("params.yaml", "Makefile", "dvc.yaml", "prefect.yaml", "pyproject.toml")))
TESTS = _text_files(ROOT / "tests")


def _ids(path: Path) -> str:
    return str(path.relative_to(ROOT))


# --- 1. nothing but docs depends on the archive ----------------------------------------------------------------------

ARCHIVE_LINK = re.compile(r"docs/archive\b|\barchive/(results|bench|performance-|results-)")


def archive_links(text: str) -> list[str]:
    return [m.group(0) for m in ARCHIVE_LINK.finditer(text)]


@pytest.mark.parametrize("path", CODE, ids=_ids)
def test_code_never_points_into_the_archive(path):
    assert archive_links(path.read_text(errors="replace")) == []


# --- 2. no "round N" outside the archive ------------------------------------------------------------------------------

ROUND = re.compile(r"\b[Rr]ounds?[ _-]?[0-9]+")


def round_mentions(text: str) -> list[str]:
    return [m.group(0) for m in ROUND.finditer(text)]


@pytest.mark.parametrize("path", DOCS_TREE + CODE + TESTS, ids=_ids)
def test_no_round_numbers_outside_the_archive(path):
    assert round_mentions(path.read_text(errors="replace")) == []


# --- 3. no dates of work in headings ----------------------------------------------------------------------------------

DATED_HEADING = re.compile(r"^#{1,6} .*\b20[0-9]{2}-[01][0-9]-[0-3][0-9]\b.*$", re.M)


def dated_headings(text: str) -> list[str]:
    return DATED_HEADING.findall(text)


@pytest.mark.parametrize("doc", USER_DOCS, ids=_ids)
def test_no_dates_of_work_in_headings(doc):
    assert dated_headings(doc.read_text()) == []


# --- 4. nothing about the development machines, nothing internal ------------------------------------------------------

INTERNAL = {
    "an issue number": re.compile(r"\bissues? #?[0-9]", re.I),
    "a section sign (reference sections)": re.compile("§"),
    "a path outside the checkout": re.compile(r"\.\./shared"),
    "a development machine kind": re.compile(r"nvidia-h[12]00(-x[0-9])?\b"),
    "a development tool": re.compile(r"\b(farm-studio|device tool)\b"),
    "a development session": re.compile(r"\b(this|that|the|a|one|each|every) (work |dev |development )?session'?s? "
                                        r"(budget|CPU|GPU|device|hour|time|limit)|\bthis session\b", re.I),
    "a device call": re.compile(r"\bdevice (calls?|time|budget|commands?)\b|\b(in|over|per|a) (two|three|\d+) "
                                r"(device )?calls\b|\bMiB (a|per) call\b", re.I),
    "carrying files to a machine": re.compile(r"\b(carried|carry|carrying) (in|over|with) (two|three|\d+|the) "
                                              r"(calls?|commands?)\b|\b(carried|carry|carrying) `?\.", re.I),
    "a machine given back": re.compile(r"\bmachines? (went|goes|was given|were given|is given) back\b|"
                                       r"\bbefore the machine went\b|\bheld (for )?(at most )?30 minutes\b", re.I),
}


def internal_references(text: str) -> list[str]:
    return [f"{what}: {m.group(0)!r}" for what, pattern in INTERNAL.items() for m in pattern.finditer(text)]


@pytest.mark.parametrize("doc", USER_DOCS, ids=_ids)
def test_user_docs_name_nothing_internal(doc):
    assert internal_references(doc.read_text()) == []


@pytest.mark.parametrize("path", CODE, ids=_ids)
def test_code_and_params_speak_of_no_development_machine(path):
    found = [r for r in internal_references(path.read_text(errors="replace"))
             if r.split(":")[0] in ("a development session", "a device call", "carrying files to a machine",
                                    "a machine given back")]
    assert found == []


# --- 5. sizes ----------------------------------------------------------------------------------------------------------

README_WORDS, PERFORMANCE_WORDS, RESULTS_WORDS, TABLE_ROW_CHARS = 1500, 2500, 6000, 400


def words(text: str) -> int:
    return len(text.split())


def long_table_rows(text: str, limit: int = TABLE_ROW_CHARS) -> list[str]:
    return [line[:80] + "..." for line in text.splitlines() if line.startswith("|") and len(line) > limit]


@pytest.mark.parametrize("page, limit", [("README.md", README_WORDS), ("docs/performance.md", PERFORMANCE_WORDS),
                                         ("docs/results.md", RESULTS_WORDS)])
def test_the_page_stays_short(page, limit):
    assert words((ROOT / page).read_text()) <= limit


def test_the_performance_tables_rows_stay_short():
    assert long_table_rows((ROOT / "docs" / "performance.md").read_text()) == []


# --- 6. the archive's index -------------------------------------------------------------------------------------------

def unindexed(index: str, entries: list[str]) -> list[str]:
    """The entries (file or folder names) that the index does not name, as `name`, `name/` or a link to it."""
    return [e for e in entries if not re.search(rf"(`{re.escape(e)}/?`|\]\({re.escape(e)}/?\))", index)]


def test_the_archive_has_an_index_naming_every_entry():
    index = ARCHIVE / "README.md"
    assert index.is_file()
    assert unindexed(index.read_text(), sorted(p.name for p in ARCHIVE.iterdir())) == []


# --- each check can fail ----------------------------------------------------------------------------------------------

def test_each_check_finds_what_it_is_for():
    # planted violations, assembled here so that this file passes its own checks
    rnd = "r" + "ound"
    assert archive_links("see docs/" + "archive/results/x.csv") and not archive_links("docs/results/final/")
    assert round_mentions(f"the {rnd} 6 run; {rnd.title()} 12; {rnd}s 2-5; docs/results/{rnd}18/") == \
        [f"{rnd} 6", f"{rnd.title()} 12", f"{rnd}s 2", f"{rnd}18"]
    assert not round_mentions("rounded to 3 decimals, around 5 % (round-trip), background 3")
    assert dated_headings("## 16. A faster step (20" + "26-11-27)\ntext 2026-11-23T13:02:45\n") and \
        not dated_headings("a log line: 2026-11-23T13:02:45\n## Sessions\n")
    planted = ("fixed in issue 14 (reference §5.1); fixtures in ../shared/fixtures; ran on nvidia-h100-x1 via "
               "farm-studio; the recording took this " + "session's CPU hour; carried in two " + "calls (the limit "
               "is 64 MiB a " + "call); the machine went " + "back before the package stage was timed")
    kinds = {r.split(":")[0] for r in internal_references(planted)}
    assert kinds == set(INTERNAL), set(INTERNAL) - kinds
    assert not internal_references("one session per episode; the KV-cache session; sessions per connection; "
                                   "one call each; the bundle carried these limits; a GPU machine")
    assert words("a b c") == 3 and long_table_rows("| " + "x" * 400 + " |\n| short |") and \
        not long_table_rows("| short |")
    assert unindexed("| `results/` | ... |\n[page](results-history.md)", ["results", "results-history.md", "bench"]) \
        == ["bench"]


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
