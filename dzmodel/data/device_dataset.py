"""The device-resident data path (`train.data_on_device`): a whole recording decoded once onto the training device,
micro-batches gathered there by index, augmented there, no DataLoader workers.

For small datasets (LIBERO-scale: a LIBERO-Object recording at 128 px is a few GB) the CPU loader is the bottleneck:
every sample decodes H.264 and runs crop, resize and jitter on a CPU core. Here:

* `DeviceRecording` decodes every (episode, view) once (`decodes` counts them), in a few threads, into one uint8
  tensor per view [frames, H, W, 3] on the device, at the recorded size (kept so that a random crop has its margin;
  a recording larger than the crop needs is downscaled once, `augment.stored_size`). The embodiment's state and
  action vectors of every frame go there too (float64, as the CPU path computes them), with the q99 statistics of
  `WindowDataset`, each anchor's window start and prompt, and every prompt tokenised once.
* `DeviceBatches` replaces the DataLoader: it reads the same `SampleStream` (same order, same positions, so resume is
  exact and positions seed the noise as before), gathers each micro-batch's windows with index arithmetic, augments
  it (`augment.py`), and returns the collate's keys, shapes and dtypes (`collate.Collator`) on the device, with
  `position` on the host as the step expects. With augmentation off (`train=False`) the batch equals the CPU loader's
  for the same windows (tests/data/test_device_dataset.py).

Nothing in a batch reads the device back: the host computes each window's rows and augmentation numbers from
arrays it holds (a few hundred bytes per micro-batch) and copies them over without waiting.

Encoding stays live (the frozen VAE, umT5 and CLIP run on each micro-batch in `TrainStep`): augmented frames cannot
come from the `dz cache` encodings, so `data_on_device` and `train.cache` exclude each other.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from .augment import ViewAugment, augment_views, draw, params_to_device, stored_size, to_device
from .dataset import WindowDataset
from .errors import DataError
from .sampling import SampleStream
from .transforms import compose_layout


def _resize_uint8(frames: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """uint8 [T, H, W, 3] -> [T, size, 3], antialiased (once, at load, for recordings larger than needed)."""
    x = torch.from_numpy(frames).permute(0, 3, 1, 2)
    x = F.interpolate(x, size=size, mode="bilinear", align_corners=False, antialias=True)
    return x.permute(0, 2, 3, 1).contiguous().numpy()


class DeviceRecording:
    """One `WindowDataset`'s episodes on `device`: frames per view, state/action vectors, windows and prompts."""

    def __init__(self, ds: WindowDataset, device: torch.device | str, tokenizer, text_len: int,
                 decode_workers: int | None = None, memory_fraction: float = 0.8):
        self.ds, self.emb, self.device = ds, ds.emb, torch.device(device)
        emb, reader, spec = ds.emb, ds.reader, ds.spec
        episodes = sorted({seg.episode for seg in ds.index.segments})
        lengths = [reader.episode(e).length for e in episodes]
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        self.rows = int(offsets[-1])
        first_row = {e: int(o) for e, o in zip(episodes, offsets[:-1])}

        # windows: each anchor's first row in the concatenated recording, and its prompt
        windows = [ds.index.window(i) for i in range(len(ds))]
        self.start_row = np.array([first_row[w.episode] + int(w.start) for w in windows], dtype=np.int64)
        prompts: dict[str, int] = {}
        tasks = {e: reader.task_per_frame(e) for e in episodes}
        self.prompt_id = np.array([prompts.setdefault(emb.prompt(tasks[w.episode][int(w.start)]), len(prompts))
                                   for w in windows], dtype=np.int64)
        self.prompts = list(prompts)
        self.text = self.text_mask = None  # no tokenizer: batches carry images and vectors only (vision pretraining)
        if tokenizer is not None:
            ids, mask = tokenizer(self.prompts, max_length=text_len)
            self.text = ids.long().to(self.device)
            self.text_mask = mask.long().to(self.device)
        H = spec.action_horizon
        self.video_offsets = torch.as_tensor(spec.video_offsets(), device=self.device)
        self.action_offsets = torch.arange(spec.span, device=self.device)
        self.state_offsets = H * torch.arange(spec.num_chunks, device=self.device)

        # vectors of every row (float64, as WindowDataset computes them; non-finite values refused here)
        columns = sorted({k.column for k in emb.state + emb.action})
        state, action = [], []
        for e, n in zip(episodes, lengths):
            cols = reader.read_columns(e, columns)
            rows = np.arange(n)
            state.append(ds._vectors(cols, emb.state, rows, e))
            action.append(ds._vectors(cols, emb.action, rows, e))
        self.state = torch.from_numpy(np.concatenate(state)).to(self.device)
        self.action = torch.from_numpy(np.concatenate(action)).to(self.device)
        self.io = ds.io.to(self.device)  # the CPU loader's vector pipeline, on tensors

        # frames: every (episode, view) decoded once
        self.decodes = 0
        self.frames: dict[str, torch.Tensor] = {}
        self.views: dict[str, ViewAugment] = {}
        workers = decode_workers or min(8, os.cpu_count() or 1)
        self._check_memory(memory_fraction)
        for short, key in emb.views.items():
            self.frames[short], source = self._load_view(key, episodes, offsets, workers)
            self.views[short] = ViewAugment(source=source, size=tuple(emb.view_size), crop_scale=emb.crop_scale,
                                            jitter=dict(emb.color_jitter))
        self.view_list = [self.views[s] for s in emb.views]
        self.encoded: dict[str, torch.Tensor] | None = None  # `encode_variants`

    def __len__(self) -> int:
        return len(self.start_row)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.frames.values())

    def _check_memory(self, fraction: float) -> None:
        """Refuse a recording whose frames would take more than `fraction` of the device's free memory."""
        if self.device.type != "cuda":
            return
        need = 0
        for key in self.emb.views.values():
            shape = tuple(int(d) for d in self.ds.reader.features[key].shape)
            h, w = shape[1:3] if len(shape) == 3 and shape[0] == 3 and shape[2] != 3 else shape[:2]  # HWC or CHW
            h, w = stored_size((h, w), tuple(self.emb.view_size), self.emb.crop_scale)
            need += self.rows * h * w * 3
        free, _ = torch.cuda.mem_get_info(self.device)
        if need > fraction * free:
            raise DataError(f"{self.ds.reader.root}: data_on_device needs {need / 2**30:.1f} GiB on {self.device} for "
                            f"the decoded frames, {free / 2**30:.1f} GiB are free: train from the CPU loader "
                            "(train.data_on_device: false) or hold out episodes")

    def _load_view(self, key: str, episodes: Sequence[int], offsets: np.ndarray, workers: int):
        """Every episode of view `key` decoded once (in `workers` threads) into one uint8 tensor on the device;
        returns it and the size it keeps the frames at."""
        reader, size = self.ds.reader, tuple(self.emb.view_size)

        def decode(e: int) -> np.ndarray:
            return reader.read_frames(e, key, range(reader.episode(e).length), backend=self.ds.video_backend)

        store = source = kept = None
        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            for e, start, frames in zip(episodes, offsets[:-1], pool.map(decode, episodes)):
                self.decodes += 1
                if store is None:
                    source = tuple(frames.shape[1:3])
                    kept = stored_size(source, size, self.emb.crop_scale)
                    store = torch.empty((self.rows, *kept, 3), dtype=torch.uint8, device=self.device)
                elif tuple(frames.shape[1:3]) != source:
                    raise DataError(f"{reader.root}: {key!r} episode {e} has {frames.shape[1]}x{frames.shape[2]} "
                                    f"frames, episode {episodes[0]} has {source[0]}x{source[1]}")
                if kept != source:
                    frames = _resize_uint8(frames, kept)
                store[int(start):int(start) + len(frames)].copy_(torch.from_numpy(frames))
        return store, kept

    # -- one micro-batch (or the part of it from this recording) ------------------------------------

    def gather(self, anchors: np.ndarray, positions: np.ndarray, train: bool, seed: int,
               max_state_dim: int, max_action_dim: int, variants: np.ndarray | None = None) -> dict[str, torch.Tensor]:
        """The collate's tensors for windows `anchors` at stream `positions` (host int arrays), on the device. With
        `variants` (after `encode_variants`), each window's encodings of copy `variants[i]` replace its images."""
        dev, B = self.device, len(anchors)
        if variants is None:
            start, out = self._images(anchors, positions, train, seed)
        else:
            if self.encoded is None:
                raise RuntimeError("gather(variants=...) before encode_variants")
            rows = np.asarray(variants, dtype=np.int64) * len(self) + anchors
            ints = to_device(np.stack([self.start_row[anchors], rows, self.prompt_id[anchors]], axis=1), dev)
            start, rows, prompt = ints[:, 0], ints[:, 1], ints[:, 2]
            out = {key: self.encoded[key][rows] for key in ("clean_latents", "clip_feature", "y") if key in self.encoded}
            out["context"] = self.encoded["context"][prompt]
        out.update(self._vectors(start, B, max_state_dim, max_action_dim))
        return out

    def _images(self, anchors: np.ndarray, positions: np.ndarray, train: bool, seed: int):
        """Each window's first row on the device, and its augmented images and tokenised prompt."""
        aug = draw(seed, positions, self.view_list, train)
        ints, top, left, matrix, coef = params_to_device(
            aug, self.device, np.stack([self.start_row[anchors], self.prompt_id[anchors]], axis=1))
        start, prompt = ints[:, 0], ints[:, 1]
        index = start[:, None] + self.video_offsets                                  # [B, T] rows
        views = augment_views(self.frames, index, self.views, top, left, matrix, coef)
        out = {"images": compose_layout(self.emb, views)}
        if self.text is not None:
            out.update(text=self.text[prompt], text_attention_mask=self.text_mask[prompt])
        return start, out

    def _vectors(self, start: torch.Tensor, B: int, max_state_dim: int, max_action_dim: int) -> dict[str, torch.Tensor]:
        """State and action chunks of the windows starting at rows `start`, normalised and padded, with masks."""
        dev = self.device
        state = self.state[start[:, None] + self.state_offsets]                       # [B, K, S] float64
        action = self.action[start[:, None] + self.action_offsets]                    # [B, K·H, A]
        action = self.io.actions(action, state)  # relative to the raw anchor states, then normalised
        state = self.io.state(state)
        K, S = state.shape[1:]
        N, A = action.shape[1:]
        state_out = torch.zeros(B, K, max_state_dim, device=dev)
        action_out = torch.zeros(B, N, max_action_dim, device=dev)
        state_out[:, :, :S] = state.float()
        action_out[:, :, :A] = action.float()
        state_mask = torch.zeros(B, K, max_state_dim, dtype=torch.bool, device=dev)
        action_mask = torch.zeros(B, N, max_action_dim, dtype=torch.bool, device=dev)
        state_mask[:, :, :S] = True
        action_mask[:, :, :A] = True
        return {
            "state": state_out, "state_mask": state_mask,
            "action": action_out, "action_mask": action_mask,
            "embodiment_id": torch.full((B,), self.emb.tag_id, dtype=torch.long, device=dev),
            "has_real_action": torch.ones(B, dtype=torch.bool, device=dev),
        }

    # -- encoded copies (train.encoded_variants) ----------------------------------------------------

    def encode_variants(self, encode, variants: int, train: bool, seed: int, batch_size: int,
                        progress=None, memory_fraction: float = 0.8) -> None:
        """Encode every window `variants` times and keep the encodings here: copy v of window i is augmented as
        stream position v·N + i would be, and `encode` (a batch of images -> `EncodedBatch`) gives its latents and
        CLIP features; the text encoding is kept once per prompt. `progress(n)` counts encoded windows."""
        N, store = len(self), {}
        context: dict[int, torch.Tensor] = {}
        for v in range(variants):
            for lo in range(0, N, batch_size):
                anchors = np.arange(lo, min(N, lo + batch_size))
                _, batch = self._images(anchors, v * N + anchors, train, seed)
                enc = encode(batch)
                fields = {"clean_latents": enc.clean_latents, "clip_feature": enc.clip_feature, "y": enc.y}
                if not store:
                    per_window = sum(t[0].numel() * t.element_size() for t in fields.values() if t is not None)
                    self._check_encoded_memory(variants * N * per_window, memory_fraction)
                    store = {k: torch.empty((variants * N, *t.shape[1:]), dtype=t.dtype, device=self.device)
                             for k, t in fields.items() if t is not None}
                for key, t in fields.items():
                    if t is not None:
                        store[key][v * N + lo:v * N + lo + len(anchors)] = t
                for j, pid in enumerate(self.prompt_id[anchors].tolist()):  # host ids: no device read
                    if pid not in context:
                        context[pid] = enc.context[j].clone()
                if progress is not None:
                    progress(len(anchors))
        store["context"] = torch.stack([context[p] for p in range(len(self.prompts))])
        self.encoded = store

    def _check_encoded_memory(self, need: int, fraction: float) -> None:
        if self.device.type != "cuda":
            return
        free, _ = torch.cuda.mem_get_info(self.device)
        if need > fraction * free:
            raise DataError(f"{self.ds.reader.root}: train.encoded_variants needs {need / 2**30:.1f} GiB on "
                            f"{self.device} for the encodings, {free / 2**30:.1f} GiB are free: lower "
                            "train.encoded_variants, or set it to 0 (encode every micro-batch)")


