"""The policy server shared fairly and its secrets kept out of its log, over real loopback sockets: one address
cannot take every session, duplicate Authorization headers are a 401 (never a 500), no token sent in a header or
a query string is ever written to the log (HTTP/1.0 or 1.1, good or bad requests, websockets' own lines), and a
69-byte frame that claims an 8 GiB array is refused in milliseconds while other clients keep their sessions."""

import json
import logging
import re
import socket
import time
import urllib.request

import msgpack
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from dzmodel.serve.client import PolicyClient
from dzmodel.serve.protocol import pack
from dzmodel.serve.server import ServeError, ServerLimits, ServerThread
from tests.hostile.test_server_hostile import AUTH, _from, _lines, _small_obs, serve_log  # noqa: F401 (fixture)
from tests.serve.test_server import TOKEN, FakePolicy


def _health(srv) -> dict:
    return json.loads(urllib.request.urlopen(srv.url.replace("ws://", "http://") + "/healthz", timeout=10).read())


def _raw_request(port: int, request: bytes) -> bytes:
    """Sends `request` as it is on a fresh TCP connection; the HTTP response head (empty if the server just
    closed the connection)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        head = b""
        while b"\r\n\r\n" not in head:
            try:
                chunk = sock.recv(4096)
            except OSError:
                break
            if not chunk:
                break
            head += chunk
    return head


def _upgrade(target: str = "/", version: bytes = b"HTTP/1.1", headers: bytes = b"") -> bytes:
    return (b"GET " + target.encode() + b" " + version + b"\r\nHost: x\r\nUpgrade: websocket\r\n"
            b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
            + headers + b"\r\n")


# -- one address and the sessions --

def _take_sessions(srv, address: str, connections: int, per_connection: int) -> tuple[list, list[str]]:
    """From `address`: up to `connections` connections, each opening `per_connection` sessions; returns the
    connections still open and the refusals (text frames) received."""
    kept, refusals = [], []
    for c in range(connections):
        ws = connect(srv.url, sock=_from(address, srv.port), additional_headers=AUTH)
        first = ws.recv(timeout=10)
        if isinstance(first, str):  # refused on connect
            refusals.append(first)
            ws.close()
            continue
        for s in range(per_connection):
            try:
                ws.send(pack({**_small_obs(), "session_id": f"{address}-{c}-{s}"}))
                reply = ws.recv(timeout=10)
            except ConnectionClosed:
                break
            if isinstance(reply, str):
                refusals.append(reply)
                break
        else:
            kept.append(ws)
    return kept, refusals


def test_one_address_cannot_take_every_session_at_the_default_limits(serve_log):
    """At the defaults (16 connections per address, 4 sessions each, 64 sessions) one address used to take all 64
    sessions and every other client got "server full"; now it gets at most 16, and another client is served."""
    limits = ServerLimits(cap_loopback=True)  # every test client is on loopback: capped here as remote ones are
    assert limits.max_sessions_per_client * 2 <= limits.max_sessions
    with ServerThread(FakePolicy(), TOKEN, limits=limits) as srv:
        kept, refusals = _take_sessions(srv, "127.0.0.1", limits.max_connections_per_client + 2,
                                        limits.sessions_per_connection)
        sessions = _health(srv)["sessions"]
        print(f"\none address holds {sessions} sessions of {limits.max_sessions}; refusals: {len(refusals)}")
        assert sessions <= limits.max_sessions_per_client
        assert any(f"too many sessions from 127.0.0.1 (at most {limits.max_sessions_per_client} per client "
                   "address)" in r for r in refusals), refusals
        with connect(srv.url, sock=_from("127.0.0.2", srv.port), additional_headers=AUTH) as other:
            other.recv(timeout=10)
            other.send(pack(_small_obs()))
            assert isinstance(other.recv(timeout=10), bytes), "another client got no session"
        for ws in kept:  # the first address's sessions that fit are still served
            ws.send(pack(_small_obs()))
            assert isinstance(ws.recv(timeout=10), bytes)
            ws.close()
    assert _lines(serve_log, r"error 1013 .*too many sessions from 127\.0\.0\.1 \(at most 16 per client address\)$")


def test_a_connections_own_sessions_are_replaced_not_refused_at_the_address_cap():
    """A connection that cycles through session ids (least recently used ends) never hits the address cap."""
    limits = ServerLimits(cap_loopback=True, max_sessions_per_client=2, sessions_per_connection=2)
    with ServerThread(FakePolicy(), TOKEN, limits=limits) as srv, PolicyClient(srv.url, TOKEN) as c:
        for i in range(6):
            assert c.infer({**_small_obs(), "session_id": f"episode-{i}"})["actions"].shape == (12, 8)
        assert _health(srv)["sessions"] == 2


def test_loopback_sessions_follow_cap_loopback_as_connections_do():
    """Behind a reverse proxy every client comes from 127.0.0.1: uncapped unless cap_loopback, as connections."""
    limits = ServerLimits(max_sessions_per_client=2)
    with ServerThread(FakePolicy(), TOKEN, limits=limits) as srv:
        clients = [PolicyClient(srv.url, TOKEN) for _ in range(4)]
        for c in clients:
            assert c.infer(_small_obs())["actions"].shape == (12, 8)
        for c in clients:
            c.close()


@pytest.mark.parametrize("value", [0, -1])
def test_a_session_cap_that_would_refuse_every_client_is_one_clear_error(value):
    with pytest.raises(ServeError, match="max_sessions_per_client"):
        ServerLimits(max_sessions_per_client=value)


def test_dz_serve_has_the_setting_and_its_default_leaves_room_for_others():
    from dzmodel.cli import build_parser

    ns = build_parser().parse_args(["serve", "bundle"])
    assert ns.max_sessions_per_client * 2 <= ns.max_sessions
    ns = build_parser().parse_args(["serve", "bundle", "--max-sessions-per-client", "8"])
    assert ns.max_sessions_per_client == 8


# -- Authorization headers --

@pytest.mark.parametrize("second", [TOKEN, "wrong-token-123"])
def test_two_authorization_headers_are_a_401_with_one_log_line(second, serve_log):
    headers = f"Authorization: Api-Key {TOKEN}\r\nAuthorization: Bearer {second}\r\n".encode()
    with ServerThread(FakePolicy(), TOKEN) as srv:
        head = _raw_request(srv.port, _upgrade(headers=headers))
        time.sleep(0.1)
        with PolicyClient(srv.url, TOKEN) as c:  # the server carries on
            assert c.infer(_small_obs())["actions"].shape == (12, 8)
    assert head.startswith(b"HTTP/1.1 401"), head[:80]
    assert len(_lines(serve_log, r"refused: .*Authorization.*\(HTTP 401\)$")) == 1, _lines(serve_log, ".")
    assert not _lines(serve_log, r"\b500\b|handshake failed|Traceback")


# -- no token in the log --

SECRETS = ("query-secret-4f1c9a", "apikey-secret-77b2e0", "header-secret-c3d5e8", "bearer-secret-9a0b1c")


@pytest.fixture
def every_log_line():
    """Every record of the server's loggers, websockets' and asyncio's, at DEBUG, formatted with any traceback."""
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            if not record.name.startswith("websockets.client"):  # this test's own client, not the server
                records.append(self.format(record))

    handler = Keep(logging.DEBUG)
    handler.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
    names = ("dzmodel.serve", "dzmodel.serve.ws", "websockets", "asyncio", "")
    saved = {}
    for name in names:
        lg = logging.getLogger(name)
        saved[name] = lg.level
        lg.setLevel(logging.DEBUG)
        lg.addHandler(handler)
    yield records
    for name in names:
        lg = logging.getLogger(name)
        lg.removeHandler(handler)
        lg.setLevel(saved[name])


