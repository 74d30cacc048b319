"""Sharded DCP checkpoints, written atomically, and exact resume.

Layout: <out>/checkpoints/step_0000010/
    .metadata, __<rank>_0.distcp     model + optimizer (torch.distributed.checkpoint, sharded under FSDP)
    rng_rank<r>.safetensors          each rank's torch RNG and noise-generator states
    trainer_state.json               step, samples consumed per rank, config
    COMPLETE                         written last
Everything is written into a fresh temporary directory `step_XXXXXXX.<random>.tmp/` (made by rank 0, its name
sent to the other ranks), which is renamed only after every rank finished and the COMPLETE marker exists. A torn
write (a crash, `kill -9`) leaves a `.tmp` directory that is never loaded (only `step_XXXXXXX` is a checkpoint)
and is removed by the next save; a link or file at a `.tmp` name is removed, never followed.

Loading runs no code from the checkpoint. DCP's `.metadata` is a pickle, and its non-tensor items (the
optimizer's hyperparameters) are `torch.save` pickles that DCP would load with `weights_only=False`: here the
metadata goes through an unpickler that admits only DCP's own record classes, torch sizes, dtypes and layouts,
and the items through `torch.load(weights_only=True)`. Anything else is a CheckpointError naming the file.
The metadata is read whole (at most MAX_METADATA_BYTES) by Python's own unpickler, whose memo is a mapping: an
index written in the file allocates nothing, where the C unpickler sizes an array by it (13 bytes asking for 64 GiB).
A shard file (`__<rank>_0.distcp`) that is missing, shorter than the metadata says or unreadable is a
CheckpointError naming that file, checked before and while each file is read; so is a damaged
`trainer_state.json` or RNG file, and any of these files that is not a regular file (a FIFO is never opened for
reading).
"""

from __future__ import annotations

import enum
import io
import json
import os
import pathlib
import pickle
import re
import shutil
import stat
import tempfile
import warnings
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.metadata as dcp_metadata
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

from ..atomic import NEW_DIR_MODE

STEP_DIR = re.compile(r"^step_(\d{7})$")
MARKER = "COMPLETE"
# DCP's metadata lists every saved tensor's chunks: a few MB for a 14B model sharded over many ranks.
MAX_METADATA_BYTES = 256 * 2**20
# trainer_state.json: the step, the samples consumed and the run's config (a few KB).
MAX_TRAINER_STATE_BYTES = 16 * 2**20


class CheckpointError(ValueError):
    """A checkpoint that must not be loaded; the message names the file."""


