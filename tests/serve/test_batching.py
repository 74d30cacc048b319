"""Dynamic batching in `dz serve`: the batcher's rules (one request per session a batch, order within a session,
the window, no request dropped), and a batched server answering what a one-at-a-time server answers, through the
real openpi client against a tiny bundle."""

import asyncio
import json
import threading
import time
import urllib.request

import numpy as np
import pytest
from openpi_client.websocket_client_policy import WebsocketClientPolicy

from dzmodel.serve.batching import DynamicBatcher
from dzmodel.serve.client import PolicyClient, load_test, synthetic_observation
from dzmodel.serve.server import ServeError, ServerLimits, ServerThread, warm_up

from .helpers import served_policy
from .test_server import FakePolicy

TOKEN = "batching-token-1"


class Recorder:
    """A batched call that records each batch and answers each payload with its own tag."""

    def __init__(self, delay=0.0, fail_on=None):
        self.batches, self.delay, self.fail_on = [], delay, fail_on

    def __call__(self, payloads):
        self.batches.append(list(payloads))
        time.sleep(self.delay)
        return [ValueError(f"bad {p}") if p == self.fail_on else ("answer", p) for p in payloads]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_batches_never_mix_a_sessions_requests_and_keep_their_order():
    solve = Recorder(delay=0.01)

    async def main():
        batcher = DynamicBatcher(solve, max_batch=3, window_s=0.05, clients=lambda: 5)
        # 5 sessions, each with 4 requests queued at once, a session's together: they must go to 4 different batches
        tasks = [asyncio.create_task(batcher.submit(f"s{s}", (f"s{s}", k))) for s in range(5) for k in range(4)]
        answers = await asyncio.gather(*tasks)
        await batcher.close()
        return answers, batcher.stats

    answers, stats = run(main())
    assert [a.result for a in answers] == [("answer", (f"s{s}", k)) for s in range(5) for k in range(4)]
    assert sum(len(b) for b in solve.batches) == 20 and stats.requests == 20  # none dropped, none twice
    for batch in solve.batches:
        sessions = [s for s, _ in batch]
        assert len(sessions) == len(set(sessions)) and len(batch) <= 3
    for s in range(5):  # each session's requests are solved in the order they came
        order = [k for batch in solve.batches for sess, k in batch if sess == f"s{s}"]
        assert order == [0, 1, 2, 3]
    assert max(len(b) for b in solve.batches) == 3


def test_requests_that_arrive_within_the_window_share_a_forward():
    solve = Recorder()

    async def main():
        batcher = DynamicBatcher(solve, max_batch=8, window_s=0.5, clients=lambda: 4)
        tasks = []
        for s in range(4):  # 20 ms apart, well within the 500 ms window
            tasks.append(asyncio.create_task(batcher.submit(s, s)))
            await asyncio.sleep(0.02)
        answers = await asyncio.gather(*tasks)
        await batcher.close()
        return answers

    answers = run(main())
    assert solve.batches == [[0, 1, 2, 3]]  # all four clients sent: it went without waiting out the window
    assert {a.batch_size for a in answers} == {4}
    assert answers[0].queue_ms >= answers[3].queue_ms  # the first waited longest


def test_a_lone_session_never_waits_for_company():
    solve = Recorder()

    async def main():
        batcher = DynamicBatcher(solve, max_batch=8, window_s=60.0, clients=lambda: 1)
        t0 = time.perf_counter()
        answer = await asyncio.wait_for(batcher.submit("only", 1), 5)  # a 60 s wait would time out here
        await batcher.close()
        return answer, time.perf_counter() - t0

    answer, seconds = run(main())
    assert answer.result == ("answer", 1) and answer.batch_size == 1 and seconds < 5


def test_the_window_bounds_the_wait_for_clients_that_do_not_send():
    solve = Recorder()

    async def main():
        batcher = DynamicBatcher(solve, max_batch=8, window_s=0.2, clients=lambda: 3)
        t0 = time.perf_counter()
        answer = await batcher.submit("a", 1)  # two more clients are connected but silent
        await batcher.close()
        return answer, time.perf_counter() - t0

    answer, seconds = run(main())
    assert answer.batch_size == 1 and 0.15 <= seconds < 5


