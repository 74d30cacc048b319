"""`dz data ...`: fetch, synth, metadata and check (`dz data record` is the evaluation package's: it needs
LIBERO)."""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

from ..clitools import EXIT_OK, example


def _out_of_memory_is_data_error(command):
    """A dataset command whose reads run out of memory ends in one DataError naming the dataset, not a traceback
    (the readers bound what they read first; this is the last resort)."""

    @functools.wraps(command)
    def run(ns: argparse.Namespace) -> int:
        from ..data.errors import DataError

        try:
            import pyarrow as pa

            memory_errors: tuple = (MemoryError, pa.ArrowMemoryError)
        except ImportError:
            memory_errors = (MemoryError,)
        try:
            return command(ns)
        except memory_errors as exc:
            raise DataError(f"{ns.dataset}: ran out of memory reading the dataset ({type(exc).__name__}); a file holds "
                            "more than this machine can read") from None

    return run


def registry_of(ns: argparse.Namespace):
    from ..data.embodiments import load_embodiments

    return load_embodiments(ns.embodiments or ())


def cmd_data_fetch(ns: argparse.Namespace) -> int:

    from ..data.fetch import fetch_dataset

    synth = {"num_episodes": ns.synth_episodes, "seed": ns.seed} if ns.source == "synthetic" else None
    path = fetch_dataset(ns.source, Path(ns.dest), revision=ns.revision, allow_patterns=ns.allow or None,
                         synth_kwargs=synth, name=ns.name, retries=ns.retries, retry_delay_s=ns.retry_delay,
                         skip_missing=ns.skip_missing, recorder=ns.recorder)
    print(f"dataset ready: {path}")
    return EXIT_OK


def cmd_data_synth(ns: argparse.Namespace) -> int:
    from ..data.synth import make_synthetic_dataset, summarize

    codec = {"av1": "libsvtav1", "h264": "libx264"}[ns.codec]
    path = make_synthetic_dataset(ns.out, num_episodes=ns.episodes, episode_length=ns.length,
                                  image_size=ns.image_size, codec=codec, seed=ns.seed, overwrite=ns.overwrite,
                                  motion=ns.motion, embodiment=ns.embodiment)
    print(summarize(path))
    return EXIT_OK


def _is_metadata_json(path: Path) -> bool:
    """A metadata.json that `dz data metadata` wrote: a JSON object of embodiment entries with statistics."""
    import json

    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(doc, dict) and bool(doc) and all(isinstance(v, dict) and "statistics" in v for v in doc.values())


@_out_of_memory_is_data_error
def cmd_data_metadata(ns: argparse.Namespace) -> int:
    from ..data.dataset import embodiment_metadata, missing_videos
    from ..data.embodiments import get_embodiment
    from ..data.lerobot_format import open_dataset

    from ..outputs import check_output_file

    check_output_file(ns.out, _is_metadata_json, overwrite=ns.overwrite, what="a metadata.json")  # --merge too
    emb = get_embodiment(ns.embodiment, registry_of(ns))
    reader = open_dataset(ns.dataset, allow_outside=ns.allow_outside_root)
    missing = sorted({ep for ep, _ in missing_videos(reader, emb)})
    doc = embodiment_metadata(ns.dataset, emb, ns.out, merge=ns.merge, max_episodes=ns.max_episodes,
                              heldout_episodes=ns.heldout_episodes, skipped_episodes=missing if ns.skip_missing else (),
                              reader=reader)
    entry = doc[emb.tag]
    stats = entry["statistics"]
    print(f"wrote {ns.out} [{emb.tag}], statistics from {entry['statistics_episodes']} episodes"
          + (f" (the first --max-episodes {ns.max_episodes})" if ns.max_episodes else ""))
    left = ([f"{entry['skipped_episodes']} (missing video files)"] if entry.get("skipped_episodes") else []) + (
        [f"{entry['heldout_episodes']} (held out: --heldout-episodes {ns.heldout_episodes})"]
        if entry["heldout_episodes"] else [])
    if left:
        print(f"left out episode(s) {', '.join(left)}")
    if missing and not ns.skip_missing:
        print(f"note: episode(s) {missing} lack video files of the views in use, and their rows are in these "
              "statistics; --skip-missing leaves them out, as train.skip_missing leaves them out of training")
    for group, entries in stats.items():
        for key, st in entries.items():
            print(f"  {group}.{key}: {len(st['mean'])} dims, q01 {[round(v, 3) for v in st['q01'][:4]]}..., "
                  f"q99 {[round(v, 3) for v in st['q99'][:4]]}...")
    return EXIT_OK


