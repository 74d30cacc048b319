"""`dz serve`: the policy server that openpi's client, RoboArena's evaluator and DreamZero's client use unchanged.

- Auth: `Authorization: Api-Key <token>` (openpi's client) or `Bearer <token>`, compared in constant time;
  anything else gets HTTP 401, as does a request with more than one `Authorization` header. RoboArena's client
  sends no header: serving it needs `--no-auth`, named explicitly.
- `GET /healthz` (no token): status, sessions, requests and latency percentiles. `GET /metadata` (token): the
  policy's own metadata (embodiment, protocol keys, action shape, step).
- On connect the server sends the handshake metadata: RoboArena's PolicyServerConfig fields when the embodiment
  declares them (`serve.roboarena`), else the policy's own metadata. Then each binary frame is one request:
  `endpoint: "infer"` (or none) gets `{"actions": float32 (N, D), "server_timing": {...}}`; `endpoint: "reset"`
  ends the session named (or all of the connection's) and gets the text "reset successful", as RoboArena's
  server answers.
- A session (KV cache) is per `session_id` (default: one per connection). New frames extend it; a connection
  keeps at most `sessions_per_connection` (the least recently used is ended), one client address
  `max_sessions_per_client` (default 16 of the server's 64, so that one address cannot take them all; loopback as
  for connections, below), the server `max_sessions`.
- Errors go out as one text frame with the reason, then a close: 1008 for a bad request, 1011 when inference
  failed, 1013 when the server is full (what openpi's and RoboArena's clients raise on).
- Limits (`ServerLimits`), each refusal one log line with its reason:
  - camera frames: any size from 8 pixels a side up to `request.max_image_pixels` (default: a 1080p frame, or
    16x the policy's view if more; `protocol.max_camera_pixels`), resized to the view by the policy;
  - frame size: per view, max_frames camera frames of the policy's image size (at least 240x320) or one camera
    frame of the largest size, whichever is more, plus 64 KiB; at most `max_frame_bytes` (default 32 MiB, or
    one largest frame per view if that needs more). A larger frame is refused from its header, before anything
    of it is kept: the reason goes out as a text frame, then close 1009. A frame of up to twice the limit is
    read to its end and thrown away, so that a client still sending it (openpi's) can read the reason; a larger
    one is dropped at once, unread (`_connection_type`);
  - frame structure: string, binary, map and array lengths, nesting depth and the number of maps and arrays
    (protocol.FrameLimits), checked before anything is decoded (1008), so a small frame cannot decode into
    gigabytes; decoding runs on a small thread pool, off the event loop;
  - two frames queue per connection beyond the one being handled; then reading stops (TCP backpressure);
  - a message in more than MAX_FRAGMENTS fragments plus one per FRAGMENT_BYTES of it is refused (1009): each
    fragment is kept until the message ends, even an empty one; a client with over MAX_UNREAD_BYTES of replies
    unread (pongs of its pings, answers) is dropped; a client pinging faster than PINGS_PER_S (bursts of
    PING_BURST) is closed (1008), so that it cannot keep the event loop busy for the others;
  - connections being opened, counted from TCP accept before anything is read: at most `max_connections` whose
    HTTP upgrade request is still coming (`max_connections_per_client` per address, loopback as below) and
    2x `max_connections` open in all; beyond, HTTP 503 ("server full: ..." / "too many connections from ...").
    The request (line and headers) may have MAX_HEAD_BYTES (16 KiB) and MAX_HEAD_LINES (64) lines, else HTTP
    431, and must arrive within `handshake_timeout_s` (5 s, TLS handshake included), else the connection is
    closed; so unauthenticated half-sent handshakes hold a bounded slot and memory (`_HandshakeGate`);
  - `max_connections`, and `max_connections_per_client` per remote address (1013); `max_sessions_per_client`
    sessions per remote address (1013); an IPv6 address counts as its /64 (`client_key`). Loopback clients are
    capped by neither unless `cap_loopback`: they are
    this host's own processes (which could take every connection anyway), or a reverse proxy or SSH tunnel whose
    clients all share its address (limit per client there, e.g. nginx's limit_conn);
  - idle timeout: a connection that sends no request for `idle_timeout_s` is closed (1001). It counts only the
    time the server waits for the next request, never the time a request spends queued or in inference; the
    default (10 min) outlasts a pause between episodes, as openpi's client does not reconnect;
  - keepalive: a ping every `ping_interval_s`; a client that does not answer within `ping_timeout_s` is closed
    (1011), as is one that does not answer a close. openpi's and RoboArena's clients answer pings from a
    background thread, even mid-episode.
- One access-log line per request; a health check is one line (`GET /healthz 200`); a port probe or a failed
  handshake is one line, never a traceback; a wrong or non-ASCII token is one `HTTP 401` line. No credential is
  ever logged: websockets' own lines (a bad request line, a bad header, its debug lines) have query strings,
  fragments, URL credentials and credential headers (Sec-WebSocket-Protocol included) replaced by `<redacted>`
  (`redact`); control characters in a logged value (a session id) are escaped, so no client starts a log line.
  A non-ASCII Upgrade, Connection or Sec-WebSocket-* header is an HTTP 400.
- Inference runs in a worker thread behind one lock, so the event loop keeps answering health checks and pings.
- Dynamic batching (`max_batch` > 1, off by default): requests of different sessions that arrive within
  `batch_window_ms` of each other are solved in one batched forward (`batching.DynamicBatcher`); `server_timing`
  then also carries the batch's size and the time the request waited for it.
"""

from __future__ import annotations

import asyncio
import gc
import hmac
import json
import logging
import re
import sys
import threading
import time
import uuid
import weakref
from collections import Counter, OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np

from ..data.embodiments import ROBOARENA_ACTION_SPACES, ServeSpec
from .batching import DynamicBatcher
from .protocol import (ProtocolError, Request, RequestLimits, frame_limits, frame_too_big, pack, parse_request,
                       unpack)
from .safety import ActionSafety, UnsafeActions

log = logging.getLogger("dzmodel.serve")

CLOSE_GOING_AWAY, CLOSE_BAD_REQUEST, CLOSE_TOO_BIG, CLOSE_INTERNAL, CLOSE_TRY_AGAIN = 1001, 1008, 1009, 1011, 1013
QUEUED_FRAMES = 2     # per connection, beyond the one being handled
DECODE_THREADS = 2
DRAIN_FACTOR = 2      # a frame over the size limit, up to this many times it, is read to its end (and thrown away)
MAX_HEAD_BYTES = 16 << 10  # an HTTP request's line and headers (websockets alone: 128 lines of 8 KiB)
MAX_HEAD_LINES = 64        # its request line and header lines
REFUSAL_LINGER_S = 1.0     # a connection refused at accept waits this long for its request, to be answered
MAX_FRAGMENTS = 64         # fragments of one message, plus one per FRAGMENT_BYTES of it received so far: each
FRAGMENT_BYTES = 1024      # fragment is kept as an object of ~100 bytes until the message ends, even an empty one
MAX_UNREAD_BYTES = 1 << 20  # replies (pongs included) a client has not read; beyond, it is dropped
PINGS_PER_S, PING_BURST = 10, 50  # a client's pings: each costs the event loop a parse and a pong; clients ping
                                  # for keepalive every few seconds (openpi's and RoboArena's every 20 s)