def dataset_parts(ids: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """A mixture micro-batch's samples by dataset: (dataset id, the rows of the batch it holds), in id order."""
    return [(int(d), np.flatnonzero(ids == d)) for d in np.unique(ids)]


def in_batch_order(outs: list[dict[str, torch.Tensor]], parts: list[tuple[int, np.ndarray]],
                   device: torch.device) -> dict[str, torch.Tensor]:
    """Each dataset's part of a micro-batch (`dataset_parts`) joined back into the batch's order."""
    if len(outs) == 1:
        return outs[0]
    order = to_device(np.argsort(np.concatenate([rows for _, rows in parts]), kind="stable"), device)
    return {k: torch.cat([o[k] for o in outs])[order] for k in outs[0]}


class DeviceData:
    """Every training dataset on the device, and the micro-batches of a stream (the DataLoader's replacement)."""

    def __init__(self, datasets: Sequence[WindowDataset], device: torch.device | str, tokenizer, text_len: int,
                 max_state_dim: int, max_action_dim: int, train: bool = True, seed: int = 0,
                 decode_workers: int | None = None):
        if not datasets:
            raise DataError("data_on_device needs at least one dataset")
        sizes = {tuple(d.emb.image_size) for d in datasets}
        if len(sizes) > 1:
            raise DataError(f"datasets in one mixture must lay out to the same frame size, got {sorted(sizes)}")
        self.device = torch.device(device)
        self.recordings = [DeviceRecording(d, device, tokenizer, text_len, decode_workers) for d in datasets]
        for d in datasets:
            S, A = d.keys.state_dim, d.keys.action_dim
            if S > max_state_dim or A > max_action_dim:
                raise DataError(f"state {S} / action {A} dims exceed the model's max_state_dim {max_state_dim} / "
                                f"action_dim {max_action_dim}: set train.model_overrides")
        self.max_state_dim, self.max_action_dim = max_state_dim, max_action_dim
        self.train, self.seed = train, seed
        self.variants = 0  # `encode_variants`

    def encode_variants(self, encode, variants: int, batch_size: int, progress=None) -> None:
        """Encode `variants` augmented copies of every window once (`DeviceRecording.encode_variants`); from then
        on a micro-batch carries encodings instead of images, a sample at stream position p taking copy
        (p // windows) mod `variants`: pass e over the data trains on copy e mod `variants`."""
        if variants < 1:
            raise ValueError(f"variants must be >= 1, got {variants}")
        for rec in self.recordings:
            rec.encode_variants(encode, variants, self.train, self.seed, batch_size, progress)
        self.variants = variants

    @property
    def windows(self) -> int:
        return sum(len(r) for r in self.recordings)

    @property
    def decodes(self) -> int:
        return sum(r.decodes for r in self.recordings)

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.recordings)

    def batch(self, items: Sequence[tuple[int, int, int]]) -> dict[str, torch.Tensor]:
        """Items (dataset id, anchor, global position), as a `SampleStream` gives them -> one micro-batch."""
        arr = np.asarray(items, dtype=np.int64).reshape(-1, 3)
        ds_ids, anchors, positions = arr[:, 0], arr[:, 1], arr[:, 2]
        parts = dataset_parts(ds_ids)
        variants = (positions // self.windows) % self.variants if self.variants else None
        outs = [self.recordings[d].gather(anchors[i], positions[i], self.train, self.seed, self.max_state_dim,
                                          self.max_action_dim, None if variants is None else variants[i])
                for d, i in parts]
        out = in_batch_order(outs, parts, self.device)  # a mixture batch: each dataset's rows back in stream order
        out["position"] = torch.from_numpy(positions.copy())  # on the host: it seeds the step's noise draws
        return out

    def batches(self, stream: SampleStream, micro_batch: int) -> Iterator[dict[str, torch.Tensor]]:
        """Endless micro-batches from the stream's current position on (as a DataLoader over a `StreamSampler`)."""
        position = stream.position
        while True:
            yield self.batch([stream.peek(position + i) for i in range(micro_batch)])
            position += micro_batch