class _MetadataUnpickler(pickle._Unpickler):  # noqa: SLF001 - Python's own: a memo mapping
    """DCP's metadata records and the torch values inside them, nothing else: a class or function from any
    other place (os.system, builtins.eval, a gadget in some installed package) is refused before it is called."""

    def __init__(self, file, source: Path):
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str):
        found = None
        if module == dcp_metadata.__name__:
            found = getattr(dcp_metadata, name, None)
            # DCP's own records are dataclasses and enums: building them runs no code of the file's choosing
            ok = isinstance(found, type) and (hasattr(found, "__dataclass_fields__") or issubclass(found, enum.Enum))
            found = found if ok else None
        elif (module, name) == ("torch.distributed.checkpoint.filesystem", "_StorageInfo"):
            found = _StorageInfo
        elif (module, name) == ("torch", "Size"):
            found = torch.Size
        elif module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                            torch.memory_format)):
            found = getattr(torch, name)
        elif (module, name) == ("torch.serialization", "_get_layout"):  # a layout by name, nothing else
            found = torch.serialization._get_layout
        elif (module, name) in (("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
                                ("pathlib", "PureWindowsPath")):  # the checkpoint id DCP records; never opened
            found = getattr(pathlib, name)
        if found is None:
            raise CheckpointError(f"{self.source}: refused {module}.{name}: checkpoint metadata may hold only "
                                  "DCP's own records (a crafted or foreign file?)")
        return found


def read_regular_file(path: Path, max_bytes: int, what: str) -> bytes:
    """The bytes of `path`, a regular file of at most `max_bytes` bytes; FileNotFoundError if it is absent, else
    CheckpointError naming it (a FIFO, a device or a directory is refused without waiting on it)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read the {what} ({exc.strerror or exc})") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CheckpointError(f"{path}: the {what} is not a regular file")
        try:
            data = f.read(max_bytes + 1)
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot read the {what} ({exc.strerror or exc})") from None
    if len(data) > max_bytes:
        raise CheckpointError(f"{path}: the {what} is larger than the {max_bytes // 2**20} MiB it may hold")
    return data


def read_trainer_state(ckpt: Path) -> dict:
    """A checkpoint's trainer_state.json: a mapping whose `step` is a count, whose `config`, if any, is a mapping
    and whose `workdir`, if any, is a path; else a CheckpointError naming the file."""
    path = Path(ckpt) / "trainer_state.json"
    data = read_regular_file(path, MAX_TRAINER_STATE_BYTES, "trainer state")
    try:
        state = json.loads(data)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError
        raise CheckpointError(f"{path}: not valid JSON ({_brief(exc)})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: expected a mapping of the step and the run's config, got "
                              f"{type(state).__name__}")
    step = state.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 2**63:
        raise CheckpointError(f"{path}: step: expected a count of steps, got {str(step)[:40]}")
    for key, kind in (("config", dict), ("workdir", str), ("base", dict), ("samples", int)):
        if state.get(key) is not None and not isinstance(state[key], kind):
            raise CheckpointError(f"{path}: {key}: expected {'a mapping' if kind is dict else 'a ' + kind.__name__}"
                                  f", got {type(state[key]).__name__}")
    return state


def read_metadata_safely(path: Path) -> Metadata:
    """A DCP metadata file through `_MetadataUnpickler`; CheckpointError if it is crafted, torn or foreign."""
    data = read_regular_file(path, MAX_METADATA_BYTES, "checkpoint metadata")
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data), path).load()
    except CheckpointError:
        raise
    except Exception as exc:  # truncated, or not a pickle at all
        raise CheckpointError(f"{path}: unreadable checkpoint metadata ({type(exc).__name__}: {exc})") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path}: holds a {type(metadata).__name__}, not DCP metadata")
    for info in (metadata.storage_data or {}).values():  # shard files sit beside .metadata, nowhere else
        rel = getattr(info, "relative_path", None)
        if not isinstance(rel, str) or rel in ("", ".", "..") or Path(rel).name != rel or "\\" in rel:
            raise CheckpointError(f"{path}: refers to a shard file {rel!r} outside the checkpoint directory")
    return metadata


class SafeReader(FileSystemReader):
    """FileSystemReader whose metadata is read by `read_metadata_safely` instead of `pickle.load`, and whose
    shard files are read one at a time, each checked first: a missing, short or unreadable one is a
    CheckpointError naming it."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        metadata = read_metadata_safely(Path(self._get_metadata_path(kwargs.get("rank"))))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan, planner):
        per_file: dict[str, list] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in per_file.items():
            shard = Path(str(self.path)) / name
            self._check_length(shard, items)
            try:
                super().read_data(replace(plan, items=items), planner)  # done when it returns
            except CheckpointError:
                raise
            except Exception as exc:
                raise CheckpointError(f"{shard}: truncated or unreadable checkpoint shard ({_brief(exc)})") from None
        return super().read_data(replace(plan, items=[]), planner)  # DCP's own completed future

    def _check_length(self, shard: Path, items: list) -> None:
        """The shard is there and holds every byte the metadata places in it for `items`."""
        try:
            size = shard.stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"{shard}: missing checkpoint shard (the checkpoint's metadata lists it)") from None
        needed = max(self.storage_data[item.storage_index].offset + self.storage_data[item.storage_index].length
                     for item in items)
        if size < needed:
            raise CheckpointError(f"{shard}: truncated or unreadable checkpoint shard ({size:,} bytes; the "
                                  f"checkpoint's metadata needs at least {needed:,})")


def _brief(exc: BaseException) -> str:
    """An exception as one short line: its type and the first sentence of its message."""
    text = " ".join(str(exc).split())
    first = text.split(". ")[0]
    if len(first) > 160:
        first = first[:157] + "..."
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _wrapped_refusal(exc: BaseException) -> CheckpointError | None:
    """The CheckpointError inside DCP's CheckpointException (which wraps each rank's error), if any."""
    if isinstance(exc, CheckpointError):
        return exc
    for failure in (getattr(exc, "failures", None) or {}).values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, CheckpointError):
            return inner
    return None


@contextmanager
def safetensors_os_errors(where: str | os.PathLike):
    """safetensors reports a failed write (a full disk, a denied permission) as a SafetensorError with the OS
    message; here it becomes that OSError (errno, message, the path it names or `where`), so that a full disk is
    handled as every other one."""
    try:
        yield
    except SafetensorError as exc:
        code = re.search(r"\(os error (\d+)\)", str(exc))
        if code is None:
            raise
        named = re.search(r'at path "([^"]*)"', str(exc))
        err = int(code.group(1))
        raise OSError(err, os.strerror(err), named.group(1) if named else str(where)) from None


class SafeLoadPlanner(DefaultLoadPlanner):
    """Non-tensor items (optimizer hyperparameters: floats, tuples, strings) through `weights_only=True`.
    DCP wraps what a planner raises; `refused` keeps our own message for the caller."""

    def __init__(self, source: Path):
        super().__init__()
        self.source = source
        self.refused: CheckpointError | None = None

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            self.refused = CheckpointError(f"{self.source}: item {read_item.dest_index.fqn} refused by "
                                           f"torch.load(weights_only=True): {str(exc).splitlines()[0]}")
            raise self.refused from None
        super().load_bytes(read_item, _saved(obj))