class ServeError(RuntimeError):
    """The server cannot start (bad bundle, port in use, bad TLS files); one line says why."""


class Policy(Protocol):
    metadata: dict        # our own fields (GET /metadata)
    handshake: dict       # what goes out on connect
    spec: ServeSpec
    state_dims: dict[str, int]

    def check_request(self, request: Request) -> None: ...

    def infer(self, request: Request, session_id: str) -> np.ndarray: ...

    # optional: `infer_batch(items: list[(Request, session_id)]) -> list[np.ndarray | Exception]`, one forward for
    # all (`BundlePolicy.infer_batch`); without it a batch is solved one request after the other

    def end_session(self, session_id: str) -> None: ...


class BundlePolicy:
    """An EmbodiedPolicy behind its embodiment's protocol keys (`serve:` in embodiments.yaml); every chunk passes
    `safety` (the bundle's robot limits, `safety.ActionSafety`) before it is sent."""

    def __init__(self, embodied, state_margin: float = 10.0, safety: ActionSafety | None = None):
        self.embodied = embodied
        self.safety = safety or ActionSafety()
        try:
            self.safety.check(embodied.action_dim)
        except UnsafeActions as exc:
            raise ServeError(str(exc)) from None
        emb = embodied.embodiment
        self.spec = emb.wire
        stats = embodied.policy.state_stats
        widths, start = {}, 0
        dims = embodied.state_dims
        for key in emb.state:
            widths[key.name] = (start, start + dims[key.name])
            start += dims[key.name]
        self.state_dims, self._state_slices = dims, widths
        span = np.maximum(stats.q99 - stats.q01, 0.0)
        # a state far outside everything the model trained on is a unit, frame or sensor error, not an observation
        self._state_lo, self._state_hi = stats.q01 - state_margin * span - 1.0, stats.q99 + state_margin * span + 1.0
        arena = self.spec.roboarena
        if arena is not None and ROBOARENA_ACTION_SPACES[arena["action_space"]] != embodied.action_dim:
            raise ServeError(f"embodiment {emb.tag!r}: RoboArena's {arena['action_space']} actions have "
                             f"{ROBOARENA_ACTION_SPACES[arena['action_space']]} dims, the model predicts {embodied.action_dim}")
        self.metadata = {"embodiment": emb.tag, "action_horizon": embodied.action_horizon,
                         "action_dim": embodied.action_dim, "views": list(emb.views), "step": embodied.step,
                         "protocol": {"images": dict(self.spec.images), "state": dict(self.spec.state),
                                      "state_dims": {p: dims[k] for p, k in self.spec.state.items()},
                                      "ignored": list(self.spec.ignored)},
                         "roboarena": arena}
        self.handshake = dict(arena) if arena is not None else self.metadata
        # what a camera frame may be expected to have: the model's view, or what RoboArena's clients are told
        h, w = emb.view_size
        sent = arena.get("image_resolution") if arena is not None else None
        self.image_pixels = max(h * w, sent[0] * sent[1] if sent else 0)

    def _state(self, request: Request) -> np.ndarray:
        return np.concatenate([request.state[k.name] for k in self.embodied.embodiment.state])

    def check_request(self, request: Request) -> None:
        state = self._state(request)
        bad = np.flatnonzero((state < self._state_lo) | (state > self._state_hi))
        if bad.size:
            i = int(bad[0])
            key, offset = next((k, i - lo) for k, (lo, hi) in self._state_slices.items() if lo <= i < hi)
            proto = next(p for p, s in self.spec.state.items() if s == key)
            raise ProtocolError(f"{proto}[{offset}] = {state[i]:g} is far outside the trained range "
                                f"{self._state_lo[i]:.3g}..{self._state_hi[i]:.3g} (wrong units or a bad reading?)")

    def infer(self, request: Request, session_id: str) -> np.ndarray:
        actions = self.embodied.predict(session_id, request.images, self._state(request), request.prompt)
        return self.safety.apply(actions, session_id)

    def infer_batch(self, items: list[tuple[Request, str]]) -> list:
        """One chunk per (request, session), all sessions in one batched forward; each chunk passes the safety
        limits on its own (an unsafe chunk is its request's error, not the others')."""
        chunks = self.embodied.predict_batch([(sid, r.images, self._state(r), r.prompt) for r, sid in items])
        out: list = []
        for chunk, (_, sid) in zip(chunks, items):
            try:
                out.append(self.safety.apply(chunk, sid))
            except UnsafeActions as exc:
                out.append(exc)
        return out

    def end_session(self, session_id: str) -> None:
        self.embodied.end_session(session_id)


class TokenAuth:
    """`Authorization: Api-Key <token>` or `Bearer <token>`, compared in constant time."""

    SCHEMES = ("api-key", "bearer")

    def __init__(self, token: str):
        if len(token) < 8:
            raise ServeError("the server token must have at least 8 characters (DZ_SERVE_TOKEN or --token-file)")
        self._token = token.encode()

    def accepts(self, header: str | None) -> bool:
        scheme, _, credential = (header or "").strip().partition(" ")
        try:  # header bytes arrive as surrogate escapes: back to the bytes sent (a non-ASCII token is UTF-8)
            sent = credential.strip().encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:
            return False
        ok = hmac.compare_digest(sent, self._token)
        return ok and scheme.lower() in self.SCHEMES