def test_errors_reach_their_own_request_and_a_failed_call_reaches_all():
    solve = Recorder(fail_on=2)

    async def main():
        batcher = DynamicBatcher(solve, max_batch=4, window_s=0.2, clients=lambda: 3)
        results = await asyncio.gather(*(batcher.submit(s, s) for s in range(3)), return_exceptions=True)
        broken = DynamicBatcher(lambda payloads: 1 / 0, max_batch=4, window_s=0.2, clients=lambda: 2)
        failed = await asyncio.gather(*(broken.submit(s, s) for s in range(2)), return_exceptions=True)
        short = DynamicBatcher(lambda payloads: payloads[:1], max_batch=4, window_s=0.2, clients=lambda: 2)
        unmatched = await asyncio.gather(*(short.submit(s, s) for s in range(2)), return_exceptions=True)
        for b in (batcher, broken, short):
            await b.close()
        return results, failed, unmatched

    results, failed, unmatched = run(main())
    assert results[0].result == ("answer", 0) and results[1].result == ("answer", 1)
    assert isinstance(results[2], ValueError) and str(results[2]) == "bad 2"
    assert all(isinstance(r, ZeroDivisionError) for r in failed)
    assert all(isinstance(r, RuntimeError) and "1 answers for 2 requests" in str(r) for r in unmatched)


def test_a_request_whose_client_left_is_not_solved_and_the_others_are():
    solve = Recorder()

    async def main():
        batcher = DynamicBatcher(solve, max_batch=4, window_s=0.3, clients=lambda: 4)  # so it waits
        gone = asyncio.create_task(batcher.submit("gone", "gone"))
        stay = [asyncio.create_task(batcher.submit(s, s)) for s in ("a", "b")]
        await asyncio.sleep(0.05)
        gone.cancel()
        answers = await asyncio.gather(*stay)
        await batcher.close()
        return answers

    answers = run(main())
    assert [a.result for a in answers] == [("answer", "a"), ("answer", "b")]
    assert all("gone" not in batch for batch in solve.batches)


def test_closing_fails_what_still_waits():
    async def main():
        batcher = DynamicBatcher(Recorder(), max_batch=4, window_s=30.0, clients=lambda: 4)
        pending = asyncio.create_task(batcher.submit("a", 1))
        await asyncio.sleep(0.05)
        await batcher.close()
        with pytest.raises(RuntimeError, match="shutting down"):
            await pending
        with pytest.raises(RuntimeError, match="closed"):
            await batcher.submit("b", 2)

    run(main())


@pytest.mark.parametrize("field, value, match", [
    ("max_batch", 0, "max_batch must be >= 1"),
    ("batch_window_ms", -1.0, "batch_window_ms must be a finite number of milliseconds"),
    ("batch_window_ms", float("nan"), "batch_window_ms must be a finite number of milliseconds"),
])
def test_bad_batching_limits_are_one_clear_error(field, value, match):
    with pytest.raises(ServeError, match=match):
        ServerLimits(**{field: value})


def _health(srv):
    with urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/healthz", timeout=10) as r:
        return json.loads(r.read())


