"""Generated frames against the request decoder and a live server: random msgpack values, ndarray maps with odd
dtypes and shapes, truncated and corrupted requests. Each is a valid Request or a ProtocolError, never another
exception and never a hang; the structure limits refuse only what is over them."""

import time

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from dzmodel.serve.protocol import FrameLimits, ProtocolError, Request, RequestLimits, parse_request, unpack
from dzmodel.serve.server import PolicyServer, ServerThread
from tests.serve.test_server import LIBERO, LIBERO_DIMS, TOKEN, FakePolicy, libero_obs

FRAME_LIMITS = PolicyServer(FakePolicy(), None).frame_limits  # what the server derives for LIBERO's keys
FUZZ = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow])


def decode(data: bytes) -> Request:
    """The server's path from a binary frame to a Request; a hostile frame must take at most a second."""
    t0 = time.perf_counter()
    try:
        return parse_request(unpack(data, FRAME_LIMITS), LIBERO, LIBERO_DIMS, RequestLimits())
    finally:
        assert time.perf_counter() - t0 < 1.0, "decoding one frame took over a second"


def _request_or_protocol_error(data: bytes) -> None:
    try:
        assert isinstance(decode(data), Request)
    except ProtocolError as exc:
        assert str(exc) and "\n" not in str(exc)


msgpack_ints = st.integers(-(2**63), 2**64 - 1)
scalars = (st.none() | st.booleans() | st.integers(-40, 300) | msgpack_ints | st.floats() | st.text(max_size=40)
           | st.binary(max_size=300) | st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=20)))
keys = st.text(max_size=6) | st.binary(max_size=6) | st.integers(-3, 3) | st.none()  # msgpack refuses the last two
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=6)
                      | st.dictionaries(keys, inner, max_size=6), max_leaves=30)
dtypes = (st.sampled_from(["|u1", "<f4", "<f8", "<i8", ">u2", "|b1", "|O", "O", "V8", "<c16", "S0", "|S3", "<U2",
                           "<M8[s]", "(2,)<f8", "[('a', '<f4')]", "bogus", "", "<f16", "|u1\x00"])
          | msgpack_ints | st.none() | st.lists(st.text(max_size=3), max_size=2) | st.binary(max_size=4))
shapes = st.lists(st.integers(-3, 2**40) | msgpack_ints, max_size=5) | msgpack_ints | st.none() | st.text(max_size=3)
ndarrays = st.fixed_dictionaries({b"__ndarray__": st.booleans(), b"data": st.binary(max_size=512), b"dtype": dtypes,
                                  b"shape": shapes})
generics = st.fixed_dictionaries({b"__npgeneric__": st.just(True), b"data": scalars | values, b"dtype": dtypes})
odd_arrays = st.builds(lambda shape, dtype: np.zeros(shape, dtype),
                       st.lists(st.integers(0, 6), min_size=0, max_size=5),
                       st.sampled_from([np.uint8, np.int8, np.float16, np.float64, np.bool_, np.uint64, np.int32]))
numbers = st.lists(st.integers(-3, 3) | st.floats() | st.lists(st.integers(-3, 3), max_size=3), max_size=9)
field_values = st.one_of(values, ndarrays, generics, odd_arrays, numbers)
KEYS = ["observation/image", "observation/wrist_image", "observation/state", "prompt", "session_id", "endpoint"]
requests = st.fixed_dictionaries({}, optional=dict.fromkeys(KEYS, field_values))


def _pack(obj) -> bytes:
    def default(o):
        if isinstance(o, np.ndarray):
            return {b"__ndarray__": True, b"data": o.tobytes(), b"dtype": o.dtype.str, b"shape": list(o.shape)}
        raise TypeError(type(o).__name__)

    return msgpack.packb(obj, default=default, use_bin_type=True)


@FUZZ
@given(values)
def test_any_msgpack_value_is_a_request_or_a_protocol_error(value):
    _request_or_protocol_error(msgpack.packb(value, use_bin_type=True))


