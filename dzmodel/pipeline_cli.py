"""`dz params ...` (check, show, train-config, dvc) and `dz stage NAME`: the pipeline's stages as dvc.yaml and
the Prefect tasks run them."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .clitools import EXIT_FAIL, EXIT_OK, CLIError, example


def load_params_of(ns: argparse.Namespace):
    from .config import load_params

    return load_params(ns.params, ns.set or [], ns.profile)


def cmd_params_check(ns: argparse.Namespace) -> int:
    params = load_params_of(ns)
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

    params = load_params_of(ns)
    print(json.dumps(profile_dict(params.selected(ns.profile)), indent=1))
    return EXIT_OK


def cmd_params_train_config(ns: argparse.Namespace) -> int:
    import json

    from .atomic import atomic_write_text
    from .config import StagePaths, train_config

    params = load_params_of(ns)
    name = ns.profile or params.profile
    cfg = train_config(params.selected(name), StagePaths(Path(ns.root), name))
    atomic_write_text(ns.out, json.dumps(cfg.to_dict(), indent=1))
    print(f"wrote {ns.out} (profile {name}: {cfg.preset}, {cfg.steps} steps, out_dir {cfg.out_dir})")
    return EXIT_OK


def cmd_params_dvc(ns: argparse.Namespace) -> int:
    from .atomic import atomic_write_text
    from .pipeline import dvc_missing_stages, dvc_yaml_with_computed_deps

    path = Path(ns.dvc_yaml)
    if not path.is_file():
        raise CLIError(f"{path}: no such file")
    text = path.read_text()
    wanted = dvc_yaml_with_computed_deps(text)
    if wanted == text:
        print(f"{path}: every stage's deps, metrics and plots match the stage table")
        return EXIT_OK
    missing = dvc_missing_stages(text)
    lacks = f"; it has no entry for the table's stage(s) {', '.join(missing)}" if missing else ""
    if not ns.write:
        print(f"{path}: stage deps, metrics or plots differ from the stage table (the code each stage imports, "
              f"the files it declares){lacks}; "
              "`dz params dvc --write` rewrites them", file=sys.stderr)
        return EXIT_FAIL
    atomic_write_text(path, wanted)
    print(f"{path}: rewrote the stages' deps, metrics and plots from the stage table"
          + (f", added {', '.join(missing)}" if missing else ""))
    return EXIT_OK


def cmd_stage(ns: argparse.Namespace) -> int:

    from .config import StagePaths
    from .dirlock import directory_lock
    from .pipeline import WORKSPACE_WRITER, run_stage

    params = load_params_of(ns)
    name = ns.profile or params.profile
    paths = StagePaths(Path(ns.root), name)
    with directory_lock(paths.run, wait=False, what=WORKSPACE_WRITER):  # the flow's hold on these places
        result = run_stage(ns.stage, params.selected(name), paths)
    print(f"stage {ns.stage} [{name}] done in {result['seconds']:.1f} s")
    return EXIT_OK


def add_params_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--params", default="params.yaml", help="the parameters file (default params.yaml)")
    p.add_argument("--profile", help="the profile to use (default: params.yaml's `profile`)")
    p.add_argument("--set", action="append", metavar="STAGE.KEY=VALUE",
                   help="override one parameter of the profile, e.g. train.steps=20 (value parsed as YAML)")


def add_commands(sub) -> None:
    """`dz params ...` and `dz stage NAME`."""

    params = sub.add_parser("params", help="params.yaml: check, show a profile, write its train config")
    params = params.add_subparsers(dest="cmd", required=True)
    p = params.add_parser("check", help="validate the whole file; list the profiles",
                          epilog=example("dz params check", "dz params check --params my_params.yaml"))
    add_params_args(p)
    p.set_defaults(func=cmd_params_check)
    p = params.add_parser("show", help="print one profile with every default filled in (JSON)",
                          epilog=example("dz params show --profile libero_object --set train.steps=20"))
    add_params_args(p)
    p.set_defaults(func=cmd_params_show)
    p = params.add_parser("train-config", help="write the TrainConfig JSON the train stage runs (for torchrun)",
                          epilog=example("dz params train-config --profile libero_5b --out train_config.json"))
    add_params_args(p)
    p.add_argument("--out", required=True, help="the JSON file to write")
    p.add_argument("--root", default=".", help="the project root the stage paths are under")
    p.set_defaults(func=cmd_params_train_config)
    p = params.add_parser("dvc", help="check dvc.yaml's stage deps, metrics and plots against the stage table (the "
                                      "code each stage imports, the files it declares); --write rewrites them",
                          epilog=example("dz params dvc", "dz params dvc --write"))
    p.add_argument("--dvc-yaml", default="dvc.yaml", help="the dvc.yaml file to check")
    p.add_argument("--write", action="store_true",
                   help="rewrite the stages' deps from the stage table instead of exiting 1 when they differ")
    p.set_defaults(func=cmd_params_dvc)

    from .pipeline import STAGES

    p = sub.add_parser("stage", help="run one pipeline stage from params.yaml (what dvc.yaml calls)",
                       epilog=example("dz stage fetch --profile demo",
                                      "dz stage train --profile demo --set train.steps=20"))
    p.add_argument("stage", choices=STAGES, help="the stage to run: " + ", ".join(STAGES))
    add_params_args(p)
    p.add_argument("--root", default=".", help="the project root: data/<profile>/ and runs/<profile>/ go under it")
    p.set_defaults(func=cmd_stage)