def test_fifty_sessions_through_the_batcher_each_get_their_own_answer():
    """A policy without infer_batch (solved one by one inside each batch) that echoes each request's state: an
    answer routed to another session's client would not match what that client sent."""
    limits = ServerLimits(max_batch=8, batch_window_ms=20)
    wrong, errors = [], []

    def one(srv, i):
        try:
            rng = np.random.default_rng(i)
            with PolicyClient(srv.url, TOKEN) as c:
                for k in range(3):
                    obs = synthetic_observation(c.metadata, rng, (64, 64))
                    obs["observation/state"] = np.full(8, i + k / 10)
                    reply = c.infer(obs)
                    if not np.allclose(reply["actions"], i + k / 10):
                        wrong.append((i, k))
        except Exception as exc:
            errors.append(f"{i}: {type(exc).__name__}: {exc}")

    with ServerThread(FakePolicy(delay=0.002), TOKEN, limits=limits) as srv:
        threads = [threading.Thread(target=one, args=(srv, i)) for i in range(50)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        report = load_test(srv.url, TOKEN, sessions=8, requests_per_session=3, timeout_s=120)
        health = _health(srv)
    assert not errors and not wrong, (errors[:3], wrong[:3])
    assert report["errors"] == 0 and report["requests"] == 24 and report["requests_per_s"] > 0
    assert report["session_p95_ms"]["max"] >= report["session_p95_ms"]["median"] > 0
    assert health["batching"]["requests"] == 150 + 24 and health["batching"]["max_batch"] == 8
    assert health["batching"]["mean_size"] > 1  # concurrent sessions did share forwards


def _observation(rng, step):
    return {"observation/image": rng.integers(0, 255, (224, 224, 3), dtype=np.uint8),
            "observation/wrist_image": rng.integers(0, 255, (224, 224, 3), dtype=np.uint8),
            "observation/state": np.concatenate([[-0.2, 0.01 * step, 1.1], [3.1, 0.0, 0.1], [0.04, -0.04]]),
            "prompt": "pick up the black bowl and place it on the plate"}


def _episodes(port, clients, queries, together):
    """`clients` openpi clients, each one session of `queries` observations; with `together`, every client sends
    its k-th query at the same moment (a barrier), so a batching server can solve them in one forward."""
    barrier = threading.Barrier(clients)
    results, errors = {}, []

    def one(i):
        try:
            client = WebsocketClientPolicy("127.0.0.1", port, api_key=TOKEN)
            rng = np.random.default_rng(100 + i)
            out = []
            for k in range(queries):
                obs = _observation(rng, k)
                if together:
                    barrier.wait(timeout=60)
                reply = client.infer(obs)
                out.append((reply["actions"], reply["server_timing"]))
            results[i] = out
        except Exception as exc:  # reported below
            errors.append(f"client {i}: {type(exc).__name__}: {exc}")
            barrier.abort()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    if together:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    else:
        for t in threads:
            t.start()
            t.join(120)
    assert not errors, errors
    return results


def test_a_batched_server_answers_what_a_one_at_a_time_server_answers(libero_bundle):
    with ServerThread(served_policy(libero_bundle), TOKEN) as srv:
        sequential = _episodes(srv.port, clients=4, queries=3, together=False)
    limits = ServerLimits(max_batch=4, batch_window_ms=500)
    with ServerThread(served_policy(libero_bundle), TOKEN, limits=limits) as srv:
        batched = _episodes(srv.port, clients=4, queries=3, together=True)
        health = _health(srv)
    sizes = [timing["batch_size"] for out in batched.values() for _, timing in out]
    assert max(sizes) >= 2 and health["batching"]["requests"] == 12  # queries were solved together
    for i in range(4):
        for (a_seq, t_seq), (a_bat, _) in zip(sequential[i], batched[i]):
            assert "batch_size" not in t_seq and a_seq.shape == a_bat.shape == (16, 7)
            np.testing.assert_allclose(a_bat, a_seq, rtol=1e-4, atol=1e-5)
    # and the sessions differ from each other: an answer sent to the wrong client would show
    assert not np.allclose(batched[0][-1][0], batched[1][-1][0])


def test_warm_up_runs_each_batch_size_the_server_can_form(libero_bundle, monkeypatch):
    embodied = served_policy(libero_bundle).embodied
    sizes, real = [], embodied.predict_batch

    def recorded(requests):
        sizes.append(len(requests))
        return real(requests)

    monkeypatch.setattr(embodied, "predict_batch", recorded)
    warm_up(embodied, max_batch=3)  # batches are padded to powers of two: 3 sessions run as 4
    assert sizes == [1, 2, 4] and not embodied.policy.sessions  # the warm-up sessions are gone

    def out_of_memory(requests):
        if len(requests) == 4:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(requests)

    monkeypatch.setattr(embodied, "predict_batch", out_of_memory)
    with pytest.raises(ServeError, match="a batch of 4 sessions does not fit .* lower --max-batch to 2"):
        warm_up(embodied, max_batch=4)
    assert not embodied.policy.sessions


def test_a_client_that_leaves_ends_the_wait_for_it():
    solve, clients = Recorder(), [2]

    async def main():
        batcher = DynamicBatcher(solve, max_batch=8, window_s=60.0, clients=lambda: clients[0])
        pending = asyncio.create_task(batcher.submit("a", 1))
        await asyncio.sleep(0.05)
        clients[0] = 1  # the other robot disconnected
        batcher.wake()
        answer = await asyncio.wait_for(pending, 5)  # not the 60 s window
        await batcher.close()
        return answer

    assert run(main()).result == ("answer", 1)


def test_if_the_batcher_itself_stops_every_waiting_request_gets_the_error():
    class Fatal(BaseException):
        pass

    def solve(payloads):
        raise Fatal("out of the thread")

    async def main():
        batcher = DynamicBatcher(solve, max_batch=2, window_s=0.01, clients=lambda: 3)
        results = await asyncio.gather(*(batcher.submit(s, s) for s in range(3)), return_exceptions=True)
        return results

    results = run(main())
    assert all(isinstance(r, RuntimeError) and "the batcher stopped" in str(r) for r in results), results
