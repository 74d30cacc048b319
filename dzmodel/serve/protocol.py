"""The wire format of the policy server: msgpack with numpy arrays (openpi_client's msgpack_numpy layout),
and the RoboArena / openpi observation keys of upstream DreamZero's server (reference §6.2).

Arrays travel as {"__ndarray__": True, "data": raw bytes, "dtype": dtype.str, "shape": shape}; object, void
and complex dtypes are refused, so nothing is ever unpickled.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

IMAGE_KEYS = ("observation/exterior_image_1_left", "observation/exterior_image_2_left", "observation/wrist_image_left")
REQUIRED_IMAGES = ("observation/exterior_image_1_left", "observation/wrist_image_left")
VECTOR_KEYS = {"observation/joint_position": 7, "observation/cartesian_position": 6, "observation/gripper_position": 1}
MAX_IMAGE_SIDE = 1024


class ProtocolError(ValueError):
    """A malformed message; the text names the field and what was expected."""


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
class Observation:
    images: dict[str, np.ndarray]
    joint_position: np.ndarray
    cartesian_position: np.ndarray
    gripper_position: np.ndarray
    prompt: str
    session_id: str | None = None
    extra: dict = field(default_factory=dict)


def validate_observation(msg) -> Observation:
    if not isinstance(msg, dict):
        raise ProtocolError(f"a request must be a map of observation fields, got {type(msg).__name__}")
    images = {}
    for key in IMAGE_KEYS:
        if key not in msg:
            if key in REQUIRED_IMAGES:
                raise ProtocolError(f"missing {key!r}: uint8 (H, W, 3)")
            continue
        img = msg[key]
        if not isinstance(img, np.ndarray) or img.dtype != np.uint8 or img.ndim != 3 or img.shape[-1] != 3:
            got = f"{img.dtype} {img.shape}" if isinstance(img, np.ndarray) else type(img).__name__
            raise ProtocolError(f"{key} must be uint8 (H, W, 3), got {got}")
        if max(img.shape[:2]) > MAX_IMAGE_SIDE or min(img.shape[:2]) < 8:
            raise ProtocolError(f"{key}: {img.shape[0]}x{img.shape[1]} is outside 8..{MAX_IMAGE_SIDE} pixels per side")
        images[key] = img
    vectors = {}
    for key, n in VECTOR_KEYS.items():
        if key not in msg:
            raise ProtocolError(f"missing {key!r}: {n} float numbers")
        v = msg[key]
        arr = np.asarray(v) if isinstance(v, (list, tuple, np.ndarray)) else None
        if arr is None or arr.dtype.kind not in "fiu" or arr.shape != (n,):
            got = f"{arr.dtype} {arr.shape}" if arr is not None else type(v).__name__
            raise ProtocolError(f"{key} must be {n} numbers, shape ({n},), got {got}")
        if not np.all(np.isfinite(arr)):
            raise ProtocolError(f"{key} has non-finite values")
        vectors[key] = arr.astype(np.float64)
    prompt = msg.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip() or len(prompt) > 2000:
        raise ProtocolError("prompt must be a non-empty string of at most 2000 characters")
    sid = msg.get("session_id")
    if sid is not None and (not isinstance(sid, str) or not 0 < len(sid) <= 128):
        raise ProtocolError("session_id must be a string of 1..128 characters")
    return Observation(images, vectors["observation/joint_position"], vectors["observation/cartesian_position"],
                       vectors["observation/gripper_position"], prompt, sid)