@dataclass(frozen=True)
class ServerLimits:
    max_sessions: int = 64                # KV caches across all connections
    sessions_per_connection: int = 4      # beyond it, the connection's least recently used session ends
    max_connections: int = 64
    max_connections_per_client: int = 16  # per remote address
    max_sessions_per_client: int = 16     # per remote address, across its connections: room for others
    cap_loopback: bool = False            # loopback too (both caps): by default it may be a proxy for many clients
    max_frame_bytes: int | None = None    # the cap (None: 32 MiB, or more for one largest camera frame per view);
                                          # the limit itself follows the policy's views (protocol.frame_limits)
    idle_timeout_s: float = 600.0         # no request for this long: closed; 0 never
    ping_interval_s: float = 20.0         # 0: no keepalive pings
    ping_timeout_s: float = 20.0          # to answer a ping, or a close
    handshake_timeout_s: float = 5.0      # from TCP accept to the end of the HTTP upgrade request (and TLS's)
    max_batch: int = 1                    # > 1: dynamic batching of concurrent sessions, at most this many a forward
    batch_window_ms: float = 5.0          # how long the oldest request waits for others to join its batch
    request: RequestLimits = RequestLimits()

    def __post_init__(self):
        for name in ("max_sessions", "sessions_per_connection", "max_connections", "max_connections_per_client",
                     "max_sessions_per_client", "max_frame_bytes", "max_batch"):
            if getattr(self, name) is not None and not getattr(self, name) >= 1:
                raise ServeError(f"{name} must be >= 1, got {getattr(self, name)}")
        pixels, side = self.request.max_image_pixels, self.request.min_image_side
        if pixels is not None and not pixels >= side * side:
            raise ServeError(f"max_image_pixels must be at least {side * side} (a {side}x{side} image), got {pixels}")
        if not (self.handshake_timeout_s > 0 and self.handshake_timeout_s != float("inf")):
            raise ServeError(f"handshake_timeout_s must be a finite number of seconds > 0, got "
                             f"{self.handshake_timeout_s}")
        for name in ("idle_timeout_s", "ping_interval_s", "ping_timeout_s", "batch_window_ms"):
            value = getattr(self, name)
            if not (value >= 0 and value != float("inf")):  # NaN fails both
                unit = "milliseconds" if name.endswith("_ms") else "seconds"
                raise ServeError(f"{name} must be a finite number of {unit} >= 0 (0: off), got {value}")


@dataclass
class ServerStats:
    requests: int = 0
    errors: int = 0
    connections: int = 0
    sessions: int = 0
    latencies_ms: deque = field(default_factory=lambda: deque(maxlen=10000))

    def percentiles(self) -> dict:
        if not self.latencies_ms:
            return {}
        arr = np.asarray(self.latencies_ms)
        return {k: round(float(np.percentile(arr, q)), 2) for k, q in (("p50", 50), ("p95", 95), ("p99", 99))} | \
            {"max": round(float(arr.max()), 2)}


# headers that may carry a credential (a browser client can send its token only as a websocket subprotocol)
_SECRET_HEADERS = (r"(?:proxy-)?authorization|cookie|set-cookie|x-api-key|x-auth-token|api-key|"
                   r"sec-websocket-protocol")
_REDACTIONS = (
    # a request target's query string (?token=..., ?api_key=...) or fragment, wherever a request line is quoted
    (re.compile(r"[?#]\S+"), "?<redacted>"),
    # credentials in an absolute request target (http://user:token@host/)
    (re.compile(r"//[^/\s@]*@"), "//<redacted>@"),
    # a secret header's value quoted by a parse error ("invalid Sec-WebSocket-Protocol header: ...")
    (re.compile(rf"(?i)(invalid (?:{_SECRET_HEADERS}) header):.*"), r"\1: <redacted>"),
    # a secret header, as websockets' debug lines write headers ("< Authorization: Api-Key ...")
    (re.compile(rf"(?i)\b({_SECRET_HEADERS})\s*:.*"), r"\1: <redacted>"),
    # a header websockets could not parse: its name or value may be a credential
    (re.compile(r"(?i)(invalid HTTP header (?:line|name|value)): .*"), r"\1: <redacted>"),
    # a credential after its scheme, wherever it appears
    (re.compile(r"(?i)\b(api-key|bearer|basic)(\s+)\S+"), r"\1\2<redacted>"),
)


def redact(text: str) -> str:
    """`text` with query strings, secret headers and credentials replaced by `<redacted>`."""
    for pattern, replacement in _REDACTIONS:
        text = pattern.sub(replacement, text)
    return text


def printable(text: str) -> str:
    """`text` as one log line: control characters (newlines included) escaped, so that what a client sent (a
    session id, a request line) cannot start a line of its own."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class _OneLine(logging.LoggerAdapter):
    """websockets' own log (failed handshakes, probes) as single lines: the exception's message, no traceback,
    with every credential redacted (`redact`): its messages quote request lines and header values.
    Its "connection rejected" line is left out for HTTP answers of ours (health, metadata, 401), which log
    their own line."""

    def __init__(self, logger: logging.Logger, answered: weakref.WeakSet):
        super().__init__(logger, {})
        self.answered = answered

    def log(self, level, msg, *args, **kwargs):
        connection = (kwargs.get("extra") or {}).get("websocket")  # websockets names the connection here
        if (isinstance(msg, str) and msg.startswith(("connection rejected", "opening handshake failed"))
                and connection in self.answered):
            return
        if not self.isEnabledFor(level):
            return
        if args:  # formatted here, so that the arguments (a request path, a header) are redacted too
            try:
                msg = str(msg) % args
            except (TypeError, ValueError):
                msg = " ".join(map(str, (msg, *args)))
        super().log(level, msg, **kwargs)

    def process(self, msg, kwargs):
        exc = kwargs.pop("exc_info", None)
        kwargs.pop("stack_info", None)
        if exc:
            err = sys.exc_info()[1] if exc is True else exc[1] if isinstance(exc, tuple) else exc
            while err is not None and err.__cause__ is not None:
                err = err.__cause__
            if err is not None:
                msg = f"{msg}: {type(err).__name__}: {err}"
        return printable(redact(str(msg))), kwargs


class _HandshakeGate:
    """TCP connections counted from accept, before any byte is read: at most `max_connections` still sending
    their HTTP request (`max_connections_per_client` per address, loopback as for connections), and twice
    `max_connections` open in all. Connections over a cap are answered HTTP 503 at once, never read."""

    def __init__(self, limits: ServerLimits, capped: Callable[[str], bool]):
        self.limits, self.capped = limits, capped
        self.open: set = set()
        self.pending: Counter[str] = Counter()  # address -> connections whose request is not read yet
        self.lingering = 0                      # refused connections still being answered

    def accept(self, conn, client: str) -> str | None:
        """Count `conn` (pending); None, or why it is refused."""
        limits = self.limits
        if len(self.open) >= 2 * limits.max_connections:
            return f"server full: {len(self.open)} connections open"
        if sum(self.pending.values()) >= limits.max_connections:
            return f"server full: {limits.max_connections} connections opening"
        per_client = limits.max_connections_per_client
        if self.capped(client) and self.pending[client] >= per_client:
            return f"too many connections from {client} (at most {per_client} opening per client address)"
        self.open.add(conn)
        self.pending[client] += 1
        conn.pending_client = client
        return None

    def request_read(self, conn) -> None:
        """`conn`'s HTTP request is read: it no longer counts as opening."""
        client = getattr(conn, "pending_client", None)
        if client is not None:
            conn.pending_client = None
            self.pending[client] -= 1
            if not self.pending[client]:
                del self.pending[client]

    def closed(self, conn) -> None:
        self.request_read(conn)
        self.open.discard(conn)