@_out_of_memory_is_data_error
def cmd_data_check(ns: argparse.Namespace) -> int:
    from ..data.dataset import WindowDataset
    from ..data.embodiments import get_embodiment
    from ..data.errors import DataError
    from ..data.lerobot_format import open_dataset
    from ..data.sampling import WindowSpec

    reader = open_dataset(ns.dataset, allow_outside=ns.allow_outside_root)
    where = f"{reader.remote.uri} (cached in {reader.root})" if reader.remote is not None else reader.root
    print(f"{where}: LeRobot {reader.version}, {len(reader.episodes)} episodes, "
          f"{int(reader.episodes.length.sum())} frames at {reader.fps:g} fps, views {reader.video_keys}")
    reader.check_lengths()  # before --skip-missing can make the other problems warnings
    try:
        reader.check(allow_missing_videos=ns.skip_missing)  # with --skip-missing, the missing videos are listed below
        complete = True
    except DataError as exc:
        if not ns.skip_missing:
            raise
        print(f"warning: {exc}")
        complete = False
    missing = reader.missing_video_files() if ns.skip_missing else []
    if missing:
        files = list(dict.fromkeys(str(path) for _, path in missing))  # a v3.0 file holds several episodes
        shown = ", ".join(files[:10]) + (f" and {len(files) - 10} more" if len(files) > 10 else "")
        print(f"warning: {len(files)} video file(s) missing ({shown}): episode(s) "
              f"{sorted({ep for ep, _ in missing})} are skipped")
    elif complete:
        print("all promised data and video files are present")
    from ..data.check import dataset_problems, deep_check, raise_problems

    raise_problems(reader, deep_check(reader) if ns.deep else dataset_problems(reader), shown=None)
    print("every data file's footer opens, every number in it is finite and every video is a video container"
          + ("; every video frame decodes and frame counts match the episode table" if ns.deep else ""))
    if reader.version == "v3.0":
        from ..data.lerobot_format import crosscheck_with_lerobot

        print(crosscheck_with_lerobot(reader))
    if ns.embodiment:
        emb = get_embodiment(ns.embodiment, registry_of(ns))
        spec = WindowSpec(ns.chunks, emb.action_horizon, 4 * ns.frames_per_block, emb.sampling)
        ds = WindowDataset(reader, emb, spec, statistics=None, train=False, skip_missing=ns.skip_missing)
        if ds.missing:
            print(f"embodiment {emb.tag}: episode(s) {sorted({ep for ep, _ in ds.missing})} skipped (video files of "
                  "its views missing)")
        sample = ds.sample(0)
        print(f"embodiment {emb.tag}: {len(ds)} anchors ({len(ds.index.skipped)} segments too short), "
              f"state {ds.keys.state_dim} dims, action {ds.keys.action_dim} dims, "
              f"frames {tuple(sample['images'].shape)}")
        print(f"prompt: {sample['prompt']}")
    return EXIT_OK


def cmd_embodiment_init(ns: argparse.Namespace) -> int:
    from ..data.embodiment_draft import write_draft
    from ..data.embodiments import load_embodiments

    tag, path = write_draft(ns.dataset, ns.out, tag=ns.tag, action_horizon=ns.action_horizon,
                            view_size=tuple(ns.view_size) if ns.view_size else None, overwrite=ns.overwrite,
                            presets=ns.presets, preset=getattr(ns, "preset", None))
    emb = load_embodiments([path])[tag]
    print(f"wrote {path} [{tag}]: views {list(emb.views)} at {list(emb.view_size)}, state "
          f"{[(k.name, k.dim) for k in emb.state]}, action {[(k.name, k.dim) for k in emb.action]}, "
          f"action_horizon {emb.action_horizon}, robot: {emb.robot.kind} ({emb.robot.name})")
    print(f"review it (the robot: block above all), then: dz data check {ns.dataset} --embodiment {tag} "
          f"--embodiments {path}")
    return EXIT_OK