def _saved(obj) -> io.BytesIO:
    """`obj` as DefaultLoadPlanner.load_bytes expects it (it torch.loads its argument): re-serialised from the
    already vetted value, so what it unpickles is our own pickle of plain values."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _dist() else 0


def _barrier() -> None:
    if _dist():
        dist.barrier()


@contextmanager
def _single_process_quietly():
    """DCP warns on every save and load without a process group that it assumes one process: that is meant."""
    with warnings.catch_warnings():
        if not _dist():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def checkpoint_dir(out_dir: str | Path) -> Path:
    return Path(out_dir) / "checkpoints"


def _model_options(model: torch.nn.Module) -> StateDictOptions:
    """Only the trainable tensors of a model with frozen ones (LoRA: the base is referenced, not copied)."""
    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)


def save_checkpoint(out_dir: str | Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    trainer_state: dict, rng_states: dict[str, torch.Tensor],
                    ema: dict[str, torch.Tensor] | None = None) -> Path:
    """ema: the EMA weights by parameter name (saved sharded beside the model, under "ema")."""
    root = checkpoint_dir(out_dir)
    final = root / f"step_{step:07d}"
    rank = _rank()
    made = [None]
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        _sweep_stale(root)
        made[0] = tempfile.mkdtemp(prefix=f"{final.name}.", suffix=".tmp", dir=root)
        os.chmod(made[0], NEW_DIR_MODE)  # as a plain mkdir would make it (mkdtemp: 0700)
    if _dist():  # every rank writes its shards into the directory rank 0 made
        dist.broadcast_object_list(made, src=0)
    tmp = Path(made[0])
    state = {"model": get_model_state_dict(model, options=_model_options(model)),
             "optim": get_optimizer_state_dict(model, optimizer)}
    if ema is not None:
        state["ema"] = ema
    with _single_process_quietly():
        dcp.save(state, checkpoint_id=str(tmp))
    with safetensors_os_errors(tmp):
        save_file({k: v.contiguous() for k, v in rng_states.items()}, str(tmp / f"rng_rank{rank}.safetensors"))
    _barrier()
    if rank == 0:
        (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=1))
        with open(tmp / MARKER, "w") as f:
            f.write(str(step))
            f.flush()
            os.fsync(f.fileno())
        if final.is_symlink() or final.is_file():  # removed, never followed
            final.unlink()
        elif final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    _barrier()
    return final


def _sweep_stale(root: Path) -> None:
    """Removes what a torn save left (`step_*.tmp`): a directory with what is inside it, a file or a link
    itself (a link is never followed, so what it points to stays)."""
    for stale in root.glob("step_*.tmp"):
        try:
            if stale.is_symlink() or not stale.is_dir():
                stale.unlink()
            else:
                shutil.rmtree(stale)
        except OSError:  # one that cannot be removed is left; the new checkpoint does not need its name
            pass


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    """The newest complete checkpoint; `.tmp` (torn) directories and ones without the marker are ignored."""
    steps = list_checkpoints(out_dir)
    return steps[-1][1] if steps else None


def list_checkpoints(out_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint, oldest first."""
    root = checkpoint_dir(out_dir)
    if not root.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and (p / MARKER).is_file())


def load_checkpoint(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                    ema: dict[str, torch.Tensor] | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """Restore model (and optimizer, and the EMA weights into `ema`'s tensors) in place; return
    (trainer_state, this rank's RNG states)."""
    path = Path(path)
    if not (path / MARKER).is_file():
        raise FileNotFoundError(f"{path}: not a complete checkpoint (no {MARKER} marker)")
    options = _model_options(model)
    state = {"model": get_model_state_dict(model, options=options)}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    if ema is not None:
        state["ema"] = ema
    trainer_state = read_trainer_state(path)
    read_metadata_safely(path / ".metadata")  # refused here, before DCP would wrap the error in its own
    planner = SafeLoadPlanner(path)
    try:
        with _single_process_quietly():
            dcp.load(state, storage_reader=SafeReader(path), planner=planner)
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        refused = planner.refused or _wrapped_refusal(exc)
        if refused is not None:
            raise refused from None
        raise
    set_model_state_dict(model, state["model"], options=options)
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optim"])
    return trainer_state, _read_rng(path / f"rng_rank{_rank()}.safetensors")


def _read_rng(path: Path) -> dict[str, torch.Tensor]:
    """A rank's RNG states (none if the file is absent); a damaged file is a CheckpointError naming it. torch's
    generator state is a byte tensor (`torch.get_rng_state`); one of another type is refused here."""
    if not path.exists():
        return {}
    if not path.is_file():
        raise CheckpointError(f"{path}: the RNG states are not a regular file")
    try:
        rng = load_file(str(path))
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{path}: unreadable RNG states ({_brief(exc)})") from None
    torch_state = rng.get("torch")
    if torch_state is not None and (torch_state.dtype != torch.uint8 or
                                    tuple(torch_state.shape) != tuple(torch.get_rng_state().shape)):
        raise CheckpointError(f"{path}: torch: expected the byte tensor torch.get_rng_state() gives, got "
                              f"{torch_state.dtype} {tuple(torch_state.shape)}")
    return rng
