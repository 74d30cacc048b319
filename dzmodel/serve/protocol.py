"""The wire format of the policy server, as openpi's and RoboArena's clients speak it.

Frames are msgpack with numpy arrays in openpi_client's msgpack_numpy layout: an array travels as
{b"__ndarray__": True, b"data": raw bytes, b"dtype": dtype.str, b"shape": shape} (bytes keys); object, void
and complex dtypes are refused, so nothing is ever unpickled.

A request is a map of observation fields named by the embodiment's `serve:` keys (embodiments.yaml), plus
`prompt`, an optional `session_id` (a string, or a small array as older RoboArena clients send) and an
optional `endpoint` ("infer", the default, as openpi's client sends none; or "reset", RoboArena's end of an
episode). Images are uint8 (H, W, 3), or (T, H, W, 3) for the frames observed since the previous call
(upstream DreamZero's client sends 4).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..data.embodiments import ServeSpec

ENDPOINTS = ("infer", "reset")


class ProtocolError(ValueError):
    """A malformed request; the text names the field and what was expected."""


@dataclass(frozen=True)
class RequestLimits:
    min_image_side: int = 8
    max_image_side: int = 1024
    max_frames: int = 33            # one training window of raw frames, 4 * (local_attn_size - 1) + 1 at most
    max_prompt_chars: int = 2000
    max_abs_state: float = 1e4      # robot units (rad, m); anything larger is a unit or sensor error


def _pack_default(obj):
    if isinstance(obj, (np.ndarray, np.generic)) and obj.dtype.kind in "VOc":
        raise ProtocolError(f"unsupported dtype {obj.dtype} (object, void and complex arrays are not sent)")
    if isinstance(obj, np.ndarray):
        return {b"__ndarray__": True, b"data": np.ascontiguousarray(obj).tobytes(), b"dtype": obj.dtype.str,
                b"shape": obj.shape}
    if isinstance(obj, np.generic):
        return {b"__npgeneric__": True, b"data": obj.item(), b"dtype": obj.dtype.str}
    return obj


def _unpack_hook(obj):
    if b"__ndarray__" in obj:
        dtype = np.dtype(obj[b"dtype"])
        if dtype.kind in "VOc":
            raise ProtocolError(f"unsupported dtype {dtype}")
        return np.ndarray(buffer=obj[b"data"], dtype=dtype, shape=tuple(obj[b"shape"])).copy()
    if b"__npgeneric__" in obj:
        return np.dtype(obj[b"dtype"]).type(obj[b"data"])
    return obj


def pack(obj) -> bytes:
    import msgpack

    return msgpack.packb(obj, default=_pack_default, use_bin_type=True)


def unpack(data: bytes):
    import msgpack

    try:
        return msgpack.unpackb(data, object_hook=_unpack_hook, raw=False)
    except ProtocolError:
        raise
    except Exception as exc:  # truncated or not msgpack at all
        raise ProtocolError(f"not a msgpack-numpy message: {exc}") from None


@dataclass
class Request:
    endpoint: str
    session_id: str | None
    images: dict[str, np.ndarray]       # view name -> uint8 [T, H, W, 3]
    state: dict[str, np.ndarray]        # state key -> float64 [dim]
    prompt: str


def session_key(raw) -> str | None:
    """A session id as a string: RoboArena and DreamZero send a string (a uuid4), older RoboArena clients an
    int array of shape (1,)."""
    if raw is None:
        return None
    if isinstance(raw, str):
        if not 0 < len(raw) <= 128:
            raise ProtocolError("session_id must be a string of 1..128 characters")
        return raw
    arr = np.asarray(raw) if isinstance(raw, (list, tuple, np.ndarray, np.generic, int)) else None
    if arr is None or arr.dtype.kind not in "iu" or not 0 < arr.size <= 16:
        raise ProtocolError(f"session_id must be a string or up to 16 integers, got {type(raw).__name__}")
    return "-".join(str(int(v)) for v in arr.reshape(-1))


def _image(key: str, img, limits: RequestLimits) -> np.ndarray:
    if not isinstance(img, np.ndarray) or img.dtype != np.uint8 or img.ndim not in (3, 4) or img.shape[-1] != 3:
        got = f"{img.dtype} {img.shape}" if isinstance(img, np.ndarray) else type(img).__name__
        raise ProtocolError(f"{key} must be uint8 (H, W, 3) or (T, H, W, 3), got {got}")
    frames = img[None] if img.ndim == 3 else img
    h, w = frames.shape[1:3]
    if not limits.min_image_side <= min(h, w) <= max(h, w) <= limits.max_image_side:
        raise ProtocolError(f"{key}: {h}x{w} is outside {limits.min_image_side}..{limits.max_image_side} pixels per side")
    if not 1 <= frames.shape[0] <= limits.max_frames:
        raise ProtocolError(f"{key}: {frames.shape[0]} frames; send 1..{limits.max_frames}")
    return frames


def _vector(key: str, value, dim: int, limits: RequestLimits) -> np.ndarray:
    arr = np.asarray(value) if isinstance(value, (list, tuple, np.ndarray, np.generic, int, float)) else None
    if arr is None or arr.dtype.kind not in "fiu" or arr.size != dim or (arr.ndim > 1 and max(arr.shape) != dim):
        got = f"{arr.dtype} {arr.shape}" if arr is not None else type(value).__name__
        raise ProtocolError(f"{key} must be {dim} numbers, shape ({dim},), got {got}")
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
    if endpoint not in ENDPOINTS:
        raise ProtocolError(f"endpoint must be one of {list(ENDPOINTS)}, got {endpoint!r}")
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
