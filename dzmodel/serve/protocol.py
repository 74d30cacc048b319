"""The wire format of the policy server, as openpi's and RoboArena's clients speak it.

Frames are msgpack with numpy arrays in openpi_client's msgpack_numpy layout: an array travels as
{b"__ndarray__": True, b"data": raw bytes, b"dtype": dtype.str, b"shape": shape} (bytes keys); the dtype
must be such a plain type string (no structured or subarray dtype, which numpy builds field by field); object, void
and complex dtypes are refused, so nothing is ever unpickled.

A request is a map of observation fields named by the embodiment's `serve:` keys (embodiments.yaml), plus
`prompt`, an optional `session_id` (a string, or a small array as older RoboArena clients send) and an
optional `endpoint` ("infer", the default, as openpi's client sends none; or "reset", RoboArena's end of an
episode). Images are uint8 (H, W, 3), or (T, H, W, 3) for the frames observed since the previous call
(upstream DreamZero's client sends 4).

Camera frames of any size from 8 pixels a side up to `RequestLimits.max_image_pixels` (H x W) are accepted and
resized to the model's view on the server (the policy's own crop and resize, as in training). That cap follows the
bundle (`max_camera_pixels`): a 1080p frame (1920x1080, either way round) or 16 times the model's view (4 times
per side), whichever is larger; `dz serve --max-image-pixels` raises it.

A frame is refused before anything is built from it when it is larger or shaped otherwise than a request of
the policy can be (`FrameLimits`, from the embodiment's keys and `RequestLimits`): byte size, string and binary
lengths, map and array lengths, nesting depth and the number of maps and arrays. msgpack itself bounds the
lengths but not the depth or the count, and one byte of msgpack (an empty map) decodes to a ~60-byte Python
object, so `check_structure` walks the frame's headers first, skipping string and binary payloads without
copying them: a few microseconds for a request, and it stops at the first value over a limit, before
anything has been allocated.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Mapping

import numpy as np

from ..data.embodiments import ServeSpec

ENDPOINTS = ("infer", "reset")


class ProtocolError(ValueError):
    """A malformed request; the text names the field and what was expected."""


CAMERA_PIXELS = 1920 * 1080  # a 1080p camera frame: accepted by every server
VIEW_UPSCALE = 16            # and a frame of up to 4x the model's view per side (16x its pixels)


def max_camera_pixels(image_pixels: int) -> int:
    """The largest camera frame (H x W pixels) a server accepts by default, for a policy whose views have
    `image_pixels`: a 1080p frame, or 16x the view (4x per side), whichever is larger."""
    return max(CAMERA_PIXELS, VIEW_UPSCALE * image_pixels)


@dataclass(frozen=True)
class RequestLimits:
    min_image_side: int = 8
    max_image_pixels: int | None = None  # H x W of one camera frame; None: max_camera_pixels of the policy's views
    max_frames: int = 33            # one training window of raw frames, 4 * (local_attn_size - 1) + 1 at most
    max_prompt_chars: int = 2000
    max_abs_state: float = 1e4      # robot units (rad, m); anything larger is a unit or sensor error
    # the camera frame a frame-size limit is budgeted for (openpi sends 224x224, RoboArena 180x320); larger
    # images are fine while the whole request stays within the limit
    budget_image_pixels: int = 240 * 320

    def for_views(self, image_pixels: int) -> "RequestLimits":
        """These limits with max_image_pixels resolved for a policy whose views have `image_pixels`."""
        if self.max_image_pixels is not None:
            return self
        return replace(self, max_image_pixels=max_camera_pixels(image_pixels))


@dataclass(frozen=True)
class FrameLimits:
    """What one request frame may hold; anything over it is a ProtocolError before it is decoded."""

    max_bytes: int
    max_str_len: int        # bytes (UTF-8), as msgpack counts them
    max_bin_len: int
    max_array_len: int
    max_map_len: int        # entries
    max_depth: int          # maps and arrays inside each other
    max_containers: int     # maps and arrays in the whole frame
    raised_by: str = "--max-frame-mib"  # the `dz serve` setting(s) that raise max_bytes, for the refusal's text


FRAME_OVERHEAD = 64 << 10   # prompt, state, keys and msgpack headers beside the images
DEFAULT_FRAME_CAP = 32 << 20  # the default cap on max_bytes, unless one largest camera frame per view needs more


def frame_limits(spec: ServeSpec, state_dims: Mapping[str, int], limits: RequestLimits, image_pixels: int,
                 cap_bytes: int | None = None) -> FrameLimits:
    """The limits that a request of this embodiment fits with room to spare: per view, max_frames camera frames
    (of the policy's own image size, or limits.budget_image_pixels if larger) or one frame of the largest size
    accepted (limits.max_image_pixels), whichever is more, plus FRAME_OVERHEAD bytes; at most cap_bytes (None:
    DEFAULT_FRAME_CAP, or one largest frame per view if that needs more); request maps of the protocol keys plus
    as many unknown ones (accepted and unused); ndarray maps nested inside them."""
    views = len(spec.images)
    largest = limits.for_views(image_pixels).max_image_pixels
    budget = limits.max_frames * max(image_pixels, limits.budget_image_pixels)
    images = views * max(budget, largest) * 3 + FRAME_OVERHEAD
    if cap_bytes is None:
        cap_bytes = max(DEFAULT_FRAME_CAP, views * largest * 3 + FRAME_OVERHEAD)
    max_bytes = min(images, cap_bytes)
    raised_by = ("--max-frame-mib" if images > cap_bytes
                 else "--max-image-pixels for larger camera frames, --max-frames for more of them")
    keys = views + len(spec.state) + len(spec.ignored) + 3  # + prompt, session_id, endpoint
    max_map_len = max(64, 2 * keys)
    return FrameLimits(max_bytes=max_bytes, max_str_len=max(1024, 4 * limits.max_prompt_chars),
                       max_bin_len=max_bytes, max_array_len=max(64, 2 * max(state_dims.values(), default=0)),
                       max_map_len=max_map_len, max_depth=8, max_containers=4 * max_map_len, raised_by=raised_by)


def frame_too_big(size: int, limits: FrameLimits) -> str:
    """The refusal of a frame over limits.max_bytes, naming the limit and the setting that raises it."""
    return (f"frame too big: {size:,} bytes, over this server's limit of {limits.max_bytes:,} bytes; send fewer or "
            f"smaller camera frames, or raise the limit (dz serve {limits.raised_by})")


def _pack_default(obj):
    if isinstance(obj, (np.ndarray, np.generic)) and obj.dtype.kind in "VOc":
        raise ProtocolError(f"unsupported dtype {obj.dtype} (object, void and complex arrays are not sent)")
    if isinstance(obj, np.ndarray):
        return {b"__ndarray__": True, b"data": np.ascontiguousarray(obj).tobytes(), b"dtype": obj.dtype.str,
                b"shape": obj.shape}
    if isinstance(obj, np.generic):
        return {b"__npgeneric__": True, b"data": obj.item(), b"dtype": obj.dtype.str}
    return obj


# a dtype as numpy's `dtype.str` writes it ("<f4", "|u1", "<U7", "<M8[ns]"), or a type name ("float32"): no
# commas or parentheses, which would make numpy build a structured or subarray dtype field by field
_DTYPE_STR = re.compile(r"[<>|=]?[A-Za-z][A-Za-z0-9]{0,15}(\[[A-Za-z0-9]{1,8}\])?")


def _dtype(obj) -> np.dtype:
    """The dtype an ndarray or numpy scalar frame names; ProtocolError unless it is a plain type string of a kind
    the protocol carries."""
    name = obj[b"dtype"]
    if not isinstance(name, str) or not _DTYPE_STR.fullmatch(name):
        shown = repr(name[:40]) if isinstance(name, str) else type(name).__name__
        raise ProtocolError(f"an ndarray's dtype must be a numpy type string such as '<f4' or '|u1', got {shown}")
    try:
        dtype = np.dtype(name)
    except (TypeError, ValueError, OverflowError):
        raise ProtocolError(f"an ndarray's dtype must be a numpy type string such as '<f4' or '|u1', got {name!r}") \
            from None
    if dtype.kind in "VOc":
        raise ProtocolError(f"unsupported dtype {dtype}")
    return dtype


def _unpack_hook(obj):
    if b"__ndarray__" in obj:
        dtype = _dtype(obj)
        if dtype.itemsize == 0:  # any shape fits zero bytes, and the copy would be one byte an element
            raise ProtocolError(f"unsupported dtype {dtype} (zero bytes an element)")
        shape, data = obj[b"shape"], obj[b"data"]
        if (not isinstance(shape, (list, tuple)) or not all(type(n) is int and n >= 0 for n in shape)
                or not isinstance(data, (bytes, bytearray))):
            raise ProtocolError("an ndarray needs a shape of non-negative integers and its data as bytes")
        size = 1
        for n in shape:
            size *= n
        if size * dtype.itemsize != len(data):  # the data holds exactly the array: its size bounds the shape
            raise ProtocolError(f"an ndarray of shape {list(shape)} and dtype {dtype} is "
                                f"{size * dtype.itemsize:,} bytes; its data has {len(data):,}")
        return np.ndarray(buffer=data, dtype=dtype, shape=tuple(shape)).copy()
    if b"__npgeneric__" in obj:
        return _dtype(obj).type(obj[b"data"])
    return obj


def pack(obj) -> bytes:
    import msgpack

    return msgpack.packb(obj, default=_pack_default, use_bin_type=True)


# header byte -> bytes that follow it: nil, false, true, float 32/64, uint 8..64, int 8..64, fixext 1..16
_FIXED_SIZE = {0xc0: 0, 0xc2: 0, 0xc3: 0, 0xca: 4, 0xcb: 8, 0xcc: 1, 0xcd: 2, 0xce: 4, 0xcf: 8,
               0xd0: 1, 0xd1: 2, 0xd2: 4, 0xd3: 8, 0xd4: 2, 0xd5: 3, 0xd6: 5, 0xd7: 9, 0xd8: 17}
# header byte -> (width of its length field, kind)
_SIZED = {0xc4: (1, "bin"), 0xc5: (2, "bin"), 0xc6: (4, "bin"), 0xc7: (1, "ext"), 0xc8: (2, "ext"),
          0xc9: (4, "ext"), 0xd9: (1, "string"), 0xda: (2, "string"), 0xdb: (4, "string"),
          0xdc: (2, "array"), 0xdd: (4, "array"), 0xde: (2, "map"), 0xdf: (4, "map")}


def check_structure(data: bytes, limits: FrameLimits) -> None:
    """Refuse a frame over `limits` from its msgpack headers alone (see the module docstring)."""
    if len(data) > limits.max_bytes:
        raise ProtocolError(frame_too_big(len(data), limits))
    caps = {"string": limits.max_str_len, "bin": limits.max_bin_len, "ext": limits.max_bin_len,
            "array": limits.max_array_len, "map": limits.max_map_len}
    end, pos, containers = len(data), 0, 0
    unread = [1]  # values still to read: the frame's one, then each open map's or array's
    while unread:
        if unread[-1] == 0:
            unread.pop()
            continue
        unread[-1] -= 1
        if pos >= end:
            raise ProtocolError("not a msgpack-numpy message: it ends early (truncated)")
        head = data[pos]
        pos += 1
        if head <= 0x7f or head >= 0xe0:  # fixint
            continue
        if head in _FIXED_SIZE:
            pos += _FIXED_SIZE[head]
            continue
        if head < 0x90:
            kind, size = "map", head & 0x0f
        elif head < 0xa0:
            kind, size = "array", head & 0x0f
        elif head < 0xc0:
            kind, size = "string", head & 0x1f
        elif head in _SIZED:
            width, kind = _SIZED[head]
            size = int.from_bytes(data[pos:pos + width], "big")
            pos += width + (kind == "ext")  # an ext's type byte
        else:
            raise ProtocolError(f"not a msgpack-numpy message: byte 0x{head:02x} at offset {pos - 1} starts no value")
        if size > caps[kind]:
            unit = {"map": "entries", "array": "items"}.get(kind, "bytes")
            raise ProtocolError(f"a{'n' if kind[0] in 'ae' else ''} {kind} of {size} {unit} (at most {caps[kind]})")
        if kind in ("map", "array"):
            containers += 1
            if containers > limits.max_containers:
                raise ProtocolError(f"more than {limits.max_containers} maps and arrays in one frame")
            if len(unread) > limits.max_depth:
                raise ProtocolError(f"maps and arrays nested {len(unread)} deep (at most {limits.max_depth})")
            unread.append(2 * size if kind == "map" else size)
        else:
            pos += size
    if pos > end:
        raise ProtocolError("not a msgpack-numpy message: it ends early (truncated)")
    if pos < end:
        raise ProtocolError(f"not a msgpack-numpy message: {end - pos} bytes after its end")


def unpack(data: bytes, limits: FrameLimits | None = None):
    """A frame -> Python values with numpy arrays; with `limits` (the server's), a frame over them is refused
    before it is decoded."""
    import msgpack

    bounds = {}
    if limits is not None:
        check_structure(data, limits)
        bounds = dict(max_str_len=limits.max_str_len, max_bin_len=limits.max_bin_len,
                      max_ext_len=limits.max_bin_len, max_array_len=limits.max_array_len,
                      max_map_len=limits.max_map_len)
    try:
        return msgpack.unpackb(data, object_hook=_unpack_hook, raw=False, **bounds)
    except ProtocolError:
        raise
    except Exception as exc:  # truncated or not msgpack at all
        raise ProtocolError(f"not a msgpack-numpy message: {_one_line(exc)}") from None


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())[:300]


@dataclass
class Request:
    endpoint: str
    session_id: str | None
    images: dict[str, np.ndarray]       # view name -> uint8 [T, H, W, 3]
    state: dict[str, np.ndarray]        # state key -> float64 [dim]
    prompt: str


def _numbers(value, max_size: int, kinds: str = "iuf") -> np.ndarray | None:
    """`value` as an array if it is a number, an array or a flat list of at most `max_size` numbers whose dtype
    kind is in `kinds`; None for anything else (a nested or mixed list, a map, a string, an array of text).
    Types and sizes are checked before anything is converted: numpy would turn a list of arrays of mixed dtypes
    into one text array tens of times larger than the frame."""
    if isinstance(value, (np.ndarray, np.generic)):
        if value.dtype.kind not in kinds or value.size > max_size:
            return None
        return np.asarray(value)
    if type(value) in (int, float):
        value = [value]
    if not isinstance(value, (list, tuple)) or len(value) > max_size:
        return None
    items = []
    for v in value:  # only plain numbers, or numpy scalars of those kinds, each on its own
        if isinstance(v, np.generic) and v.dtype.kind in kinds:
            v = v.item()
        if type(v) not in (int, float) or (type(v) is float and "f" not in kinds):
            return None
        items.append(v)
    try:
        arr = np.asarray(items)
    except (ValueError, TypeError, OverflowError):
        return None
    return arr if arr.dtype.kind in kinds else None  # ints beyond 64 bits become objects: refused


def _described(value) -> str:
    """What a client sent, in a few words, without converting it."""
    if isinstance(value, (np.ndarray, np.generic)):
        return f"{value.dtype} {value.shape}"
    if isinstance(value, (list, tuple)):
        return f"a list of {len(value)} items"
    return type(value).__name__


def session_key(raw) -> str | None:
    """A session id as a string: RoboArena and DreamZero send a string (a uuid4), older RoboArena clients an
    int array of shape (1,)."""
    if raw is None:
        return None
    if isinstance(raw, str):
        if not 0 < len(raw) <= 128:
            raise ProtocolError("session_id must be a string of 1..128 characters")
        return raw
    arr = _numbers(raw, 16, kinds="iu")
    if arr is None or not 0 < arr.size <= 16:
        raise ProtocolError(f"session_id must be a string or up to 16 integers, got {_described(raw)}")
    return "-".join(str(int(v)) for v in arr.reshape(-1))


def _image(key: str, img, limits: RequestLimits) -> np.ndarray:
    if not isinstance(img, np.ndarray) or img.dtype != np.uint8 or img.ndim not in (3, 4) or img.shape[-1] != 3:
        got = f"{img.dtype} {img.shape}" if isinstance(img, np.ndarray) else type(img).__name__
        raise ProtocolError(f"{key} must be uint8 (H, W, 3) or (T, H, W, 3), got {got}")
    frames = img[None] if img.ndim == 3 else img
    h, w = frames.shape[1:3]
    if min(h, w) < limits.min_image_side:
        raise ProtocolError(f"{key}: a {h}x{w} image; each side needs at least {limits.min_image_side} pixels")
    cap = limits.max_image_pixels or CAMERA_PIXELS
    if h * w > cap:
        raise ProtocolError(f"{key}: a {h}x{w} image has {h * w:,} pixels, over this server's limit of {cap:,} per "
                            "camera frame; resize it on the client, or raise the limit (dz serve --max-image-pixels)")
    if not 1 <= frames.shape[0] <= limits.max_frames:
        raise ProtocolError(f"{key}: {frames.shape[0]} frames; send 1..{limits.max_frames}")
    return frames


def _vector(key: str, value, dim: int, limits: RequestLimits) -> np.ndarray:
    arr = _numbers(value, dim)
    if arr is None or arr.size != dim or (arr.ndim > 1 and max(arr.shape) != dim):
        raise ProtocolError(f"{key} must be {dim} numbers, shape ({dim},), got {_described(value)}")
    arr = arr.reshape(-1).astype(np.float64)
    bad = np.flatnonzero(~np.isfinite(arr) | (np.abs(arr) > limits.max_abs_state))
    if bad.size:
        raise ProtocolError(f"{key}[{bad[0]}] = {float(arr[bad[0]]):g} is not a finite number within "
                            f"±{limits.max_abs_state:g}")
    return arr


def parse_request(msg, spec: ServeSpec, state_dims: dict[str, int], limits: RequestLimits = RequestLimits()) -> Request:
    """A decoded frame -> Request, validated against the embodiment's protocol keys; ProtocolError names the field."""
    if not isinstance(msg, dict):
        raise ProtocolError(f"a request must be a map of observation fields, got {type(msg).__name__}")
    endpoint = msg.get("endpoint", "infer")
    if not isinstance(endpoint, str) or endpoint not in ENDPOINTS:
        got = repr(endpoint[:40]) if isinstance(endpoint, str) else type(endpoint).__name__
        raise ProtocolError(f"endpoint must be one of {list(ENDPOINTS)}, got {got}")
    sid = session_key(msg.get("session_id"))
    if endpoint == "reset":
        return Request("reset", sid, {}, {}, "")
    expected = sorted([*spec.images, *spec.state, "prompt"])
    images = {}
    for key, view in spec.images.items():
        if key not in msg:
            raise ProtocolError(f"missing {key!r}: uint8 (H, W, 3); this policy reads {expected}")
        images[view] = _image(key, msg[key], limits)
    counts = {v: a.shape[0] for v, a in images.items()}
    if len(set(counts.values())) > 1:
        raise ProtocolError(f"every camera must send the same number of frames, got {counts}")
    state = {}
    for key, name in spec.state.items():
        if key not in msg:
            raise ProtocolError(f"missing {key!r}: {state_dims[name]} numbers; this policy reads {expected}")
        state[name] = _vector(key, msg[key], state_dims[name], limits)
    prompt = msg.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip() or len(prompt) > limits.max_prompt_chars:
        raise ProtocolError(f"prompt must be a non-empty string of at most {limits.max_prompt_chars} characters")
    return Request("infer", sid, images, state, prompt)