@FUZZ
@given(requests, st.booleans())
def test_requests_with_odd_arrays_and_fields_are_a_request_or_a_protocol_error(fields, over_a_valid_one):
    msg = {**libero_obs(np.random.default_rng(0)), **fields} if over_a_valid_one else fields
    _request_or_protocol_error(_pack(msg))


VALID = _pack({**libero_obs(), "observation/image": np.zeros((2, 8, 8, 3), np.uint8),  # small: flips hit headers
               "observation/wrist_image": np.zeros((2, 8, 8, 3), np.uint8), "session_id": "ep-1"})


@FUZZ
@given(st.integers(0, len(VALID) - 1), st.lists(st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 255)),
                                                max_size=4))
def test_truncated_and_corrupted_requests_are_a_request_or_a_protocol_error(cut, flips):
    _request_or_protocol_error(VALID[:cut])
    corrupted = bytearray(VALID)
    for at, byte in flips:
        corrupted[at] = byte
    _request_or_protocol_error(bytes(corrupted))


def _depth(value) -> int:
    if isinstance(value, dict):
        return 1 + max((_depth(v) for kv in value.items() for v in kv), default=0)
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    return 0


def _containers(value) -> int:
    if isinstance(value, dict):
        return 1 + sum(_containers(k) + _containers(v) for k, v in value.items())
    if isinstance(value, list):
        return 1 + sum(_containers(v) for v in value)
    return 0


@FUZZ
@given(values, st.booleans())
def test_the_structure_limits_refuse_only_what_is_over_them(value, single_floats):
    try:
        data = msgpack.packb(value, use_bin_type=True, use_single_float=single_floats)
    except OverflowError:  # a float beyond float32
        assume(False)
    tight = FrameLimits(max_bytes=1 << 20, max_str_len=64, max_bin_len=64, max_array_len=4, max_map_len=4,
                        max_depth=3, max_containers=6)
    within = (_depth(value) <= tight.max_depth and _containers(value) <= tight.max_containers
              and len(data) <= tight.max_bytes and _lengths_within(value, tight) and _string_keys(value))
    if within:
        decoded = unpack(data, tight)
        assert msgpack.packb(decoded, use_bin_type=True, use_single_float=single_floats) == data  # as msgpack does
    else:
        with pytest.raises(ProtocolError):
            unpack(data, tight)