class _RequestFailed(Exception):
    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


class PolicyServer:
    def __init__(self, policy: Policy, auth: TokenAuth | None, limits: ServerLimits = ServerLimits()):
        self.policy, self.auth, self.limits = policy, auth, limits
        image_pixels = getattr(policy, "image_pixels", 0)
        self.request_limits = limits.request.for_views(image_pixels)  # max_image_pixels resolved for its views
        self.frame_limits = frame_limits(policy.spec, policy.state_dims, self.request_limits, image_pixels,
                                         limits.max_frame_bytes)
        self.stats = ServerStats()
        self._lock = threading.Lock()
        self._owner: dict[str, tuple[int, str]] = {}  # session -> (connection, remote address) that holds it
        self._per_client: Counter[str] = Counter()  # remote address -> open connections
        self._client_sessions: Counter[str] = Counter()  # remote address -> open sessions
        self._answered = weakref.WeakSet()   # connections answered over HTTP by _process_request or the gate
        self._gate = _HandshakeGate(limits, self._capped)
        self._decoder: ThreadPoolExecutor | None = None
        self._batcher: DynamicBatcher | None = None   # made in `serve` when limits.max_batch > 1

    # -- HTTP side: health, metadata, auth --

    def _process_request(self, connection, request):
        peer = _peer(connection)
        if request.path == "/healthz":
            body = {"status": "ok", "connections": self.stats.connections, "sessions": self.stats.sessions,
                    "requests": self.stats.requests, "errors": self.stats.errors,
                    "latency_ms": self.stats.percentiles()}
            if self._batcher is not None:
                body["batching"] = {"max_batch": self.limits.max_batch, "window_ms": self.limits.batch_window_ms,
                                    **self._batcher.stats.as_dict()}
            log.info(f"{peer} GET /healthz 200")
            return self._answer(connection, 200, json.dumps(body) + "\n")
        credentials = request.headers.get_all("Authorization")
        if self.auth is not None and len(credentials) > 1:
            log.info(f"{peer} refused: {len(credentials)} Authorization headers (HTTP 401)")
            return self._answer(connection, 401, "send one Authorization header, 'Authorization: Api-Key <token>' "
                                                 "or 'Bearer <token>'\n")
        if self.auth is not None and not self.auth.accepts(credentials[0] if credentials else None):
            log.info(f"{peer} refused: missing or wrong token (HTTP 401)")
            return self._answer(connection, 401, "missing or wrong token: send 'Authorization: Api-Key <token>' "
                                                 "or 'Bearer <token>'\n")
        bad = _non_ascii_handshake_header(request.headers)
        if bad is not None:
            log.info(f"{peer} refused: a non-ASCII {bad} header (HTTP 400)")
            return self._answer(connection, 400, f"the {bad} header must be ASCII\n")
        if request.path == "/metadata":
            log.info(f"{peer} GET /metadata 200")
            return self._answer(connection, 200, json.dumps(self.policy.metadata, default=str) + "\n")
        return None

    def _answer(self, connection, status: int, body: str):
        self._answered.add(connection)
        return connection.respond(status, body)

    # -- inference --

    def _infer(self, request: Request, session_id: str) -> tuple[np.ndarray, dict]:
        with self._lock:  # one model, one request at a time
            t0 = time.perf_counter()
            actions = np.asarray(self.policy.infer(request, session_id), dtype=np.float32)
            return actions, {"infer_ms": round((time.perf_counter() - t0) * 1e3, 2)}

    def _infer_batch(self, items: list[tuple[Request, str]]) -> list:
        """The batcher's call: one answer (float32 actions) or exception per (request, session)."""
        with self._lock:
            batched = getattr(self.policy, "infer_batch", None)
            if batched is not None:
                results = batched(items)
            else:
                results = []
                for request, sid in items:
                    try:
                        results.append(self.policy.infer(request, sid))
                    except Exception as exc:
                        results.append(exc)
        return [r if isinstance(r, BaseException) else np.asarray(r, dtype=np.float32) for r in results]

    async def _infer_batched(self, request: Request, session_id: str) -> tuple[np.ndarray, dict]:
        answer = await self._batcher.submit(session_id, (request, session_id))
        return answer.result, {"infer_ms": round(answer.solve_ms, 2), "queue_ms": round(answer.queue_ms, 2),
                               "batch_size": answer.batch_size}

    def _end(self, sid: str) -> None:
        with self._lock:
            self.policy.end_session(sid)

    async def _end_session(self, sid: str) -> None:
        """End `sid` in the policy (on a worker thread), then release its place; the counts change only on the
        event loop."""
        await asyncio.to_thread(self._end, sid)
        owner = self._owner.pop(sid, None)
        if owner is not None:
            self.stats.sessions -= 1
            client = owner[1]
            self._client_sessions[client] -= 1
            if not self._client_sessions[client]:
                del self._client_sessions[client]

    def _capped(self, client: str) -> bool:
        """Whether the per-address limits apply to `client` (loopback only with cap_loopback)."""
        return self.limits.cap_loopback or not _is_loopback(client)

    async def _open_session(self, conn_id: int, client: str, sessions: OrderedDict, sid: str) -> None:
        """Register `sid` for this connection: bounded per connection (LRU), per client address and across the
        server."""
        if sid in sessions:
            sessions.move_to_end(sid)
            return
        owner = self._owner.get(sid)
        if owner is not None and owner[0] != conn_id:
            raise _RequestFailed(CLOSE_BAD_REQUEST, f"session_id {sid!r} is in use by another connection")
        if len(sessions) >= self.limits.sessions_per_connection:
            old, _ = sessions.popitem(last=False)
            await self._end_session(old)
        per_client = self.limits.max_sessions_per_client
        if self._capped(client) and self._client_sessions[client] >= per_client:
            raise _RequestFailed(CLOSE_TRY_AGAIN, f"too many sessions from {client} (at most {per_client} per "
                                                  "client address)")
        if self.stats.sessions >= self.limits.max_sessions:
            raise _RequestFailed(CLOSE_TRY_AGAIN, f"server full: {self.limits.max_sessions} sessions open")
        sessions[sid] = True
        self._owner[sid] = (conn_id, client)
        self._client_sessions[client] += 1
        self.stats.sessions += 1

    async def _handle(self, request: Request, conn_id: int, client: str, sessions: OrderedDict, sid: str):
        if request.endpoint == "reset":  # RoboArena: the end of an episode; without a session_id, of them all
            for ended in ([request.session_id] if request.session_id else list(sessions)):
                if sessions.pop(ended, None) is not None:
                    await self._end_session(ended)
            return "reset successful", {}
        self.policy.check_request(request)
        await self._open_session(conn_id, client, sessions, sid)
        if self._batcher is not None:
            return await self._infer_batched(request, sid)
        return await asyncio.to_thread(self._infer, request, sid)

    # -- decoding, off the event loop --

    def _decode(self, message: bytes) -> Request:
        try:
            return parse_request(unpack(message, self.frame_limits), self.policy.spec, self.policy.state_dims,
                                 self.request_limits)
        except ProtocolError:
            raise
        except Exception as exc:  # a frame the checks missed is still the client's bad request, not our failure
            raise ProtocolError(f"unreadable request: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}") \
                from None

    async def _next_frame(self, ws):
        """The next frame; TimeoutError after idle_timeout_s without one (time spent serving is not counted)."""
        if not self.limits.idle_timeout_s:
            return await ws.recv()
        async with asyncio.timeout(self.limits.idle_timeout_s):
            return await ws.recv()

    # -- connections --

    def _admit(self, client: str) -> str | None:
        """None, or why a new connection from `client` is refused."""
        if self.stats.connections >= self.limits.max_connections:
            return f"server full: {self.limits.max_connections} connections"
        per_client = self.limits.max_connections_per_client
        if self._capped(client) and self._per_client[client] >= per_client:
            return f"too many connections from {client} (at most {per_client} per client address)"
        return None

    def _log_close(self, peer: str, exc: Exception, ws=None) -> None:
        from websockets.exceptions import ConnectionClosed, ConnectionClosedOK

        sent = exc.sent if isinstance(exc, ConnectionClosed) else None
        if sent is not None and sent.code == CLOSE_TOO_BIG:  # refused from the frame's header (_connection_type)
            if not getattr(ws, "refusal_logged", False):
                self._refused_too_big(peer, f"frame too big: {sent.reason}")
        elif sent is not None and sent.code not in (1000, CLOSE_GOING_AWAY):  # a keepalive timeout, a protocol error
            log.info(f"{peer} closed: {sent.reason or 'protocol error'} ({sent.code})")
        elif not isinstance(exc, ConnectionClosedOK):  # the client went away (openpi's never sends a close frame)
            log.info(f"{peer} disconnected ({type(exc).__name__})")

    def _refused_http(self, connection, peer: str, status: int, reason: str) -> None:
        """A connection refused by the gate or over the header budget: one line; websockets' own is left out."""
        self._answered.add(connection)
        self.stats.errors += 1
        log.info(f"{peer} refused: {reason} (HTTP {status})")

    def _refused_too_big(self, peer: str, reason: str) -> None:
        self.stats.errors += 1
        log.info(f"{peer} refused: {reason} ({CLOSE_TOO_BIG})")

    async def _handler(self, ws):
        peer, client = _peer(ws), _client(ws)
        refusal = self._admit(client)
        if refusal is not None:
            log.info(f"{peer} refused: {refusal} ({CLOSE_TRY_AGAIN})")
            await _fail(ws, CLOSE_TRY_AGAIN, refusal)
            return
        self.stats.connections += 1
        self._per_client[client] += 1
        conn_id, default_sid = id(ws), uuid.uuid4().hex
        sessions: OrderedDict[str, bool] = OrderedDict()
        prev_total_ms = None
        loop = asyncio.get_running_loop()
        try:
            await ws.send(pack(self.policy.handshake))
            while True:
                try:
                    message = await self._next_frame(ws)
                except TimeoutError:
                    idle = f"no request for {self.limits.idle_timeout_s:g} s"
                    log.info(f"{peer} closed: {idle} (idle timeout, {CLOSE_GOING_AWAY})")
                    await _fail(ws, CLOSE_GOING_AWAY, f"idle: {idle}; reconnect to go on")
                    return
                t0 = time.perf_counter()
                endpoint, sid = "?", None
                try:
                    if isinstance(message, str):
                        raise ProtocolError("send binary msgpack frames, not text")
                    request = await loop.run_in_executor(self._decoder, self._decode, message)
                    del message  # the raw frame (up to the frame limit) is not needed during inference
                    endpoint = request.endpoint
                    sid = request.session_id or (default_sid if endpoint == "infer" else "all")
                    result, timing = await self._handle(request, conn_id, client, sessions, sid)
                except (ProtocolError, _RequestFailed) as exc:
                    code = exc.code if isinstance(exc, _RequestFailed) else CLOSE_BAD_REQUEST
                    self._access(peer, endpoint, sid, f"error {code}", t0, str(exc))
                    await _fail(ws, code, f"bad request: {exc}" if code == CLOSE_BAD_REQUEST else str(exc))
                    return
                except Exception as exc:  # inference failed: say why, close, keep serving others
                    self._access(peer, endpoint, sid, f"error {CLOSE_INTERNAL}", t0, f"{type(exc).__name__}: {exc}")
                    log.exception("inference failed")
                    await _fail(ws, CLOSE_INTERNAL, f"inference failed: {type(exc).__name__}: {exc}")
                    return
                if isinstance(result, str):
                    await ws.send(result)
                else:
                    if prev_total_ms is not None:
                        timing["prev_total_ms"] = round(prev_total_ms, 2)
                    await ws.send(pack({"actions": result, "server_timing": timing}))
                    self.stats.requests += 1
                    self.stats.latencies_ms.append(timing["infer_ms"] + timing.get("queue_ms", 0.0))
                prev_total_ms = (time.perf_counter() - t0) * 1e3
                self._access(peer, endpoint, sid, "ok", t0)
        except Exception as exc:
            self._log_close(peer, exc, ws)
        finally:
            self.stats.connections -= 1
            if self._batcher is not None:
                self._batcher.wake()  # one client fewer that a batch could wait for
            self._per_client[client] -= 1
            if not self._per_client[client]:
                del self._per_client[client]
            for sid in list(sessions):
                await self._end_session(sid)

    def _access(self, peer: str, endpoint: str, sid: str | None, status: str, t0: float, detail: str = "") -> None:
        if status != "ok":
            self.stats.errors += 1
        ms = (time.perf_counter() - t0) * 1e3
        line = f"{peer} {endpoint} session={(sid or '-')[:40]} {status} {ms:.1f}ms"
        log.info(printable(f"{line} {detail}".rstrip()))

    async def serve(self, host: str, port: int, ready: threading.Event | None = None, stop: asyncio.Event | None = None,
                    bound: list | None = None, ssl=None):
        from websockets.asyncio.server import serve

        limits = self.limits
        self._decoder = ThreadPoolExecutor(DECODE_THREADS, thread_name_prefix="dz-decode")
        if limits.max_batch > 1:
            self._batcher = DynamicBatcher(self._infer_batch, limits.max_batch, limits.batch_window_ms / 1e3,
                                           clients=lambda: self.stats.connections)
        try:
            async with serve(self._handler, host, port, process_request=self._process_request,
                             max_size=self.frame_limits.max_bytes, max_queue=QUEUED_FRAMES, compression=None,
                             ping_interval=limits.ping_interval_s or None, ping_timeout=limits.ping_timeout_s or None,
                             close_timeout=limits.ping_timeout_s or None, open_timeout=limits.handshake_timeout_s,
                             create_connection=_connection_type(lambda size: frame_too_big(size, self.frame_limits),
                                                                self.frame_limits.max_bytes, self._refused_too_big,
                                                                self._gate, self._refused_http),
                             ssl=ssl, logger=_OneLine(logging.getLogger("dzmodel.serve.ws"), self._answered)) as server:
                if bound is not None:
                    bound.append(server.sockets[0].getsockname()[1])
                if ready is not None:
                    ready.set()
                await (stop.wait() if stop is not None else asyncio.Future())
        finally:
            if self._batcher is not None:
                await self._batcher.close()
                self._batcher = None
            self._decoder.shutdown(wait=False, cancel_futures=True)


