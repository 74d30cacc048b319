"""Variants of the hostile parameter and checkpoint files: a YAML document whose merges (`<<: *base`) copy keys
quadratically, a large document of small values, a DCP `.metadata` pickle whose memo index asks for gigabytes, a
damaged `trainer_state.json` or RNG file under `dz convert`, and a safetensors index naming shards outside its
directory. Each is one quick error line naming the file, in little memory."""

from __future__ import annotations

import json
import os
import shutil
import struct
import threading
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import pytest
import torch
import yaml

from dzmodel.cli import main
from dzmodel.model.state_dict import INDEX_NAME, StateDictError, load_dreamzero_dir, save_dreamzero_dir
from dzmodel.schema import load_yaml
from dzmodel.train.checkpoint import CheckpointError, latest_checkpoint, read_metadata_safely
from tests.hostile.guarded import run_guarded
from tests.tiny_data import make_one_step_run

ROOT = Path(__file__).resolve().parents[2]

MAX_SECONDS, MAX_GROWTH_MB = 2.0, 300


def _refused_quickly(body: str, *expected: str) -> str:
    """`body` (which prints REFUSED and the error) in a watched child: one line, within the time and memory."""
    outcome = run_guarded("import dzmodel.schema, dzmodel.train.checkpoint, yaml\n", body)
    assert not outcome.killed, outcome.killed
    lines = outcome.lines()
    assert lines and lines[0].startswith("REFUSED "), outcome.out[-2000:]
    assert outcome.elapsed < MAX_SECONDS, outcome.out
    assert outcome.growth_mb < MAX_GROWTH_MB, outcome.out
    message = lines[0][len("REFUSED "):]
    for text in expected:
        assert text in message, message
    return message


# -- YAML --

def merge_chain(levels: int, width: int) -> str:
    """A base mapping of `width` keys, then `levels` mappings each merging the one before and adding a key: the
    document is short, the merges copy about levels x width keys."""
    rows = ["a0: &a0 {" + ", ".join(f"k{j}: 1" for j in range(width)) + "}"]
    rows += [f"a{i}: &a{i} {{<<: *a{i - 1}, n{i}: 1}}" for i in range(1, levels)]
    return "\n".join(rows)


def _load_refused_quickly(path: Path, *words: str) -> None:
    """`load_yaml` of `path`, in a guarded process: refused with `words` in the message, quickly, in little memory."""
    _refused_quickly(f"""
        try:
            dzmodel.schema.load_yaml(__import__("pathlib").Path({str(path)!r}))
            print("ACCEPTED")
        except yaml.YAMLError as exc:
            print("REFUSED " + str(exc).replace(chr(10), " | "))
        """, *words)


def test_a_chain_of_merges_is_refused_quickly_in_little_memory(tmp_path):
    path = tmp_path / "merges.yaml"
    path.write_text(merge_chain(1000, 1000))  # 41 KB; a million keys copied
    _load_refused_quickly(path, "values in one document", "merges (<<)")