def _string_keys(value) -> bool:
    if isinstance(value, dict):
        return all(isinstance(k, (str, bytes)) and _string_keys(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_string_keys(v) for v in value)
    return True


def _lengths_within(value, limits: FrameLimits) -> bool:
    if isinstance(value, dict):
        return len(value) <= limits.max_map_len and all(_lengths_within(k, limits) and _lengths_within(v, limits)
                                                        for k, v in value.items())
    if isinstance(value, list):
        return len(value) <= limits.max_array_len and all(_lengths_within(v, limits) for v in value)
    if isinstance(value, str):
        return len(value.encode()) <= limits.max_str_len
    if isinstance(value, bytes):
        return len(value) <= limits.max_bin_len
    if isinstance(value, msgpack.ExtType):
        return len(value.data) <= limits.max_bin_len
    return True


EVERY_HEADER = [None, True, False, -33, -32, -1, 0, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**64 - 1,
                -129, -128, -2**15, -2**15 - 1, -2**31 - 1, -2**63, 1.5, "", "a" * 31, "a" * 32, "a" * 256,
                "a" * 65536, b"", b"b" * 256, b"b" * 65536, list(range(16)), list(range(65536)),
                {str(i): i for i in range(16)}, {str(i): i for i in range(65536)}]
EVERY_HEADER += [msgpack.ExtType(5, b"e" * n) for n in (1, 2, 4, 8, 16, 3, 256, 65536)]


@pytest.mark.parametrize("single_floats", [False, True])
def test_the_header_walk_reads_every_msgpack_type_as_msgpack_does(single_floats):
    roomy = FrameLimits(max_bytes=8 << 20, max_str_len=1 << 20, max_bin_len=1 << 20, max_array_len=1 << 17,
                        max_map_len=1 << 17, max_depth=8, max_containers=8)
    for value in EVERY_HEADER:
        data = msgpack.packb([value, -1, "end"], use_bin_type=True, use_single_float=single_floats)
        assert msgpack.packb(unpack(data, roomy), use_bin_type=True, use_single_float=single_floats) == data, value


@pytest.mark.parametrize("frame, reason", [
    (b"\x91" * 40 + b"\xc0", "nested 9 deep"),
    (b"\x81\xa1a\xdd\xff\xff\xff\xff" + b"\x80" * 100, "an array of 4294967295 items"),
    (b"\x81\xa1a\x9f" + b"\x80" * 15 + b"", "more than"),  # 15 empty maps in one short array
    (b"\x81\xa1a\xdb\x7f\xff\xff\xff", "a string of 2147483647 bytes"),
    (b"\x82\xa1a\xc0", "not a msgpack-numpy message: it ends early"),
], ids=["deep", "long-array", "many-maps", "long-string", "truncated"])
def test_the_limits_name_what_was_over_them(frame, reason):
    small = FrameLimits(max_bytes=1 << 20, max_str_len=1000, max_bin_len=1000, max_array_len=16, max_map_len=16,
                        max_depth=8, max_containers=12)
    with pytest.raises(ProtocolError, match=reason):
        unpack(frame, small)


@pytest.fixture(scope="module")
def server():
    with ServerThread(FakePolicy(), TOKEN) as srv:
        yield srv


@settings(max_examples=25, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(requests | values.map(lambda v: {"extra": v}))
def test_a_live_server_answers_every_generated_frame_with_a_reply_or_a_bad_request(server, fields):
    msg = {**libero_obs(np.random.default_rng(0)), **fields}
    with connect(server.url, additional_headers={"Authorization": f"Api-Key {TOKEN}"}, max_size=None) as ws:
        ws.recv(timeout=10)
        ws.send(_pack(msg))
        reply = ws.recv(timeout=10)  # a hang fails here
        if isinstance(reply, str):
            assert reply.startswith("bad request: "), reply
            with pytest.raises(ConnectionClosed) as info:
                ws.recv(timeout=10)
            assert info.value.rcvd.code == 1008
        else:
            assert unpack(reply)["actions"].shape == (12, 8)


@pytest.mark.parametrize("dtype, shape, data", [
    ("|S0", [2**30], b""),          # zero bytes an element: any shape "fits" the data (a 69-byte frame froze the
    ("<U0", [2**20, 2**10], b""),   # server for ~49 s building a one-byte-an-element copy)
    ("<f4", [4], b"\0" * 20),       # more data than the shape: the data must hold exactly the array
    ("<f4", [-1, 4], b"\0" * 16),   # negative, float and bool dims
    ("<f4", [2.0, 2], b"\0" * 16),
    ("<f4", [True, 4], b"\0" * 16),
    ("<f4", 4, b"\0" * 16),         # a shape that is not a list
])
def test_ndarrays_whose_shape_the_data_does_not_hold_exactly_are_refused(dtype, shape, data):
    frame = msgpack.packb({"observation/state": {b"__ndarray__": True, b"data": data, b"dtype": dtype,
                                                 b"shape": shape}}, use_bin_type=True)
    assert len(frame) < 100
    with pytest.raises(ProtocolError):
        unpack(frame, FRAME_LIMITS)


def test_an_ndarray_of_exactly_its_data_decodes():
    frame = msgpack.packb({"x": {b"__ndarray__": True, b"data": np.arange(6, dtype="<f4").tobytes(),
                                 b"dtype": "<f4", b"shape": [2, 3]}}, use_bin_type=True)
    assert unpack(frame, FRAME_LIMITS)["x"].tolist() == [[0, 1, 2], [3, 4, 5]]