def _connection_type(too_big: Callable[[int], str], max_bytes: int, refused: Callable[[str, str], None],
                     gate: _HandshakeGate | None = None, refused_http: Callable | None = None):
    """websockets' server connection, refusing a frame over `max_bytes` from its header with the reason
    (`too_big(size)`) as a text frame, then close 1009; `refused(peer, reason)` logs it once they are sent.

    websockets alone sends only the close and stops reading; a client still writing the frame, as openpi's does
    (it reads nothing until its send is done), then gets a reset and never sees why. So a frame of up to
    DRAIN_FACTOR times the limit is read to its end and thrown away as it comes (never held: it costs the server
    the bandwidth of a valid request, and no memory), within the close timeout; the client's send completes and
    it reads the reason. A larger frame is dropped at once, unread (its close carries the reason's start).

    With a `gate`, every TCP connection is counted from accept (`_HandshakeGate`): one over its caps is answered
    HTTP 503 before anything is read, and an HTTP request over MAX_HEAD_BYTES or MAX_HEAD_LINES is answered 431
    (websockets alone holds up to 128 lines of 8 KiB for each connection until its handshake timeout);
    `refused_http(connection, peer, status, reason)` logs them."""
    from websockets.asyncio.server import ServerConnection
    from websockets.exceptions import PayloadTooBig
    from websockets.exceptions import ProtocolError as WsProtocolError
    from websockets.frames import Opcode
    from websockets.protocol import State
    from websockets.server import ServerProtocol

    class TooManyFragments(WsProtocolError):
        pass

    class TooManyPings(WsProtocolError):
        pass

    class RefusingProtocol(ServerProtocol):
        refusal: str | None = None   # the reason a frame was refused, for the log
        read_to_end = False          # the refused frame is being (or was) read and thrown away
        fragments = 0                # frames of the message being received
        ping_tokens = float(PING_BURST)  # pings it may send now (a token bucket refilled at PINGS_PER_S)
        ping_at = 0.0

        def recv_frame(self, frame) -> None:
            if frame.opcode is Opcode.PING:
                now = time.monotonic()
                self.ping_tokens = min(PING_BURST, self.ping_tokens + (now - (self.ping_at or now)) * PINGS_PER_S)
                self.ping_at = now
                if self.ping_tokens < 1:
                    raise TooManyPings(f"pings faster than {PINGS_PER_S} a second (bursts of {PING_BURST}); "
                                       "a keepalive needs one every few seconds")
                self.ping_tokens -= 1
            elif frame.opcode is Opcode.CONT:
                self.fragments += 1
                allowed = MAX_FRAGMENTS + (self.cur_size or 0) // FRAGMENT_BYTES
                if self.fragments > allowed:
                    raise TooManyFragments(f"a message in over {allowed} fragments ({self.cur_size or 0:,} bytes so "
                                           f"far); send it in one frame, or in fragments of {FRAGMENT_BYTES} bytes "
                                           "or more")
            elif frame.opcode in (Opcode.TEXT, Opcode.BINARY):
                self.fragments = 1
            super().recv_frame(frame)

        def fail(self, code: int, reason: str = "") -> None:
            exc = sys.exc_info()[1]  # called by parse() while it handles PayloadTooBig (or TooManyFragments)
            if isinstance(exc, (TooManyFragments, TooManyPings)) and self.state is State.OPEN:
                self.refusal = str(exc)
                code = CLOSE_TOO_BIG if isinstance(exc, TooManyFragments) else CLOSE_BAD_REQUEST
                return super().fail(code, _close_reason(self.refusal))
            size = getattr(exc, "size", None) if isinstance(exc, PayloadTooBig) else None
            if code != CLOSE_TOO_BIG or not isinstance(size, int) or self.state is not State.OPEN:
                return super().fail(code, reason)
            self.refusal = too_big(size)
            if size > DRAIN_FACTOR * max_bytes or self.cur_size is not None or self.expect_continuation_frame:
                return super().fail(code, _close_reason(self.refusal))
            self.read_to_end = True
            self.send_text(self.refusal.encode())
            self.send_close(code, _close_reason(self.refusal))
            self.parser = self._throw_away(4 + size)  # the frame's mask, then its payload
            next(self.parser)

        def _throw_away(self, n: int):
            reader = self.reader
            while n > 0 and (reader.buffer or not reader.eof):
                if not reader.buffer:
                    yield
                    continue
                taken = min(n, len(reader.buffer))
                del reader.buffer[:taken]
                n -= taken
            self.send_eof()  # then, as websockets' own refusal: wait for the client to close
            yield from self.discard()

    class Connection(ServerConnection):
        def __init__(self, protocol, *args, **kwargs):
            protocol.__class__ = RefusingProtocol
            super().__init__(protocol, *args, **kwargs)
            self._drain_timer = None
            self.refusal_logged = False
            self.pending_client = None
            self._head_bytes = self._head_lines = 0
            self._refused_http = self._lingering = False
            self._answer: bytes | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if gate is None:
                return
            refusal = gate.accept(self, _client(self))
            if refusal is not None:
                self._refuse_http(503, "Service Unavailable", refusal)

        def _refuse_http(self, status: int, phrase: str, reason: str) -> None:
            """Answer `reason` over HTTP once the client has sent (the start of) its request, as an answer before
            it confuses clients, then close; a client that sends nothing is closed after REFUSAL_LINGER_S. Beyond
            4x max_connections such refusals waiting at once, closed unanswered."""
            self._refused_http = True
            refused_http(self, _peer(self), status, reason)
            if gate.lingering >= 4 * gate.limits.max_connections:
                self.transport.abort()
                return
            body = (reason + "\n").encode()
            self._answer = (f"HTTP/1.1 {status} {phrase}\r\nContent-Type: text/plain; charset=utf-8\r\n"
                            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body
            gate.lingering += 1
            self._lingering = True
            self._drain_timer = self.loop.call_later(REFUSAL_LINGER_S, self.transport.abort)

        def _send_answer(self) -> None:
            if self._answer is not None:
                self.transport.write(self._answer)
                self._answer = None
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            if self._refused_http:
                self._send_answer()
                return
            if gate is not None and self.pending_client is not None:  # still reading the HTTP request
                fed, data = data[:MAX_HEAD_BYTES - self._head_bytes], data[MAX_HEAD_BYTES - self._head_bytes:]
                self._head_bytes += len(fed)
                self._head_lines += fed.count(b"\n")
                self._received(fed)
                if self.request is None:
                    if self._head_bytes >= MAX_HEAD_BYTES or self._head_lines > MAX_HEAD_LINES:
                        self._refuse_http(431, "Request Header Fields Too Large", "request head over "
                                          f"{MAX_HEAD_BYTES // 1024} KiB or {MAX_HEAD_LINES} lines")
                        self._send_answer()
                    return
                gate.request_read(self)
                if not data:
                    return
            self._received(data)

        def _received(self, data: bytes) -> None:
            super().data_received(data)
            unread = self.transport.get_write_buffer_size()
            if unread > MAX_UNREAD_BYTES and not self.transport.is_closing():
                # what it sent (pings, requests) is answered into memory the client never drains
                log.info(f"{_peer(self)} dropped: {unread:,} bytes of replies unread (at most "
                         f"{MAX_UNREAD_BYTES:,}); a client must read what the server sends")
                self.transport.abort()
                return
            sent = self.protocol.close_sent
            if sent is None or (sent.code != CLOSE_TOO_BIG and self.protocol.refusal is None):
                return
            if self.protocol.refusal is not None and not self.refusal_logged:
                self.refusal_logged = True
                refused(_peer(self), self.protocol.refusal)
            if self.transport.is_closing():
                return
            if self.protocol.read_to_end:
                if self._drain_timer is None:  # a client that stops sending is dropped after the close timeout
                    self._drain_timer = self.loop.call_later(self.close_timeout or 20.0, self.transport.abort)
            elif self.transport.get_write_buffer_size():  # dropped unread; a client that reads nothing would
                self.transport.abort()                     # keep it open
            else:
                self.transport.close()

        def connection_lost(self, exc) -> None:
            if self._drain_timer is not None:
                self._drain_timer.cancel()
            if gate is not None:
                gate.lingering -= self._lingering
                gate.closed(self)
            super().connection_lost(exc)

    return Connection


def _non_ascii_handshake_header(headers) -> str | None:
    """The name of a websocket handshake header (Upgrade, Connection, Sec-WebSocket-*) whose value is not ASCII,
    or None: websockets would fail on it while writing its own 400 answer, and answer nothing."""
    for name, value in headers.raw_items():
        lower = name.lower()
        if (lower in ("upgrade", "connection") or lower.startswith("sec-websocket-")) and not value.isascii():
            return name
    return None


def _close_reason(text: str) -> str:
    """`text` cut to what a close frame's reason holds (123 bytes of UTF-8)."""
    return text.encode()[:120].decode(errors="ignore")


def _peer(ws) -> str:
    addr = getattr(ws, "remote_address", None)
    return f"{addr[0]}:{addr[1]}" if addr else "?"


def _client(ws) -> str:
    addr = getattr(ws, "remote_address", None)
    return client_key(str(addr[0])) if addr else "?"


def client_key(host: str) -> str:
    """The address that the per-client caps count: an IPv4 address as it is (also when it arrives IPv4-mapped, on a
    server bound to `::`), and an IPv6 address's /64 network, since one host holds a whole /64 and may connect from
    any address in it. Loopback stays itself."""
    import ipaddress

    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if ip.version == 6:
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        if not ip.is_loopback:
            return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


def _is_loopback(address: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


async def _fail(ws, code: int, message: str) -> None:
    """The reason as a text frame (openpi's and RoboArena's clients raise it), then the close."""
    try:
        await ws.send(message)
        await ws.close(code, _close_reason(message))
    except Exception:
        pass


class ServerThread:
    """The server on a background thread (tests, notebooks): `with ServerThread(policy, token) as s: s.url`."""

    def __init__(self, policy: Policy, token: str | None, host: str = "127.0.0.1", port: int = 0,
                 limits: ServerLimits = ServerLimits(), ssl=None):
        self.server = PolicyServer(policy, TokenAuth(token) if token is not None else None, limits)
        self.host, self._port, self._bound, self._ssl = host, port, [], ssl
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._stop = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        asyncio.set_event_loop(self._loop)
        self._stop = asyncio.Event()
        try:
            self._loop.run_until_complete(self.server.serve(self.host, self._port, self._ready, self._stop,
                                                            self._bound, self._ssl))
        except BaseException as exc:
            self._error = exc
            self._ready.set()

    @property
    def port(self) -> int:
        return self._bound[0]

    @property
    def url(self) -> str:
        return f"{'wss' if self._ssl else 'ws'}://{self.host}:{self.port}"

    def __enter__(self):
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("policy server did not start within 30 s")
        if self._error is not None:
            raise self._error
        return self

    def __exit__(self, *exc):
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)


def tls_context(certfile: str | None, keyfile: str | None):
    if not certfile:
        if keyfile:
            raise ServeError("--keyfile needs --certfile")
        return None
    import ssl

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(certfile, keyfile)
    except (OSError, ssl.SSLError) as exc:
        raise ServeError(f"TLS: cannot load {certfile}{' / ' + keyfile if keyfile else ''}: {exc}") from None
    return ctx


def configure_logging() -> None:
    """Access log and server notices as plain timestamped lines on stdout."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%Y-%m-%dT%H:%M:%S"))
    for name in ("dzmodel.serve", "dzmodel.serve.ws"):
        lg = logging.getLogger(name)
        lg.handlers[:] = [handler]
        lg.setLevel(logging.INFO)
        lg.propagate = False


def serve_bundle(bundle: str, token: str | None, host: str = "127.0.0.1", port: int = 8000, device: str = "cpu",
                 limits: ServerLimits = ServerLimits(), solver=None, certfile: str | None = None,
                 keyfile: str | None = None, compile: bool | None = None, trust: str | None = None,
                 manifest_sha256: str | None = None, precision: str = "bf16") -> None:
    """Load, verify and serve a bundle; token None means no auth (the caller asked for it explicitly).
    compile: torch.compile the DiT block (default on CUDA); the GPU path is warmed up before the port opens.
    trust: an ed25519 public key file; the bundle must carry its valid MANIFEST.sig (default: DZ_TRUST_KEY).
    manifest_sha256: the MANIFEST's digest a registry pinned (checked again as the files are read).
    precision: "fp8" serves the DiT blocks' linears in FP8 where the GPU has it (else bf16, with a log line)."""
    import shutil
    import tempfile

    import torch

    from ..policy.policy import PolicyLoadError, load_policy
    from .package import load_package

    ssl = tls_context(certfile, keyfile)
    auth = TokenAuth(token) if token is not None else None
    # the bundle is verified by copying it into a private folder, and the model is built from that copy: what is
    # served is what was verified, even if a file of the bundle (or of the bundle cache) is replaced meanwhile
    private = tempfile.mkdtemp(prefix="dz-serve-")
    try:
        pkg = load_package(bundle, trust=trust, manifest_sha256=manifest_sha256, copy_to=private)
        embodied = load_policy(pkg.model_dir, device=device, solver=solver, precision=precision,
                               self_contained=True)
    except PolicyLoadError as exc:
        raise ServeError(str(exc).replace(str(pkg.root), bundle)) from None
    finally:
        shutil.rmtree(private, ignore_errors=True)
    robot, derived = served_robot(pkg.robot, embodied)
    policy = BundlePolicy(embodied, safety=ActionSafety.from_robot(robot))
    configure_logging()
    if derived:
        log.info(f"safety: {pkg.root.name} was packaged without its Franka's joint limits; serving with the "
                 f"{derived}'s published limits")
    if policy.embodied.precision_note:
        log.warning(policy.embodied.precision_note)
    elif policy.embodied.precision == "fp8":
        log.info("precision: the DiT blocks' linears in FP8 (e4m3 weights and activations), the rest bf16")
    if torch.device(device).type == "cuda":
        policy.embodied.policy.set_compile(True if compile is None else compile)
        warm_up(policy.embodied, limits.max_batch)
    log.info(f"heap frozen: {freeze_heap()} objects the garbage collector no longer scans during requests")
    scheme = "wss" if ssl else "ws"
    if auth is None:
        log.warning("WARNING: --no-auth: anyone who can reach this port can drive the robot through this policy. "
                    "Bind to localhost or a private network, or put it behind an authenticating proxy.")
    log.info(f"serving {pkg.root.name} ({policy.metadata['embodiment']}, step {policy.metadata['step']}, actions "
             f"{policy.metadata['action_horizon']}x{policy.metadata['action_dim']}) on {scheme}://{host}:{port}; "
             f"health: http{'s' if ssl else ''}://{host}:{port}/healthz")
    log.info(f"safety: {policy.safety.describe()}")
    log.info(f"clients send {sorted(policy.spec.images)} + {sorted(policy.spec.state)} + prompt"
             + (f"; RoboArena handshake {policy.handshake}" if policy.spec.roboarena else ""))
    server = PolicyServer(policy, auth, limits)
    log.info(f"limits: camera frames up to {server.request_limits.max_image_pixels:,} pixels (--max-image-pixels), "
             f"requests up to {server.frame_limits.max_bytes / 2**20:.1f} MiB, {limits.max_connections} "
             f"connections ({limits.max_connections_per_client} per client address), idle timeout "
             f"{f'{limits.idle_timeout_s:g} s' if limits.idle_timeout_s else 'off'}")
    log.info(f"batching: up to {limits.max_batch} sessions a forward, {limits.batch_window_ms:g} ms window"
             if limits.max_batch > 1 else "batching: off, one request at a time (--max-batch N to solve the "
                                          "requests of several robots together)")
    run_server(server, host, port, ssl)


def served_robot(robot, embodied):
    """(the robot whose limits `dz serve` enforces, the robot named if its limits were derived here, else None):
    a Franka bundle packaged before bundles carried a Franka's joint limits gets them from its embodiment now."""
    from . import franka
    from .package import PackageError, RobotConfig

    if not isinstance(robot, RobotConfig) or robot.action_space is not None or robot.joint_min is not None:
        return robot, None
    try:
        described = robot.for_embodiment(embodied.embodiment, embodied.action_dim)
    except PackageError as exc:
        raise ServeError(str(exc)) from None
    return described, franka.ROBOT_NAME if described.action_min is not None else None


def freeze_heap() -> int:
    """After loading and warm-up, before the first request: move every object alive now (the model, its encoders,
    torch's own) into the collector's permanent generation (`gc.freeze`), so that a full collection during a
    request scans only what came after. A 5B policy's process holds about 300,000 objects; one full collection of
    them took about 150 ms on a 2-core CPU, a pause inside whichever request it lands in. Returns how many."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def warm_up(embodied, max_batch: int = 1) -> None:
    """Chunks on blank frames before serving, one batch of each size the server can form (batches are padded to
    powers of two): the first chunk of an episode, at each batch size, has its CUDA graphs captured (and the block
    compiled) here, not during a robot's request. Later chunks of an episode, whose caches hold more frames, are
    captured the first time their shape comes. A batch that does not fit in the device's memory fails here, with
    the fix in the message."""
    emb = embodied.embodiment
    t0 = time.perf_counter()
    views = {name: np.zeros((*emb.view_size, 3), np.uint8) for name in emb.views}
    state = np.zeros(sum(embodied.state_dims.values()))
    sizes = [1 << i for i in range((max_batch - 1).bit_length() + 1)]
    for size in sizes:
        sids = [f"warm-up-{i}" for i in range(size)]
        try:
            embodied.predict_batch([(sid, views, state, "warm up") for sid in sids])
        except Exception as exc:
            if "out of memory" in str(exc).lower() and size > 1:
                raise ServeError(f"a batch of {size} sessions does not fit in the device's memory ({exc}); "
                                 f"lower --max-batch to {size // 2}") from None
            raise
        finally:
            for sid in sids:
                embodied.end_session(sid)
    log.info(f"warmed up in {time.perf_counter() - t0:.1f} s (CUDA graphs captured for batches of "
             f"{', '.join(map(str, sizes))}{'; block compiled' if embodied.policy.compile else ''})")


def run_server(server: PolicyServer, host: str, port: int, ssl=None) -> None:
    """Serve until interrupted; a port in use or an unknown host is one ServeError line."""
    try:
        asyncio.run(server.serve(host, port, ssl=ssl))
    except OSError as exc:
        raise ServeError(f"cannot listen on {host}:{port}: {exc.strerror or exc} "
                         "(another server on that port? pick --port)") from None
    except KeyboardInterrupt:
        log.info("stopped")
