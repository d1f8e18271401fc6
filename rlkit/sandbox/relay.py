"""Carry the lines between a sample's two sandboxes (`rlkit.sandbox.runners`): the tests' requests to
the candidate, the candidate's replies back, untouched. The driver reads only what the tests'
program says (its requests and verdicts); what the candidate sends is counted against its output
bound and passed on, never decoded here. One wall clock for both: at it, or past the bound, both
are killed and the verdicts sent so far stand."""

from __future__ import annotations

import json
import os
import select
import selectors
import subprocess
import time
from dataclasses import dataclass, field

from rlkit.sandbox import uids
from rlkit.sandbox.pipes import reap
from rlkit.sandbox.programs import Sandbox

READY = b'{"ready": true}'
_TESTS_BYTES = 64 << 20  # what the tests' own program may send (requests it builds from the test's data)


@dataclass
class Conversation:
    """How one sample's conversation ended: the tests' verdicts (``{"i", "ok"}`` records by index),
    and whether the candidate ran past the wall clock or its output bound."""

    verdicts: dict[int, dict] = field(default_factory=dict)
    timed_out: bool = False
    flooded: bool = False
    seconds: float = 0.0
    started: bool = True  # both programs said they were ready (else `said` holds why not)
    said: str = ""


class _Side:
    """One sandboxed program's pipes: what waits to be written to it, what it has sent so far."""

    def __init__(self, proc: subprocess.Popen, payload: bytes, sel: selectors.BaseSelector) -> None:
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        self.proc, self.sel = proc, sel
        self.pending = bytearray(payload)
        self.partial = bytearray()
        self.err = bytearray()
        self.got = 0
        self.ready = False
        self.refused = False  # its output ended, or began with something else, before it said it was ready
        self.closing = False  # close its stdin once what is pending is written
        os.set_blocking(proc.stdin.fileno(), False)
        sel.register(proc.stdout, selectors.EVENT_READ, (self, "out"))
        sel.register(proc.stderr, selectors.EVENT_READ, (self, "err"))
        sel.register(proc.stdin, selectors.EVENT_WRITE, (self, "in"))

    def queue(self, line: bytes) -> None:
        if self.proc.stdin.closed:
            return
        self.pending += line + b"\n"
        if not self._registered(self.proc.stdin):
            self.sel.register(self.proc.stdin, selectors.EVENT_WRITE, (self, "in"))

    def _registered(self, f: object) -> bool:
        try:
            self.sel.get_key(f)
            return True
        except KeyError:
            return False

    def write(self) -> None:
        stdin = self.proc.stdin
        try:
            n = os.write(stdin.fileno(), self.pending[:65536])
            del self.pending[:n]
        except OSError:  # it closed its stdin or ended: what it did not read is not wanted
            self.pending.clear()
            self.closing = True
        if not self.pending:
            self.sel.unregister(stdin)
            if self.closing:
                stdin.close()

    def close_input(self) -> None:
        self.closing = True
        if not self.pending and not self.proc.stdin.closed:
            if self._registered(self.proc.stdin):
                self.sel.unregister(self.proc.stdin)
            self.proc.stdin.close()

    def read(self) -> list[bytes] | None:
        """The complete lines it sent now; None at its end of output."""
        data = os.read(self.proc.stdout.fileno(), 65536)
        if not data:
            self.sel.unregister(self.proc.stdout)
            return None
        self.got += len(data)
        self.partial += data
        *lines, rest = self.partial.split(b"\n")
        self.partial = bytearray(rest)
        return [bytes(line) for line in lines]

    def read_err(self) -> None:
        data = os.read(self.proc.stderr.fileno(), 4096)
        if not data or len(self.err) > 4096:
            self.sel.unregister(self.proc.stderr)
        else:
            self.err += data

    def drain_err(self, until: float) -> None:
        """Its last words (bubblewrap's refusal) may still be on their way after its output closed."""
        err = self.proc.stderr
        while not err.closed and len(self.err) <= 4096 and (left := until - time.perf_counter()) > 0:
            if not select.select([err], [], [], left)[0]:
                return
            data = os.read(err.fileno(), 4096)
            if not data:
                return
            self.err += data

    def words(self) -> str:
        return self.err[:2048].decode("utf-8", "replace").strip().replace("\n", " | ")


def converse(box: Sandbox, tests: str, tests_payload: tuple[bytes, int | None], candidate: str,
             candidate_payload: tuple[bytes, int | None]) -> Conversation:
    """Run the tests' program and the candidate's, each in a sandbox of ``box``'s kind and limits, and
    relay between them until the tests' program has sent its verdicts (see the module doc)."""
    limit = box.limits.output_kb << 10
    t0 = time.perf_counter()
    deadline = t0 + box.limits.timeout_s
    spawned = []
    try:
        spawned.append(box.spawn(tests, tests_payload[1]))
        spawned.append(box.spawn(candidate, candidate_payload[1]))
        sel = selectors.DefaultSelector()
        t = _Side(spawned[0].proc, tests_payload[0], sel)
        c = _Side(spawned[1].proc, candidate_payload[0], sel)
        talk = Conversation()
        try:
            talk.timed_out, talk.flooded = _loop(sel, t, c, talk, deadline, limit)
        finally:
            sel.close()
        for side in (t, c):
            if not (talk.timed_out or talk.flooded) and (side.refused or (side is t and not t.ready)):
                side.drain_err(min(deadline, time.perf_counter() + 1.0))
    finally:
        for run in spawned:
            reap(run)
        if len(spawned) < 2:  # a program that never started: its claimed uid back (`spawn` gave back its own)
            uids.release(candidate_payload[1])
    talk.seconds = time.perf_counter() - t0
    if not (talk.timed_out or talk.flooded) and (not t.ready or c.refused):  # (the tests may be done before it spoke)
        talk.started = False
        talk.said = (c if t.ready else t).words()
    return talk


def _loop(sel: selectors.BaseSelector, t: _Side, c: _Side, talk: Conversation, deadline: float,
          limit: int) -> tuple[bool, bool]:
    """(timed out, flooded): the relay until the tests' program is done."""
    while (left := deadline - time.perf_counter()) > 0:
        for key, _ in sel.select(left):
            side, what = key.data
            if what == "in":
                side.write()
            elif what == "err":
                side.read_err()
            elif side is c:
                if not _from_candidate(c, t, limit):
                    return False, True
            elif _from_tests(t, c, talk):
                return False, False
    return True, False


def _from_candidate(c: _Side, t: _Side, limit: int) -> bool:
    """Pass what the candidate sent on to the tests' program, undecoded; False past its output bound."""
    lines = c.read()
    if lines is None:  # the candidate ended: the tests' next request gets no answer
        c.refused = not c.ready
        t.close_input()
        return True
    if c.got > limit:
        return False
    for line in lines:
        if c.ready:
            t.queue(line)
        else:
            c.ready = line == READY
            if not c.ready:  # bubblewrap's refusal, or a program that never started
                c.refused = True
                t.close_input()
    return True


def _from_tests(t: _Side, c: _Side, talk: Conversation) -> bool:
    """Keep the tests' verdicts, pass their requests on to the candidate; True once they are done."""
    lines = t.read()
    if lines is None or t.got > _TESTS_BYTES:
        return True
    for line in lines:
        rec = json.loads(line)
        if rec.get("ready") is True:
            t.ready = True
        elif rec.get("done") is True:
            return True
        elif type(rec.get("i")) is int:
            talk.verdicts.setdefault(rec["i"], rec)
        else:
            c.queue(line)
    return False
