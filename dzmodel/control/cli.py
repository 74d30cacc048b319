"""`dz client`: drive the LIBERO Panda (or print a dry run's actions) through a policy server."""

from __future__ import annotations

import argparse

from ..clitools import EXIT_OK, CLIError, example
from ..serve.cli import read_token


def cmd_client(ns: argparse.Namespace) -> int:
    import json

    from ..serve.client import DryRunRobot, ServerError, load_test, run_client

    token = read_token(ns.token_file)
    try:
        if ns.load_test:
            print(json.dumps(load_test(ns.url, token, ns.load_test, ns.requests)))
            return EXIT_OK
        if ns.dry_run:
            run_client(ns.url, token, DryRunRobot(ns.prompt), ns.chunks)
            return EXIT_OK
        from .libero import run_libero_client

        summary = run_libero_client(ns.url, token, suite=ns.suite, task=ns.task, episodes=ns.episodes,
                                    control_hz=ns.control_hz, max_steps=ns.max_steps, seed=ns.seed,
                                    camera_size=ns.camera_size, out=ns.out, overlap=not ns.sync)
        print(json.dumps(summary))
    except (ServerError, OSError) as exc:
        raise CLIError(str(exc)) from None
    return EXIT_OK


def add_commands(sub) -> None:
    """`dz client`."""
    p = sub.add_parser("client", help="drive the LIBERO Panda (the sim Franka) through a policy server; "
                                      "--dry-run prints the actions without a robot",
                       epilog=example("dz client ws://127.0.0.1:8000 --suite object --task 0 --episodes 3",
                                      "dz client ws://127.0.0.1:8000 --dry-run"))
    p.add_argument("url", help="e.g. ws://127.0.0.1:8000 (wss:// behind TLS)")
    p.add_argument("--token-file", help="a file holding the server's token (default: DZ_SERVE_TOKEN; none sent if unset)")
    p.add_argument("--dry-run", action="store_true", help="synthetic observations; print the chunks, move nothing")
    p.add_argument("--chunks", type=int, default=3, help="--dry-run: chunks to request")
    p.add_argument("--prompt", default="pick up the cube and place it in the bowl", help="--dry-run: the instruction")
    p.add_argument("--suite", default="object", help="LIBERO suite (spatial, object, goal, 10, 90)")
    p.add_argument("--task", type=int, default=0, help="task index within the suite")
    p.add_argument("--episodes", type=int, default=1, help="episodes to run, from the task's standard init states "
                                                             "0..N-1")
    p.add_argument("--control-hz", type=float, default=20.0, help="the rate actions are executed at")
    p.add_argument("--max-steps", type=int, default=300, help="steps per episode before it counts as failed")
    p.add_argument("--camera-size", type=int, default=256, help="height and width of the sim cameras, in pixels")
    p.add_argument("--seed", type=int, default=0, help="random seed of the simulated env")
    p.add_argument("--sync", action="store_true",
                   help="wait for each chunk and execute all of it (as dz eval libero), instead of inferring the next "
                        "chunk while one executes")
    p.add_argument("--out", help="write summary.json and episodes.csv here")
    p.add_argument("--load-test", type=int, metavar="SESSIONS", help="instead: this many concurrent sessions")
    p.add_argument("--requests", type=int, default=4, help="requests per session in the load test")
    p.set_defaults(func=cmd_client)
