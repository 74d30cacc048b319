"""The policy server against a frame whose arrays numpy would promote to text, and against floods of half-sent
HTTP handshakes. The server runs in a child process, so that its memory can be measured on its own: a list of
ndarrays with mixed dtypes is refused before numpy converts anything, and connections that never finish their
upgrade request are capped from the moment they are accepted, with a small header budget and a short deadline."""

import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from dzmodel.serve.client import PolicyClient, ServerError
from dzmodel.serve.protocol import ProtocolError, RequestLimits, pack, parse_request, unpack
from dzmodel.serve.server import PolicyServer
from tests.hostile.test_server_hostile import _from, _small_obs
from tests.serve.test_server import LIBERO, LIBERO_DIMS, TOKEN, FakePolicy

ROOT = Path(__file__).resolve().parents[2]
AUTH = {"Authorization": f"Api-Key {TOKEN}"}
FRAME_LIMITS = PolicyServer(FakePolicy(), None).frame_limits
MiB = 1 << 20

SERVER = """
import json, sys, time
from dzmodel.serve.server import ServerLimits, ServerThread
from tests.serve.test_server import FakePolicy, TOKEN
with ServerThread(FakePolicy(), TOKEN, limits=ServerLimits(**json.loads(sys.argv[1]))) as s:
    print(s.port, flush=True)
    sys.stdin.read()
"""


class ChildServer:
    """A policy server in its own process; `peak_growth_mib()` is its peak RSS growth since `reset_peak()`."""

    def __init__(self, **limits):
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER, json.dumps(limits)], cwd=ROOT, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.port = int(self.proc.stdout.readline())
        self.url = f"ws://127.0.0.1:{self.port}"

    def _kib(self, field: str) -> int:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(re.search(rf"^{field}:\s+(\d+) kB", status, re.M).group(1))

    def reset_peak(self) -> None:
        Path(f"/proc/{self.proc.pid}/clear_refs").write_text("5")  # VmHWM back to the current RSS
        self.base = self._kib("VmRSS")

    def peak_growth_mib(self) -> float:
        return (self._kib("VmHWM") - self.base) / 1024

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def child():
    servers = []

    def start(**limits) -> ChildServer:
        servers.append(ChildServer(**limits))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


# -- arrays that numpy would promote to text --

def _nd(dtype: str, data: bytes, n: int) -> dict:
    return {b"__ndarray__": True, b"data": data, b"dtype": dtype, b"shape": [n]}


def _promote_bomb(kind: str, key: str = "session_id") -> bytes:
    """A frame near the size limit whose `key` is a list of max_array_len arrays: all but one float16 (or bool),
    the last `<U1` of the same length; np.asarray of that list is a `<U32` (or `<U5`) array, 64 (or 20) bytes
    of memory for each byte sent."""
    items, budget = FRAME_LIMITS.max_array_len, FRAME_LIMITS.max_bytes - len(pack(_small_obs())) - 4096
    width = {"f16": 2, "bool": 1}[kind]
    n = budget // (width * (items - 1) + 4)
    one = _nd("<f2", b"\x00\x3c" * n, n) if kind == "f16" else _nd("|b1", b"\x01" * n, n)
    obs = {**_small_obs(), key: [one] * (items - 1) + [_nd("<U1", b"a\0\0\0" * n, n)]}
    return pack(obs)


@pytest.mark.parametrize("kind", ["f16", "bool"])
@pytest.mark.parametrize("key", ["session_id", "observation/state"])
def test_a_list_of_mixed_dtype_arrays_is_refused_quickly_without_memory(child, kind, key):
    frame = _promote_bomb(kind, key)
    assert len(frame) > 0.9 * FRAME_LIMITS.max_bytes
    srv = child()
    with connect(srv.url, additional_headers=AUTH, max_size=None) as ws:
        ws.recv(timeout=10)  # the handshake metadata
        srv.reset_peak()
        t0 = time.perf_counter()
        ws.send(frame)
        reason = ws.recv(timeout=30)
        took = time.perf_counter() - t0
        with pytest.raises(ConnectionClosed) as info:
            ws.recv(timeout=10)
    assert reason.startswith("bad request: ") and key in reason, reason
    assert info.value.rcvd.code == 1008
    assert took < 0.5, f"refused after {took:.2f} s"
    growth = srv.peak_growth_mib()
    assert growth < 100, f"the server's peak RSS grew {growth:.0f} MiB for a {len(frame) / MiB:.1f} MiB frame"


@pytest.mark.parametrize("value", [
    [1, 2.5, "3"], [1, [2]], [True, 1], [{}], [b"\x00"] * 8, list(range(10_000)),
    [msgpack.ExtType(1, b"x")], [2 ** 70] * 8,
])
def test_lists_hold_only_plain_numbers(value):
    msg = {**_decoded_obs(), "observation/state": value}
    with pytest.raises(ProtocolError, match="observation/state"):
        parse_request(msg, LIBERO, LIBERO_DIMS, RequestLimits())
    with pytest.raises(ProtocolError, match="session_id"):
        parse_request({**_decoded_obs(), "session_id": value}, LIBERO, LIBERO_DIMS, RequestLimits())


