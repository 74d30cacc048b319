"""Scripted env pools for the eval and record loops (no simulator)."""


class Lockstep:
    """`EnvWorkerPool`'s submit/wait calls over a scripted pool that has only the lockstep ones (`reset`, `step`,
    `expert_step`): `wait()` runs what was submitted since the last `wait()`, in order, and returns every reply."""

    def _submitted(self) -> list:
        if not hasattr(self, "_queued"):
            self._queued = []
        return self._queued

    def submit_reset(self, *args):
        self._submitted().append(("reset", args))

    def submit_step(self, *args):
        self._submitted().append(("step", args))

    def submit_expert_step(self, *args):
        self._submitted().append(("expert_step", args))

    def wait(self) -> dict:
        out, queued = {}, self._submitted()
        self._queued = []
        for call, args in queued:
            out.update(getattr(self, call)(*args))
        return out


class Staggered(Lockstep):
    """Replies out of order, as from real workers: a reset's reply comes `reset_waits` calls of `wait()` after it
    was submitted, a step's `step_waits(worker)` calls later (1: at the next `wait()`); each `wait()` returns only
    the replies due by then. `log` lists (wait number, worker, call) per reply."""

    reset_waits = 4

    def step_waits(self, worker: int) -> int:
        return 1

    def wait(self) -> dict:
        """Like the real pool's: blocks (here: lets time pass) until some reply is due."""
        self.tick = getattr(self, "tick", 0) + 1
        self.log = getattr(self, "log", [])
        pending = getattr(self, "_due", [])
        for call, args in self._submitted():
            pending += [(self.tick - 1 + (self.reset_waits if call == "reset" else self.step_waits(w)), w, call, one)
                        for w, one in _per_worker(call, args)]
        self._queued = []
        while pending and min(p[0] for p in pending) > self.tick:
            self.tick += 1
        due = [p for p in pending if p[0] <= self.tick]
        self._due = [p for p in pending if p[0] > self.tick]
        out = {}
        for _, w, call, one in due:
            out.update(getattr(self, call)(*one))
            self.log.append((self.tick, w, call))
        return out


def _per_worker(call, args):
    """Split one submitted call into one call per addressed worker."""
    if call == "reset":
        assignments, *inits = args
        for entry in assignments:
            w = entry[0]
            yield w, ([entry], *({k: v for k, v in inits[0].items() if k == w} for _ in inits))
    elif call == "step":
        for w, action in args[0].items():
            yield w, ({w: action},)
    else:
        seeds, *options = args
        for w, seed in seeds.items():
            yield w, ({w: seed}, *({w: o[w]} if w in o else None for o in options))


def overlapping(log) -> int:
    """How many step replies came while another worker's reset was in flight (0 for a loop in lockstep)."""
    resets, last = [], {}
    for tick, w, call in log:
        if call == "reset":
            resets.append((w, last.get(w, 0), tick))  # in flight from after its previous reply until this one
        last[w] = tick
    return sum(1 for tick, w, call in log if call != "reset"
               for rw, start, end in resets if rw != w and start < tick < end)