def _horizon_table(presets: dict[str, int]) -> str:
    return ", ".join(f"{name} {n}" for name, n in presets.items())


def add_commands(sub, recorder=None, presets: dict[str, int] | None = None):
    """`dz data ...`. recorder: how `dz data fetch libero` records (`fetch_dataset`'s; LIBERO lives above this
    layer). presets: each model preset's num_action_per_block, first the default (`dz embodiment init --preset`;
    the presets live above this layer). Returns the group's subparsers, to which other packages add (`dz data
    record`)."""

    data = sub.add_parser("data", help="datasets: fetch, synth, metadata, check").add_subparsers(dest="cmd", required=True)
    p = data.add_parser("fetch", help="fetch a dataset (hub id at a revision, a local path, or 'synthetic')",
                        epilog=example("dz data fetch synthetic --name demo_synth",
                                       "dz data fetch build/synth --name my_copy"))
    p.add_argument("source", help="a Hugging Face hub dataset id, a local dataset directory, 'synthetic' (the "
                                  "embedded generator) or 'libero' (recorded with the scripted expert)")
    p.add_argument("--dest", default="data/datasets", help="the project's data directory (DVC-tracked)")
    p.add_argument("--revision", help="required for hub ids: a commit sha or tag")
    p.add_argument("--allow", action="append", help="allow-pattern (repeatable), e.g. 'meta/*' 'data/*'")
    p.add_argument("--name", help="directory name under --dest")
    p.add_argument("--retries", type=int, default=3, help="hub downloads: retries of transient errors (network, 5xx)")
    p.add_argument("--retry-delay", type=float, default=10.0, help="seconds before the first retry (doubles each time)")
    p.add_argument("--skip-missing", action="store_true",
                   help="accept a dataset that lacks some video files (train with --skip-missing to skip their episodes)")
    p.add_argument("--synth-episodes", type=int, default=8, help="with source 'synthetic': episodes to generate")
    p.add_argument("--seed", type=int, default=0, help="with source 'synthetic': the generator's random seed")
    p.set_defaults(func=cmd_data_fetch, recorder=recorder)
    p = data.add_parser("synth", help="generate the embedded LIBERO-like (or DROID-like) LeRobot v3.0 dataset",
                        epilog=example("dz data synth build/synth --episodes 4 --length 48",
                                       "dz data synth build/droid_synth --embodiment oxe_droid --codec h264"))
    p.add_argument("out", help="the dataset directory to write (written whole, then renamed into place)")
    p.add_argument("--episodes", type=int, default=8, help="episodes to generate")
    p.add_argument("--length", type=int, default=96, help="frames per episode")
    p.add_argument("--image-size", type=int, default=64, help="height and width of each camera view, in pixels")
    p.add_argument("--codec", choices=["av1", "h264"], default="av1",
                   help="video codec: av1 (LeRobot's default) or h264")
    p.add_argument("--seed", type=int, default=0, help="random seed (the same seed writes the same dataset)")
    p.add_argument("--motion", choices=["walk", "orbit"], default="walk",
                   help="orbit: actions predictable from one frame (the demo's); walk: random walks")
    p.add_argument("--embodiment", choices=["libero_sim", "oxe_droid", "unitree_g1"], default="libero_sim",
                   help="oxe_droid: DROID's three views, 14-dim state and 21-dim action columns; unitree_g1: a "
                        "humanoid's head camera and 26 joint positions as state and action")
    p.add_argument("--overwrite", action="store_true", help="replace an existing dataset directory at OUT")
    p.set_defaults(func=cmd_data_synth)

    p = data.add_parser("metadata", help="normalisation stats (metadata.json) for a dataset + embodiment",
                        epilog=example("dz data metadata build/synth --embodiment libero_sim "
                                       "--out build/metadata.json"))
    p.add_argument("dataset", help="a LeRobot dataset directory")
    p.add_argument("--embodiment", required=True,
                   help="the embodiment tag whose state and action keys are summarised (e.g. libero_sim)")
    p.add_argument("--embodiments", action="append", help="extra embodiment YAML file(s)")
    p.add_argument("--out", required=True, help="metadata.json to write (never inside the dataset)")
    p.add_argument("--overwrite", action="store_true", help="replace an --out file that is not a metadata.json written by dz")
    p.add_argument("--merge", action="store_true", help="merge into an existing metadata.json")
    p.add_argument("--max-episodes", type=int, help="statistics from the first N episodes only (default: all)")
    p.add_argument("--heldout-episodes", type=int, default=0,
                   help="leave out the last N episodes (train.heldout_episodes): statistics of the training episodes")
    p.add_argument("--skip-missing", action="store_true",
                   help="leave out the episodes whose video files are missing, as training with --skip-missing "
                        "does (they are listed, and recorded as skipped_episodes)")
    p.add_argument("--allow-outside-root", action="store_true",
                   help="read data and video files that meta/info.json's path templates place outside the dataset's "
                        "folder (after symlinks); refused by default")
    p.set_defaults(func=cmd_data_metadata)
    p = data.add_parser("check", help="verify a dataset's files and, with --embodiment, its keys and one sample",
                        epilog=example("dz data check build/synth --embodiment libero_sim",
                                       "dz data check build/synth --deep"))
    p.add_argument("dataset", help="a LeRobot dataset directory")
    p.add_argument("--embodiment", help="also check this embodiment's keys and read one training window through it")
    p.add_argument("--embodiments", action="append", help="extra embodiment YAML file(s)")
    p.add_argument("--chunks", type=int, default=4, help="action chunks per window (the model's max_chunk_size)")
    p.add_argument("--frames-per-block", type=int, default=2,
                   help="latent frames per block (the model's num_frame_per_block); a window reads 4x this many "
                        "video frames per chunk")
    p.add_argument("--skip-missing", action="store_true", help="report missing video files, use the other episodes")
    p.add_argument("--deep", action="store_true",
                   help="also decode every frame of every video (strict): the first frame that does not decode, "
                        "frame counts against the episode table")
    p.add_argument("--allow-outside-root", action="store_true",
                   help="read data and video files that meta/info.json's path templates place outside the dataset's "
                        "folder (after symlinks); refused by default")
    p.set_defaults(func=cmd_data_check)

    robots = sub.add_parser("embodiment", help="robot descriptions: draft one from a dataset").add_subparsers(
        dest="cmd", required=True)
    p = robots.add_parser("init", help="draft an embodiment YAML from a LeRobot dataset's info.json, to review",
                          epilog=example("dz embodiment init build/synth --tag my_robot --out my_robot.yaml "
                                         "--preset tiny"))
    p.add_argument("dataset", help="a LeRobot dataset directory (its meta/info.json is read)")
    p.add_argument("--tag", help="the embodiment's name (default: the dataset directory's)")
    p.add_argument("--out", help="the YAML file to write (default: TAG.yaml here; never inside the dataset)")
    presets = dict(presets or {})
    if presets:
        table = _horizon_table(presets)
        p.add_argument("--preset", choices=list(presets), default=next(iter(presets)),
                       help=f"the model preset you will train: the draft's action_horizon is its num_action_per_block "
                            f"({table}; default %(default)s)")
    p.add_argument("--action-horizon", type=int, required=not presets,
                   help="actions per chunk, instead of the preset's num_action_per_block; train the model with "
                        "train.model_overrides.num_action_per_block set to it")
    p.add_argument("--view-size", type=int, nargs=2, metavar=("H", "W"),
                   help="each view's size after crop and resize (default: the first camera's aspect, the longer side at "
                        "most 64 for --preset tiny, 128 for small, 256 otherwise)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    p.set_defaults(func=cmd_embodiment_init, presets=presets)

    return data
