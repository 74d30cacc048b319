"""The `dz` command line: one code path for people, Prefect tasks and dvc.yaml.

    dz model parity FIXTURE [FIXTURE ...]   reproduce reference fixtures (exit 1 above tolerance)
    dz model info [--preset NAME]           parameter counts of the presets
    dz model manifest                       check our modules against the WAN checkpoint manifest
    dz model tokenizer OUT                  build the small offline tokenizer of the embedded default
    dz data fetch|synth|metadata|check ...  datasets (see `dz data -h`)
    dz data record libero --suite S --out D LIBERO demonstrations from the scripted expert (DART noise, DAgger)
    dz embodiment init DATASET --preset P   draft an embodiment YAML (cameras, state, action, robot) to review
    dz train [--config FILE] [--set k=v]    SFT; under torchrun: FSDP2 over all ranks; resumes from out_dir
    dz convert RUN|CKPT --out DIR           DCP -> config.json + model.safetensors (+ experiment_cfg/)
    dz eval libero RUN|MODEL --out DIR      LIBERO success rate across checkpoint steps
    dz eval oracle DATASET --out DIR        replay recorded episodes through the eval path (exit 1 below 95 %)
    dz eval action-error RUN|MODEL --out DIR   held-out action error vs the mean predictor and the untrained model
    dz eval previews MODEL --out DIR          the predicted video of held-out windows beside the real frames
    dz eval probe DATASET --vae V --out DIR   linear probes from VAE latents to the eef/object positions (held out)
    dz package MODEL --robot R --version V --out DIR   versioned Franka bundle + tarball
    dz serve BUNDLE|models:/NAME@ALIAS      the policy server (openpi/RoboArena protocol; token in DZ_SERVE_TOKEN)
    dz client URL [--dry-run]               drive the LIBERO Panda through a server (or print its actions)
    dz cache --config FILE --out DIR        precomputed encoder outputs; train with train.cache=DIR
    dz bench model ...                      bf16 forward+backward timing on a GPU
    dz bench data ...                       video decode and loader throughput
    dz bench serve ...                      dz serve with N concurrent clients, batching off and on
    dz params check|show|train-config       validate params.yaml; print a profile; write its TrainConfig
    dz stage NAME [--profile P]             one pipeline stage from params.yaml (what dvc.yaml runs)
    dz pipeline|deploy|promote ...          Prefect/MLflow commands, added by the flows package when installed
"""

from __future__ import annotations

import argparse
import sys

from .clitools import EXIT_FAIL, EXIT_OK, EXIT_USAGE, CLIError  # noqa: F401  (the exit codes callers compare with)
from .clitools import ArgumentParser
from .outputs import NoSpaceError

__all__ = ["EXIT_FAIL", "EXIT_OK", "EXIT_USAGE", "CLIError", "build_parser", "main"]


def _deliberate(exc: BaseException) -> bool:
    """One of the project's own error classes (DataError, ParamsError, ...) or a missing file: what users cause."""
    return isinstance(exc, FileNotFoundError) or (
        type(exc) is not ValueError and type(exc).__module__.split(".")[0] in ("dzmodel", "tasks", "flows"))


def _record_libero(record_kwargs: dict, out) -> None:
    """`dz data fetch libero`'s recorder (the evaluation package's; imported when used: it needs LIBERO)."""
    from .eval.libero_record import record_into

    record_into(record_kwargs, out)


def _add_plugin_commands(sub) -> None:
    """Commands that need Prefect/MLflow live outside the library (`dz.commands` entry points)."""
    from importlib.metadata import entry_points

    for ep in entry_points(group="dz.commands"):
        try:
            ep.load()(sub)
        except ImportError as exc:  # e.g. the GPU image: no Prefect/MLflow; the command says so instead of vanishing
            why = f"importing {ep.value.split(':')[0]} failed: {exc}"

            def unavailable(ns, name=ep.name, why=why):
                raise CLIError(f"`dz {name}` (and the Prefect/MLflow commands that come with it) is unavailable "
                               f"here: {why}. Install the pipeline extras (`make setup`).")

            p = sub.add_parser(ep.name, help=f"unavailable: {why}")
            p.add_argument("args", nargs=argparse.REMAINDER)
            p.set_defaults(func=unavailable)


def build_parser() -> argparse.ArgumentParser:
    """Each package adds its own subcommands; this only assembles them, in `dz -h`'s order."""
    from .bench.cli import add_commands as bench
    from .control.cli import add_commands as control
    from .data.cli import add_commands as data
    from .eval.cli import add_commands as evaluation, add_data_commands as data_record
    from .model.args import action_horizons
    from .model.cli import add_commands as model
    from .pipeline_cli import add_commands as params_and_stage
    from .serve.cli import add_commands as serving
    from .train.cli import add_commands as training

    parser = ArgumentParser(prog="dz", description="DreamZero fine-tuning pipeline",
                            epilog="every command: dz COMMAND --help (its options, their defaults and an example)")
    parser.add_argument("--debug", action="store_true", help="show the traceback of any error")
    sub = parser.add_subparsers(dest="group", required=True)
    model(sub)
    data_record(data(sub, recorder=_record_libero, presets=action_horizons()))
    training(sub)
    serving(sub)
    control(sub)
    evaluation(sub)
    bench(sub)
    params_and_stage(sub)
    _add_plugin_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    if ns.debug:  # every error with its traceback
        return ns.func(ns)
    try:
        return ns.func(ns)
    except CLIError as exc:
        print(f"dz: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except NoSpaceError as exc:  # a full disk is no usage error
        print(f"dz: error: {exc}", file=sys.stderr)
        return EXIT_FAIL
    except (ValueError, FileNotFoundError) as exc:  # DataError, ParamsError, ...: one clear message
        print(f"dz: error: {exc}", file=sys.stderr)
        if not _deliberate(exc):  # a ValueError we did not raise on purpose may be a bug
            print(f"dz: ({type(exc).__name__}; `dz --debug ...` shows where it came from)", file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:  # a full disk, or a file where a directory should be, deep inside some writer
        from .outputs import NO_SPACE

        if exc.errno in NO_SPACE:
            print(f"dz: error: {exc.filename or 'output'}: no space left on the device; a partial output was "
                  "removed and nothing earlier was replaced", file=sys.stderr)
        elif isinstance(exc, (NotADirectoryError, FileExistsError, IsADirectoryError)) and exc.filename:
            print(f"dz: error: {exc.filename}: {exc.strerror} (a file where a directory should be, or the "
                  "reverse)", file=sys.stderr)
        else:
            raise
        return EXIT_FAIL
    except RuntimeError as exc:
        from .dirlock import DirectoryBusy
        from .stages.common import StageError

        if not isinstance(exc, (StageError, DirectoryBusy)):
            raise
        print(f"dz: error: {exc}", file=sys.stderr)
        return EXIT_FAIL


if __name__ == "__main__":
    sys.exit(main())