def test_numbers_sent_as_lists_or_arrays_still_parse():
    import numpy as np

    plain = [0.1] * 8
    scalars = [np.float32(0.1)] * 8  # a list of numpy scalars, as msgpack-numpy sends them, one at a time
    for state in (plain, np.full(8, 0.1, np.float16), np.full((1, 8), 3, np.int32), scalars):
        request = parse_request({**_decoded_obs(), "observation/state": state, "session_id": np.array([7])},
                                LIBERO, LIBERO_DIMS, RequestLimits())
        assert request.state and request.session_id == "7"
    request = parse_request({**_decoded_obs(), "session_id": [np.int64(3), 4]}, LIBERO, LIBERO_DIMS)
    assert request.session_id == "3-4"


def _decoded_obs() -> dict:
    return unpack(pack(_small_obs()))


# -- half-sent handshakes --

HEAD = (b"GET / HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n")
HUGE_HEADERS = b"X-A: " + b"a" * 8000 + b"\r\n"  # 120 of them: just under websockets' own limits


def _half_handshakes(port: int, n: int, addresses: list[str], huge: bool = True) -> list[socket.socket]:
    """`n` connections, from `addresses` in turn, each sending a request head that never ends: ~1 MB of headers
    (`huge`; what the server does not read stays in the kernel, as a client that keeps sending would), or a
    small one, as a slow client's."""
    socks = []
    for i in range(n):
        sock = _from(addresses[i % len(addresses)], port)
        sock.setblocking(False)
        try:
            sock.send(HEAD + HUGE_HEADERS * 120 if huge else HEAD)
        except OSError:  # refused at once: closed by the server
            pass
        socks.append(sock)
    return socks


def _close(socks) -> None:
    for sock in socks:
        sock.close()


def test_a_flood_of_half_handshakes_is_capped_in_memory_and_in_count(child):
    """From loopback (not capped per address by default): the server's total cap holds for everyone; a client
    that comes while the flood holds every handshake slot is told the server is full; once the flood's
    connections time out, it is served."""
    timeout_s = 3.0
    srv = child(max_connections=64, handshake_timeout_s=timeout_s)
    srv.reset_peak()
    t0 = time.monotonic()
    socks = _half_handshakes(srv.port, 200, ["127.0.0.1"], False) + _half_handshakes(srv.port, 200, ["127.0.0.1"])
    time.sleep(1.0)  # the server reads what the flood sent
    growth = srv.peak_growth_mib()
    assert growth < 100, f"400 half-sent handshakes grew the server's peak RSS by {growth:.0f} MiB"
    with pytest.raises(ServerError, match="server full: 64 connections opening"):  # the slow ones hold every slot
        PolicyClient(srv.url, TOKEN, timeout=10)
    assert time.monotonic() - t0 < timeout_s, "the flood took too long to test the cap"
    time.sleep(max(0.0, t0 + timeout_s + 1.0 - time.monotonic()))  # past the deadline: the server closed them
    with PolicyClient(srv.url, TOKEN, timeout=10) as client:
        assert client.infer(_small_obs())["actions"].shape == (12, 8)
    _close(socks)


def test_half_handshakes_from_one_address_leave_room_for_others(child):
    srv = child(max_connections=64, max_connections_per_client=8, cap_loopback=True, handshake_timeout_s=5.0)
    srv.reset_peak()
    socks = _half_handshakes(srv.port, 200, ["127.0.0.1"], False) + _half_handshakes(srv.port, 200, ["127.0.0.1"])
    time.sleep(1.0)
    assert srv.peak_growth_mib() < 100
    with connect(srv.url, sock=_from("127.0.0.2", srv.port), additional_headers=AUTH, open_timeout=10) as ws:
        assert isinstance(ws.recv(timeout=10), bytes)  # another address is served while the flood holds
        ws.send(pack(_small_obs()))
        assert isinstance(ws.recv(timeout=10), bytes)
    _close(socks)
    time.sleep(0.3)
    with PolicyClient(srv.url, TOKEN, timeout=10) as client:  # once they are closed, the address is served again
        assert client.infer(_small_obs())["actions"].shape == (12, 8)


def test_half_handshakes_from_many_addresses_are_capped_in_total(child):
    srv = child(max_connections=16, max_connections_per_client=4, cap_loopback=True, handshake_timeout_s=5.0)
    srv.reset_peak()
    addresses = [f"127.0.0.{i}" for i in range(2, 52)]
    socks = _half_handshakes(srv.port, 200, addresses, False) + _half_handshakes(srv.port, 200, addresses)
    time.sleep(1.0)
    assert srv.peak_growth_mib() < 100
    with pytest.raises(ServerError, match="server full"):  # the total cap holds: every handshake slot is taken
        PolicyClient(srv.url, TOKEN, timeout=10)
    _close(socks)
    time.sleep(0.3)
    with PolicyClient(srv.url, TOKEN, timeout=10) as client:
        assert client.infer(_small_obs())["actions"].shape == (12, 8)


def test_a_request_head_over_the_header_budget_is_refused(child):
    srv = child()
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
        sock.sendall(HEAD + HUGE_HEADERS * 4)  # 32 KB of headers, within websockets' own limits
        head = sock.recv(4096)
    assert head.startswith(b"HTTP/1.1 431"), head[:80]
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
        sock.sendall(HEAD + b"X-B: b\r\n" * 100)  # 100 small header lines
        head = sock.recv(4096)
    assert head.startswith(b"HTTP/1.1 431"), head[:80]
    with PolicyClient(srv.url, TOKEN, timeout=10) as client:
        assert client.infer(_small_obs())["actions"].shape == (12, 8)