def test_a_chain_of_merges_in_params_yaml_is_one_line(tmp_path, capsys):
    path = tmp_path / "params.yaml"
    path.write_text(merge_chain(1000, 1000) + "\nprofile: demo\nprofiles: {}\n")
    assert main(["params", "check", "--params", str(path)]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "merges (<<)" in err and str(path) in err, err


@pytest.mark.parametrize("text", [
    "[" + "1, " * 150_000 + "1]",                          # a flow list of small values (450 KB)
    "\n".join(f"k{i}: 1" for i in range(60_000)),          # a block mapping of small values (600 KB)
], ids=["flow-list", "block-mapping"])
def test_a_large_document_of_small_values_is_refused_within_a_second_or_two(tmp_path, text):
    path = tmp_path / "many.yaml"
    path.write_text(text)
    _load_refused_quickly(path, "values in one document")


def test_merges_and_documents_of_ordinary_size_still_load():
    assert load_yaml(merge_chain(20, 50))["a19"]["k49"] == 1
    assert load_yaml("base: &b {x: 1, y: 2}\nover: {<<: *b, y: 3}\n") == {"base": {"x": 1, "y": 2},
                                                                             "over": {"x": 1, "y": 3}}
    assert len(load_yaml("[" + "1, " * 20_000 + "1]")) == 20_001
    with pytest.raises(yaml.YAMLError, match="nested deeper than"):
        load_yaml("a: " + "[" * 5000 + "]" * 5000)


# -- DCP metadata --

def test_a_metadata_pickle_whose_memo_index_asks_for_gigabytes_is_refused_in_little_memory(tmp_path):
    path = tmp_path / ".metadata"
    # PROTO 2, EMPTY_LIST, LONG_BINPUT 2**27, STOP: Python's C unpickler sizes its memo array to twice the index
    path.write_bytes(b"\x80\x02]r" + struct.pack("<I", 2**27) + b".")
    _refused_quickly(f"""
        from pathlib import Path
        try:
            dzmodel.train.checkpoint.read_metadata_safely(Path({str(path)!r}))
            print("ACCEPTED")
        except dzmodel.train.checkpoint.CheckpointError as exc:
            print("REFUSED " + str(exc))
        """, str(path), "not DCP metadata")


def test_a_fifo_as_metadata_is_refused_without_waiting(tmp_path):
    path = tmp_path / ".metadata"
    os.mkfifo(path)
    with _writer_unblocks(path):
        with pytest.raises(CheckpointError, match="not a regular file"):
            read_metadata_safely(path)


@contextmanager
def _writer_unblocks(fifo: Path):
    """While inside: a reader that opens `fifo` (and would wait there for a writer forever) gets a writer that
    closes at once, so a test of code that opens it ends, with the reader's end-of-file, instead of hanging."""
    done = threading.Event()

    def writer():
        while not done.is_set():
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # ENXIO while no reader waits
            except OSError:
                time.sleep(0.05)

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


# -- dz convert of a damaged checkpoint --

@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    root = make_one_step_run(tmp_path_factory.mktemp("params_variants"))
    return root / "run"


def _trainer_state(ckpt: Path) -> dict:
    return json.loads((ckpt / "trainer_state.json").read_text())


def _bad_config(ckpt: Path) -> None:
    state = _trainer_state(ckpt)
    state["config"].update(steps=-1, lr=5)
    (ckpt / "trainer_state.json").write_text(json.dumps(state))


def _fifo(ckpt: Path) -> None:
    (ckpt / "trainer_state.json").unlink()
    os.mkfifo(ckpt / "trainer_state.json")


DAMAGES = {
    "not-json": (lambda c: (c / "trainer_state.json").write_text("{not json"), "trainer_state.json: not valid JSON"),
    "a-list": (lambda c: (c / "trainer_state.json").write_text("[1, 2]"), "trainer_state.json: expected a mapping"),
    "no-config": (lambda c: (c / "trainer_state.json").write_text('{"step": 1}'), "trainer_state.json: no config"),
    "deep": (lambda c: (c / "trainer_state.json").write_text("[" * 100_000 + "]" * 100_000),
             "trainer_state.json: not valid JSON"),
    "bad-config": (_bad_config, "trainer_state.json: config.steps: must be >= 1, got -1; config.lr"),
    "fifo": (_fifo, "trainer_state.json: the trainer state is not a regular file"),
    "rng-file": (lambda c: (c / "rng_rank0.safetensors").write_bytes(b"\xff" * 64),
                 "rng_rank0.safetensors: unreadable RNG states"),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_dz_convert_of_a_damaged_trainer_state_or_rng_file_is_one_line(run, tmp_path, capsys, damage):
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    ckpt = latest_checkpoint(copy)
    do, expected = DAMAGES[damage]
    do(ckpt)
    fifo = ckpt / "trainer_state.json"
    with _writer_unblocks(fifo) if fifo.is_fifo() else nullcontext():
        assert main(["convert", str(copy), "--out", str(tmp_path / "hf")]) != 0
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith("dz: error: ") and expected in err, err
    assert not (tmp_path / "hf").exists()


# -- a converted model's safetensors index --

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from dzmodel.model.args import preset
    from dzmodel.model.wam import DreamZeroWAM

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("model") / "hf"
    save_dreamzero_dir(DreamZeroWAM(preset("tiny")), out)
    return out


@pytest.mark.parametrize("weight_map, words", [
    ({"x": "../outside.safetensors"}, "a shard must be a file name beside the index"),
    ({"x": "/etc/passwd"}, "a shard must be a file name beside the index"),
    ({"x": 5}, "a shard must be a file name beside the index"),
    ([1], "not a safetensors index"),
])
def test_an_index_naming_shards_outside_its_directory_or_of_the_wrong_type_is_refused(model_dir, tmp_path,
                                                                                      weight_map, words):
    copy = tmp_path / "hf"
    shutil.copytree(model_dir, copy)
    outside = tmp_path / "outside.safetensors"
    shutil.copyfile(copy / "model.safetensors", outside)  # a real shard, so only the name can refuse it
    (copy / "model.safetensors").unlink()
    (copy / INDEX_NAME).write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(StateDictError, match=words):
        load_dreamzero_dir(copy)


def test_an_index_of_shards_beside_it_still_loads(model_dir, tmp_path):
    copy = tmp_path / "hf"
    shutil.copytree(model_dir, copy)
    (copy / INDEX_NAME).write_text(json.dumps({"weight_map": {"x": "model.safetensors"}}))
    assert load_dreamzero_dir(copy) is not None


@pytest.mark.parametrize("section, key, limit", [
    ("train", "micro_batch", 1 << 16), ("train", "global_batch", 1 << 20), ("train", "nvdec_threads", 256),
    ("train", "encoded_variants", 64), ("train", "pack_capacity", 1 << 24), ("train", "frame_cache_mib", 1 << 20),
    ("vision", "batch_size", 1 << 16), ("vision", "clip_frames", 1024), ("vision", "frame_cache_mib", 1 << 20),
    ("cache", "batch_size", 1 << 16), ("eval", "previews", 1000), ("eval", "videos", 1000),
    ("eval", "episodes", 10_000), ("fetch", "synth_episodes", 100_000), ("fetch", "synth_length", 100_000),
    ("fetch.record", "episodes", 10_000), ("fetch.record", "gop", 1000),
])
def test_sizes_and_counts_that_become_allocations_have_an_upper_bound(section, key, limit):
    """A batch, a thread or process count, a cache size or a number of episodes of 1e12 would be allocated (or
    spawned) at run time: `dz params check` refuses it by field."""
    from dzmodel.config import ParamsError, parse_params

    def with_value(v):
        raw = yaml.safe_load((ROOT / "params.yaml").read_text())
        node = raw["profiles"]["demo"]
        for part in section.split("."):
            node = node.setdefault(part, {})
        node[key] = v
        return raw

    with pytest.raises(ParamsError, match=rf"profiles\.demo\.{section}\.{key}: must be in \[\d+, {limit}\], got {10**12}"):
        parse_params(with_value(10**12), "params.yaml")