def _hostile_requests() -> list[bytes]:
    q, k, h, b = SECRETS
    return [
        f"GET /?token={q} HTTP/1.0\r\nHost: x\r\n\r\n".encode(),                       # HTTP/1.0, token in query
        f"GET /ws?api_key={k}&x=1 HTTP/1.0\r\nAuthorization: Api-Key {h}\r\n\r\n".encode(),
        _upgrade(f"/?token={q}", headers=f"Authorization: Api-Key {h}\r\n".encode()),  # wrong token, 1.1
        _upgrade(f"/?api_key={k}"),                                                     # no header
        _upgrade(f"/healthz?token={q}"),
        _upgrade(headers=f"Authorization: Bearer {b}\x01\r\n".encode()),               # an invalid header value
        _upgrade(headers=f"Authorization: Api-Key {h}\r\nAuthorization: Bearer {b}\r\n".encode()),
        f"GET /?token={q}\r\n\r\n".encode(),                                            # no protocol
        f"GET /?token={q} HTTP/1.1\r\nAuthorization Bearer {b}\r\n\r\n".encode(),      # a header without a colon
        _upgrade(f"/?token={TOKEN}", version=b"HTTP/1.0", headers=f"Authorization: Api-Key {TOKEN}\r\n".encode()),
    ]


def test_no_token_is_ever_written_to_the_log(every_log_line):
    with ServerThread(FakePolicy(), TOKEN) as srv:
        for request in _hostile_requests():
            _raw_request(srv.port, request)
        with connect(f"{srv.url}/?token={TOKEN}", additional_headers=AUTH) as ws:  # a good request, token twice
            ws.recv(timeout=10)
            ws.send(pack(_small_obs()))
            ws.recv(timeout=10)
        time.sleep(0.3)
    text = "\n".join(every_log_line)
    assert "opening handshake failed" in text or "refused" in text  # the requests were logged, without secrets
    for secret in (*SECRETS, TOKEN):
        assert secret not in text, [line for line in every_log_line if secret in line]


# -- a 69-byte frame that claims 8 GiB --

def test_a_69_byte_frame_claiming_8_gib_is_refused_in_milliseconds_and_others_keep_their_session():
    frame = msgpack.packb({"observation/state": {b"__ndarray__": True, b"data": b"", b"dtype": "S0",
                                                 b"shape": [2**33]}}, use_bin_type=True)
    assert len(frame) == 69
    policy = FakePolicy()
    with ServerThread(policy, TOKEN) as srv, PolicyClient(srv.url, TOKEN) as other:
        assert other.infer(_small_obs())["actions"].shape == (12, 8)
        with connect(srv.url, additional_headers=AUTH) as ws:
            ws.recv(timeout=10)
            t0 = time.perf_counter()
            ws.send(frame)
            reply = ws.recv(timeout=60)
            refused_ms = (time.perf_counter() - t0) * 1e3
            with pytest.raises(ConnectionClosed) as info:
                ws.recv(timeout=10)
        print(f"\n69-byte S0 frame of shape [2**33] refused in {refused_ms:.1f} ms")
        assert isinstance(reply, str) and reply.startswith("bad request: "), reply
        assert info.value.rcvd.code == 1008
        assert refused_ms < 50
        t0 = time.perf_counter()
        assert other.infer(_small_obs())["actions"].shape == (12, 8)
        assert (time.perf_counter() - t0) < 1.0
        first, second = (sid for sid, _ in policy.calls)
        assert first == second and first not in policy.ended  # the same session, never ended
