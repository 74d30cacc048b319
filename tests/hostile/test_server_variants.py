"""The policy server against variants of the hostile clients it was hardened for: a message split into a flood
of empty fragments, pings sent by a client that never reads the pongs, dtype strings that make numpy build
thousands of fields, session ids that would forge log lines, tokens in parts of a request line or in headers
that websockets quotes when it refuses them, and non-ASCII handshake headers."""

import socket
import threading
import time

import msgpack
import pytest
from websockets.sync.client import connect

from dzmodel.serve.protocol import ProtocolError, pack, unpack
from dzmodel.serve.server import PolicyServer, ServerThread
from tests.hostile.test_server_decode_and_handshakes import child  # noqa: F401 (fixture)
from tests.hostile.test_server_fairness import _raw_request, _upgrade, every_log_line  # noqa: F401 (fixture)
from tests.hostile.test_server_hostile import AUTH, _lines, _small_obs, serve_log  # noqa: F401 (fixture)
from tests.serve.test_server import TOKEN, FakePolicy, libero_obs

MiB = 1 << 20


def _open(port: int) -> socket.socket:
    """A raw, authenticated WebSocket connection, its upgrade answer read."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(_upgrade(headers=f"Authorization: Api-Key {TOKEN}\r\n".encode()))
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(4096)
    assert head.startswith(b"HTTP/1.1 101"), head
    return sock


def _frame(opcode: int, payload: bytes, fin: bool) -> bytes:
    """One masked client frame (zero mask) of a short payload."""
    return bytes([(0x80 if fin else 0) | opcode, 0x80 | len(payload)]) + b"\0\0\0\0" + payload


def _send_until_dropped(sock: socket.socket, data: bytes, total: int) -> int:
    """Send `data` over and over, up to `total` bytes; how many were sent before the server dropped the
    connection (or `total`)."""
    sent = 0
    try:
        while sent < total:
            sock.sendall(data)
            sent += len(data)
    except OSError:
        pass
    return sent


def _closed_by_server(sock: socket.socket, timeout: float = 5.0) -> bool:
    """Whether the server closes the connection within `timeout` (its frames before that are skipped)."""
    sock.settimeout(timeout)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not sock.recv(65536):
                return True
    except ConnectionError:
        return True
    except TimeoutError:
        return False
    return False


# -- a message in a flood of empty fragments --

def test_a_message_split_into_empty_fragments_is_refused_after_a_few_and_costs_no_memory(child):
    srv = child()
    sock = _open(srv.port)
    srv.reset_peak()
    sock.sendall(_frame(0x2, b"\x81", fin=False))  # a binary message begins...
    # ... and goes on in empty continuation frames, 6 bytes each on the wire, ~100 bytes each kept by the server
    sent = _send_until_dropped(sock, _frame(0x0, b"", fin=False) * 100_000, 24 * MiB)
    assert _closed_by_server(sock), "the server kept reading fragments of one message"
    growth = srv.peak_growth_mib()
    sock.close()
    assert sent < 24 * MiB and growth < 20, (sent, growth)


def test_a_message_in_fragments_of_a_kib_or_more_still_arrives():
    with ServerThread(FakePolicy(), TOKEN) as srv, connect(srv.url, additional_headers=AUTH) as ws:
        ws.recv(timeout=10)
        frame = pack(libero_obs())
        ws.send([frame[i:i + 1024] for i in range(0, len(frame), 1024)])  # ~300 fragments
        assert unpack(ws.recv(timeout=10))["actions"].shape == (12, 8)


# -- pings from a client that never reads --

def test_a_client_that_sends_pings_and_never_reads_the_pongs_is_dropped(child):
    srv = child()
    sock = _open(srv.port)
    srv.reset_peak()
    ping = _frame(0x9, b"p" * 125, fin=True)
    sent = _send_until_dropped(sock, ping * 8000, 64 * MiB)  # ~1 MiB a send, every pong left unread
    growth = srv.peak_growth_mib()
    sock.close()
    assert sent < 32 * MiB, f"{sent / MiB:.0f} MiB of pings taken from a client that reads nothing"
    assert growth < 20, growth


def _drain(sock: socket.socket, closed: threading.Event) -> None:
    """Read everything the server sends (pongs) until it closes the connection."""
    try:
        while sock.recv(65536):
            pass
    except OSError:
        pass
    closed.set()


def test_a_client_that_floods_pings_and_reads_the_pongs_is_closed(child):
    """Every pong read at once, so the unread-reply bound never applies: the ping rate does."""
    srv = child()
    sock = _open(srv.port)
    closed = threading.Event()
    reader = threading.Thread(target=_drain, args=(sock, closed), daemon=True)
    reader.start()
    ping, sent, began = _frame(0x9, b"p", fin=True), 0, time.monotonic()
    try:
        while sent < 200_000 and not closed.is_set():
            sock.sendall(ping * 100)
            sent += 100
    except OSError:
        pass
    assert closed.wait(5), f"{sent} pings in {time.monotonic() - began:.1f} s and the connection is still open"
    sock.close()
    assert time.monotonic() - began < 5, f"{sent} pings sent before the server closed the connection"


def test_keepalive_pings_and_a_short_burst_keep_the_connection(child):
    srv = child()
    sock = _open(srv.port)
    closed = threading.Event()
    threading.Thread(target=_drain, args=(sock, closed), daemon=True).start()
    for _ in range(40):  # a burst under the limit, then the rate a keepalive uses
        sock.sendall(_frame(0x9, b"k", fin=True))
    for _ in range(5):
        time.sleep(0.2)
        sock.sendall(_frame(0x9, b"k", fin=True))
    assert not closed.wait(1.0)
    sock.close()


# -- dtype strings numpy would build field by field --

@pytest.mark.parametrize("dtype", ["i," * 3999, "(9,9,9,9,9,9,9,9,9,9,9,9,9,9,9)u1," * 200, "(4294967295,)u1",
                                   [["a", "u1"]], {"names": ["a"], "formats": ["u1"]}])
def test_a_structured_or_subarray_dtype_is_refused_at_once_in_a_short_line(dtype):
    limits = PolicyServer(FakePolicy(), None).frame_limits
    frame = msgpack.packb({"observation/state": {b"__ndarray__": True, b"data": b"", b"dtype": dtype,
                                                 b"shape": [0]}}, use_bin_type=True)
    t0 = time.perf_counter()
    with pytest.raises(ProtocolError, match="dtype must be a numpy type string") as err:
        unpack(frame, limits)
    assert time.perf_counter() - t0 < 0.005
    assert len(str(err.value)) < 200


def test_plain_dtype_strings_still_decode():
    import numpy as np

    for arr in (np.zeros(3, "<f4"), np.zeros(3, "|u1"), np.zeros(2, ">f8"), np.array(["ab"]), np.zeros(1, "M8[s]")):
        assert unpack(pack(arr)).dtype == arr.dtype


# -- the log --

@pytest.mark.parametrize("sid", ["ep\n2099-01-01T00:00:00 127.0.0.1:1 GET /healthz 200", "ep\r\x1b[2Kforged"])
def test_a_session_id_cannot_forge_a_log_line(sid, serve_log):
    with ServerThread(FakePolicy(), TOKEN) as srv, connect(srv.url, additional_headers=AUTH) as ws:
        ws.recv(timeout=10)
        for _ in range(2):  # the first request's line is written before the second is answered
            ws.send(pack(_small_obs() | {"session_id": sid}))
            ws.recv(timeout=10)
    lines = _lines(serve_log, "session=ep")
    assert lines
    assert not any(ch in line for line in lines for ch in "\n\r\x1b"), lines


SECRET = "frag-secret-5e6f7a"


def test_no_token_is_logged_from_odd_request_lines_or_subprotocol_headers(every_log_line):
    auth = f"Authorization: Api-Key {TOKEN}\r\n".encode()
    requests = [
        f"GET /?'{SECRET} HTTP/1.0\r\n\r\n".encode(),                 # a quote first in the query string
        f"GET /?a=b\"c{SECRET} HTTP/1.0\r\n\r\n".encode(),           # a quote inside it
        f"GET /#{SECRET} HTTP/1.0\r\n\r\n".encode(),                  # a fragment
        f"GET http://robot:{SECRET}@host/ HTTP/1.0\r\n\r\n".encode(),  # credentials in an absolute target
        _upgrade(headers=auth + f"Sec-WebSocket-Protocol: bearer/{SECRET}\r\n".encode()),  # unparsable
        _upgrade(headers=auth + f"Sec-WebSocket-Protocol: {SECRET}\r\n".encode()),
    ]
    with ServerThread(FakePolicy(), TOKEN) as srv:
        for request in requests:
            _raw_request(srv.port, request)
        time.sleep(0.3)
    text = "\n".join(every_log_line)
    assert "opening handshake failed" in text
    assert SECRET not in text, [line for line in every_log_line if SECRET in line]


# -- non-ASCII handshake headers --

@pytest.mark.parametrize("header", [b"Upgrade: \xffwebsocket", b"Connection: \xffUpgrade",
                                    b"Sec-WebSocket-Protocol: a\xff"])
def test_a_non_ascii_handshake_header_is_a_400_with_one_line(header, serve_log):
    with ServerThread(FakePolicy(), TOKEN) as srv:
        answer = _raw_request(srv.port, _upgrade(headers=b"Authorization: Api-Key " + TOKEN.encode() + b"\r\n"
                                                 + header + b"\r\n"))
        time.sleep(0.2)
    assert answer.startswith(b"HTTP/1.1 400"), answer[:80]
    assert len(_lines(serve_log, "non-ASCII")) == 1
    assert not _lines(serve_log, "internal error|Traceback")


class _FakeWs:
    def __init__(self, host):
        self.remote_address = (host, 40000, 0, 0) if ":" in host else (host, 40000)


def test_an_ipv6_host_counts_as_its_64_network_for_the_per_client_caps():
    """One IPv6 host holds a whole /64 and can connect from a fresh address each time: the caps count the /64.
    An IPv4-mapped address (a server bound to `::`) counts as the IPv4 address, so a local client stays loopback."""
    from dzmodel.serve.server import _client, _is_loopback

    same = {_client(_FakeWs(f"2001:db8:1:2::{i:x}")) for i in range(1, 40)} | {_client(_FakeWs("2001:db8:1:2:ffff::1%eth0"))}
    assert same == {"2001:db8:1:2::/64"}
    assert _client(_FakeWs("2001:db8:1:3::1")) != _client(_FakeWs("2001:db8:1:2::1"))
    assert _client(_FakeWs("::ffff:192.0.2.7")) == _client(_FakeWs("192.0.2.7")) == "192.0.2.7"
    assert _is_loopback(_client(_FakeWs("::ffff:127.0.0.1"))) and _is_loopback(_client(_FakeWs("::1")))
    assert not _is_loopback(_client(_FakeWs("2001:db8::1")))
