"""`dz package` and `dz serve`: the Franka bundle and the policy server (`dz client` is `dzmodel.control`'s)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ..clitools import EXIT_OK, CLIError, example
from ..model.cli import add_solver_arguments, solver_from


def cmd_package(ns: argparse.Namespace) -> int:
    from ..serve.package import RobotConfig, build_package

    robot = RobotConfig.load(ns.robot) if ns.robot else None
    bundle, tarball = build_package(ns.model, ns.out, robot, ns.version, ns.eval_dir, ns.name,
                                    overwrite=ns.overwrite, sign_key=ns.sign, embodiment_files=ns.embodiments)
    print(f"bundle {bundle}\ntarball {tarball}")
    return EXIT_OK



def read_token(token_file: str | None) -> str | None:
    """The shared secret from --token-file or DZ_SERVE_TOKEN (never the command line, which `ps` shows)."""
    if token_file:
        path = Path(token_file)
        if not path.is_file():
            raise CLIError(f"{path}: token file not found")
        token = path.read_text().strip()
        if not token:
            raise CLIError(f"{path}: the token file is empty")
        return token
    return os.environ.get("DZ_SERVE_TOKEN") or None


def resolve_bundle_source(source: str) -> tuple[str, str | None]:
    """A bundle path as given, or a URI (models:/<name>@<alias>) resolved by a `dz.bundle_resolvers` entry point
    (the pipeline package resolves models:/ through MLflow; the library itself imports no MLflow). Returns
    (path, the MANIFEST sha256 the registry pinned, or None)."""
    from importlib.metadata import entry_points

    scheme = source.split(":/", 1)[0] if ":/" in source else None
    if scheme is None or (len(scheme) == 1 and sys.platform == "win32"):
        return source, None
    found = [ep for ep in entry_points(group="dz.bundle_resolvers") if ep.name == scheme]
    if not found:
        raise CLIError(f"{source}: nothing resolves {scheme}:/ URIs here (models:/ needs the pipeline extras, "
                       "i.e. MLflow: `make setup`)")
    try:
        resolved = found[0].load()(source)
        path, digest = resolved if isinstance(resolved, tuple) else (resolved, None)
        return str(path), digest
    except ImportError as exc:
        raise CLIError(f"{source}: {scheme}:/ URIs need {exc.name} (the pipeline extras: `make setup`)") from None


def cmd_serve(ns: argparse.Namespace) -> int:
    from ..serve.bundles import TRUST_ENV, BundleError, load_trusted_key
    from ..serve.protocol import RequestLimits
    from ..serve.server import ServeError, ServerLimits, serve_bundle

    token = read_token(ns.token_file)
    if ns.no_auth:
        if token:
            raise CLIError("--no-auth and a token (DZ_SERVE_TOKEN or --token-file) contradict each other; pick one")
        token = None
    elif not token:
        raise CLIError("dz serve needs a token: set DZ_SERVE_TOKEN or pass --token-file FILE "
                       "(or --no-auth for clients that send none, such as RoboArena's evaluator)")
    trust = ns.trust or os.environ.get(TRUST_ENV) or None
    if trust:
        try:
            load_trusted_key(trust)  # a bad key file is refused before the model loads
        except BundleError as exc:
            raise CLIError(str(exc)) from None
    try:
        frame_cap = None if ns.max_frame_mib is None else int(ns.max_frame_mib * 2**20)
        limits = ServerLimits(max_sessions=ns.max_sessions, sessions_per_connection=ns.sessions_per_connection,
                              max_connections=ns.max_connections, max_frame_bytes=frame_cap,
                              max_connections_per_client=ns.max_connections_per_client,
                              max_sessions_per_client=ns.max_sessions_per_client, idle_timeout_s=ns.idle_timeout,
                              handshake_timeout_s=ns.handshake_timeout, max_batch=ns.max_batch, batch_window_ms=ns.batch_window_ms,
                              request=RequestLimits(max_frames=ns.max_frames, max_image_pixels=ns.max_image_pixels))
        bundle, manifest_sha256 = resolve_bundle_source(ns.bundle)
        serve_bundle(bundle, token, ns.host, ns.port, ns.device, limits, solver_from(ns), ns.certfile, ns.keyfile,
                     compile=False if ns.no_compile else None, trust=trust, manifest_sha256=manifest_sha256,
                     precision=ns.precision)
    except ServeError as exc:
        raise CLIError(str(exc)) from None
    return EXIT_OK


def add_commands(sub) -> None:
    """`dz package` and `dz serve`."""

    p = sub.add_parser("package", help="a versioned, checksummed deployment bundle (+ .tar.gz) for a Franka arm, "
                       "or for the robot the embodiment's robot: block describes",
                       epilog=example("dz package runs/x/hf --robot robot.yaml --version 1.0.0 --eval runs/x/eval "
                                      "--out dist",
                                      "dz package runs/g1/hf --embodiments robot_emb.yaml --version 0.1.0 --out dist"))
    p.add_argument("model", help="a converted model directory (dz convert)")
    p.add_argument("--robot", help="a Franka's robot config (YAML or JSON): robot_ip, camera_serials, "
                   "target_ee_pose, workspace_min, workspace_max, control_rate_hz, gripper_threshold, and optionally "
                   "joint_min/joint_max (rad, within the Panda's published limits) to tighten the joint limits a "
                   "joint-position bundle enforces; required for a Franka embodiment, refused for others (their "
                   "robot: block describes them)")
    p.add_argument("--embodiments", action="append", metavar="FILE",
                   help="a reviewed embodiment YAML (repeatable) whose definition of the model's embodiment replaces "
                        "the converted copy's: a robot: or serve: block added after training (the fields training "
                        "fixed must stay as they were); the bundle carries it")
    p.add_argument("--version", required=True, help="the bundle's version, e.g. 1.0.0 (in its name and MANIFEST)")
    p.add_argument("--eval", dest="eval_dir", help="a dz eval libero output directory to ship as evidence")
    p.add_argument("--name", help="bundle name (default dreamzero-<embodiment>)")
    p.add_argument("--out", required=True, help="the folder the bundle <name>-<version>/ and its .tar.gz go into")
    p.add_argument("--overwrite", action="store_true", help="write into an --out folder that dz did not write")
    p.add_argument("--sign", metavar="KEYFILE", help="sign the MANIFEST (MANIFEST.sig) with this ed25519 private "
                   "key (PEM: `openssl genpkey -algorithm ed25519 -out lab.key`); `dz serve --trust` checks it")
    p.set_defaults(func=cmd_package)

    p = sub.add_parser("serve", help="serve a bundle's policy over WebSocket + msgpack-numpy (openpi and RoboArena "
                                     "clients; docs/deploy.md)",
                       epilog=example("dz serve dist/dreamzero-libero_sim-1.0.0.tar.gz --port 8000",
                                      "dz serve models:/dreamzero-demo@production --device cuda --max-batch 8"))
    p.add_argument("bundle", help="a dz package directory or .tar.gz (verified against its MANIFEST), or "
                                  "models:/<name>@<alias> (the MLflow registry)")
    p.add_argument("--token-file", help="a file holding the shared token (default: the DZ_SERVE_TOKEN variable)")
    p.add_argument("--no-auth", action="store_true",
                   help="accept clients without a token (RoboArena's evaluator sends none); prints a warning")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default localhost only; 0.0.0.0 for all)")
    p.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    p.add_argument("--certfile", help="TLS certificate (PEM): serve wss:// instead of ws://")
    p.add_argument("--keyfile", help="TLS private key (PEM), if not inside --certfile")
    p.add_argument("--trust", metavar="PUBKEY", help="refuse any bundle without a valid MANIFEST.sig by this ed25519 "
                   "public key (PEM: `openssl pkey -in lab.key -pubout -out lab.pub`); default: DZ_TRUST_KEY")
    p.add_argument("--device", default="cpu", help="where the policy runs: cpu or cuda")
    p.add_argument("--max-sessions", type=int, default=64, help="KV-cache sessions across all connections")
    p.add_argument("--sessions-per-connection", type=int, default=4,
                   help="beyond it, a connection's least recently used session ends")
    p.add_argument("--max-connections", type=int, default=64,
                   help="open WebSocket connections at once; beyond, new ones are refused")
    p.add_argument("--max-connections-per-client", type=int, default=16,
                   help="per remote address (loopback, e.g. a reverse proxy, is not capped)")
    p.add_argument("--max-sessions-per-client", type=int, default=16,
                   help="sessions per remote address, across its connections, so that one address cannot take "
                        "every session (loopback, e.g. a reverse proxy, is not capped)")
    p.add_argument("--idle-timeout", type=float, default=600.0,
                   help="seconds without a request before a connection is closed (0: never)")
    p.add_argument("--handshake-timeout", type=float, default=5.0,
                   help="seconds from a TCP connection to the end of its HTTP upgrade request (and TLS handshake); "
                        "at most --max-connections connections may be opening at once (--max-connections-per-client "
                        "per address)")
    p.add_argument("--max-frame-mib", type=float, default=None,
                   help="cap on a request frame (default 32, or more if one frame of --max-image-pixels per camera "
                        "needs it); the limit itself follows the bundle's views, --max-frames and --max-image-pixels")
    p.add_argument("--max-frames", type=int, default=33, help="most camera frames per view in one request")
    p.add_argument("--max-image-pixels", type=int, default=None,
                   help="largest camera frame (height x width pixels) accepted; frames are resized to the model's "
                        "view on the server (default: 1920x1080 = 2,073,600, or 16x the model's view if more)")
    p.add_argument("--precision", choices=["bf16", "fp8"], default="bf16",
                   help="fp8: the DiT blocks' linears in FP8 on GPUs that have it (H100, H200, L40S); "
                        "elsewhere bf16, with a log line that says why")
    p.add_argument("--max-batch", type=int, default=1,
                   help="solve the requests of up to N sessions (robots) that arrive together in one batched forward "
                        "(default 1: one at a time); on CUDA each batch size is captured at start")
    p.add_argument("--batch-window-ms", type=float, default=5.0,
                   help="with --max-batch: how long a request waits for other sessions' requests to join its batch; "
                        "it never waits while no other client is connected (default 5)")
    p.add_argument("--no-compile", action="store_true", help="on CUDA: skip torch.compile of the DiT block "
                   "(faster start, slower chunks; CUDA graphs stay on)")
    add_solver_arguments(p, dit_steps="auto")  # the deployed setting: upstream's 8 of 16 DiT steps
    p.set_defaults(func=cmd_serve)
