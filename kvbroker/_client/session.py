"""Session: request ids, replies matched to requests, errors turned into exceptions.

Every call the client makes funnels through :meth:`Session.request` (a round trip),
:meth:`Session.post` (one way) or :meth:`Session.submit` (pipelined), each taking the op's
arguments as one dict (``call``/``send_only`` are the same with keyword arguments); which calls
there are is :mod:`kvbroker._wire.ops`'s business (the session greets through
:meth:`Ops.hello`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from .framing import MessageStream
from .._wire.replies import Hello as HelloReply
from .ops import Ops
from .._wire.protocol import PROTOCOL_VERSION
from .._wire.frames import error_of, is_push
from ..errors import BrokerUnavailable, KVBrokerError, ProtocolError, Timeout

__all__ = ["Pending", "Session"]

log = logging.getLogger("kvbroker.client")


class Session:
    """One greeted connection; thread-safe: one call at a time waits for its reply, and
    one-way requests (:meth:`post`) go out meanwhile."""

    def __init__(self, stream: MessageStream, *, name: str = "", role: str = "") -> None:
        self._stream = stream
        self._next_id = 1
        self._lock = threading.Lock()  # one thread at a time waits for replies and reads them
        # Sends, and the ids they take: a one-way request (post) needs only this one, so a
        # release goes out while another thread waits in a blocking claim (the daemon serves
        # releases past a waiting claim: the op table's ``passes_a_wait``).
        self._send_lock = threading.Lock()
        self._pushes: deque[dict] = deque(maxlen=64)
        self._unanswered: set[int] = set()  # ids sent with send_only, replies not read yet
        self._abandoned: set[int] = set()  # of those, calls that timed out: close won't wait
        self._submitted: set[int] = set()  # ids sent with submit, their result not taken yet
        self._replies: dict[int, dict] = {}  # replies to those read while waiting for others
        self._dropped: list[int] = []  # ids of Pendings dropped unasked (appended lock-free)
        self.on_push: Callable[[dict], None] | None = None
        self.broken = False  # the connection failed: the client may replace this session
        self._stalled = False  # the last wait for a reply timed out: close does not drain
        self.hello: HelloReply = Ops(self.request, self.post).hello(PROTOCOL_VERSION, name, role)

    def after_fork(self) -> None:
        """In a forked child: the lock may be held by a thread the child does not have, and
        the connection is the parent's (its transport refuses the child). Broken, so the
        client connects again."""
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self.broken = True

    def call(self, op: str, **args: Any) -> Any:
        """:meth:`request` with the op's arguments as keywords."""
        return self.request(op, args)

    def request(self, op: str, args: dict[str, Any]) -> Any:
        """Send ``op`` with ``args`` and return its reply's result (raising the error a failed
        reply names). ``args`` is sent as given: not kept, not changed."""
        with self._lock:
            self._forget_dropped()
            rid = None
            try:
                rid = self._send(op, args)
                while True:
                    msg = self._stream.receive()
                    # its reply, the rule, goes straight through; anything else is sorted
                    if msg.__class__ is not dict or msg.get("id") != rid:
                        if not isinstance(msg, dict):
                            raise ProtocolError(f"unexpected message from the daemon: {msg!r:.80}")
                        if is_push(msg):
                            self._deliver(msg)
                            continue
                        if self._take_others(msg):
                            continue
                        if msg.get("id") not in (rid, None):
                            raise ProtocolError(
                                f"reply {msg.get('id')} does not answer request {rid}"
                            )
                    self._stalled = False
                    if msg.get("ok"):
                        return msg.get("result")
                    if msg.get("id") is None:  # the daemon's parting word: it hung up
                        self.broken = True
                    break
            except BrokerUnavailable:
                self.broken = True  # the transport failed, as opposed to a reply saying so
                raise
            except Timeout:
                # given up on, not forgotten: its reply, if the daemon still sends it, is read
                # and dropped by a later call instead of being taken for that call's own
                if rid is not None:
                    self._unanswered.add(rid)
                    self._abandoned.add(rid)
                self._stalled = True
                raise
        raise error_of(msg)

    def submit(self, op: str, args: dict[str, Any] | None = None, **kwargs: Any) -> Pending:
        """Send a request without waiting: its reply is read when :meth:`Pending.result`
        asks (or while another call waits), so a caller can keep several requests in the
        daemon's queue and work meanwhile. Errors are raised by ``result``. The arguments:
        one dict, or keywords."""
        if args is None:
            args = kwargs
        elif kwargs:
            raise TypeError("submit: the arguments as one dict or as keywords, not both")
        with self._lock:
            self._forget_dropped()
            try:
                rid = self._send(op, args)
            except BrokerUnavailable:
                self.broken = True
                raise
            self._submitted.add(rid)
            return Pending(self, rid)

    def _forget_dropped(self) -> None:
        """Requests whose Pending was dropped unasked: their replies are read (and a failure
        logged) like a send_only's, not kept. Under the lock: ``Pending.__del__`` cannot
        take it (it may run inside a locked call of this thread)."""
        while self._dropped:
            rid = self._dropped.pop()
            if rid in self._replies:
                self._unanswered.add(rid)
                self._settle(self._replies.pop(rid))
            elif rid in self._submitted:
                self._unanswered.add(rid)
            self._submitted.discard(rid)

    def result(self, rid: int) -> Any:
        """The reply to submitted request ``rid`` (its error raised)."""
        with self._lock:
            if rid not in self._submitted and rid not in self._replies:
                # its result was taken (or it was never submitted): nothing will come
                raise KVBrokerError(f"request {rid} has no reply left to wait for")
            try:
                while rid not in self._replies:
                    msg = self._stream.receive()
                    self._stalled = False
                    if not isinstance(msg, dict):
                        raise ProtocolError(f"unexpected message from the daemon: {msg!r:.80}")
                    if is_push(msg):
                        self._deliver(msg)
                    elif self._take_others(msg):
                        pass
                    elif msg.get("id") is None and msg.get("ok") is False:
                        raise error_of(msg)  # about the connection (a frame it could not read)
                    else:
                        raise ProtocolError(
                            f"reply {msg.get('id')} answers no request of this session"
                        )
            except BrokerUnavailable:
                self.broken = True
                raise
            except Timeout:
                self._stalled = True
                raise
            finally:
                if self.broken:
                    self._submitted.discard(rid)
            self._submitted.discard(rid)
            msg = self._replies.pop(rid)
        if msg.get("ok"):
            return msg.get("result")
        raise error_of(msg)

    def send_only(self, op: str, **args: Any) -> None:
        """:meth:`post` with the op's arguments as keywords."""
        self.post(op, args)

    def post(self, op: str, args: dict[str, Any]) -> None:
        """Send a request whose reply is read (and checked) by a later call, saving a round
        trip. Only for requests that cannot fail short of a daemon bug or a lost connection:
        a failure then is logged, not raised. It does not wait for a call in progress on
        another thread (its reply is read by whichever call reads next)."""
        try:
            self._send(op, args, unanswered=True)
        except BrokerUnavailable:
            self.broken = True
            raise

    @property
    def settled(self) -> bool:
        """Whether every request sent has been answered: a change sent without waiting
        (``send_only``, ``submit``) may not have taken effect yet, so a read elsewhere (a read
        replica) could miss it; this connection, answered in order, cannot."""
        return not (self._unanswered or self._submitted)

    def settimeout(self, timeout: float | None) -> None:
        """Seconds to wait for the daemon from now on (None: forever), e.g. for a claim that
        waits, or between the pushes of a watch."""
        self._stream.transport.settimeout(timeout)

    def _send(self, op: str, args: dict, unanswered: bool = False) -> int:
        """Send one request; returns its id. ``unanswered``: its reply is to be read by any
        call (a post): the id is registered before the request goes out, so a reader on
        another thread that gets the reply first knows it."""
        with self._send_lock:
            rid = self._next_id
            self._next_id += 1
            if unanswered:
                self._unanswered.add(rid)
            try:
                self._stream.send({"id": rid, "op": op, "args": args})
                return rid
            except BrokerUnavailable as exc:
                self.broken = True
                lost = exc
            except BaseException:  # not sent (unpackable, too large): no reply to wait for
                self._unanswered.discard(rid)
                raise
        # What the daemon said before it hung up is read under the reading lock, which a
        # request or submit holds already; a post reads it only if no call is reading.
        if not unanswered:
            self._raise_parting_error()
        elif self._lock.acquire(blocking=False):
            try:
                self._raise_parting_error()
            finally:
                self._lock.release()
        raise lost

    def _raise_parting_error(self) -> None:
        """The write failed: the daemon hung up. If it said why first (a connection refused
        for max_connections, a protocol error), raise that typed error rather than a broken
        pipe: the daemon may close before this request even went out (a client slow between
        connect and hello), yet its last message is still there to read."""
        try:
            self._stream.transport.settimeout(1.0)  # the daemon is gone: EOF comes at once
            while True:
                msg = self._stream.receive()
                if isinstance(msg, dict) and msg.get("id") is None and msg.get("ok") is False:
                    break
        except (KVBrokerError, OSError):  # OSError: another thread closed the socket
            return  # it said nothing more: the broken pipe stands
        raise error_of(msg)

    def _take_others(self, msg: dict) -> bool:
        """A reply that answers no one waiting now: to a ``send_only`` or abandoned request
        (settled: read, a failure logged) or to a submitted one (kept for its ``result()``).
        False for anything else."""
        rid = msg.get("id")
        if rid in self._unanswered:
            self._settle(msg)
            return True
        if rid in self._submitted:
            self._replies[rid] = msg
            return True
        return False

    def _settle(self, msg: dict) -> None:
        self._unanswered.discard(msg["id"])
        self._abandoned.discard(msg["id"])
        if not msg.get("ok"):
            err = msg.get("error") or {}
            log.warning(
                "request %s failed after the fact: %s: %s",
                msg["id"],
                err.get("code"),
                err.get("message"),
            )

    def next_push(self) -> dict:
        """Block until the daemon pushes a message (after ``watch``)."""
        with self._lock:
            if self._pushes:
                return self._pushes.popleft()
            while True:
                try:
                    msg = self._stream.receive()
                except BrokerUnavailable:
                    self.broken = True
                    raise
                if not isinstance(msg, dict):
                    continue
                if is_push(msg):
                    return msg
                if self._take_others(msg):
                    continue
                if not msg.get("ok", True):
                    raise error_of(msg)

    def _deliver(self, msg: dict) -> None:
        if self.on_push is not None:
            self.on_push(msg)
        else:
            self._pushes.append(msg)

    def close(self, drain_timeout: float = 5.0) -> None:
        """Close the connection, first reading the replies to ``send_only`` requests: a
        pipelined release has then taken effect in the daemon before ``close`` returns, so a
        consume-claim's freeing is visible to every other client afterwards. A daemon that
        does not answer within ``drain_timeout`` seconds is not waited for further."""
        # Not waiting on the lock: a thread blocked in a call (``next_push`` of a watcher) is
        # woken by the close instead, as before.
        if self._lock.acquire(blocking=False):
            try:
                if (self._unanswered - self._abandoned or self._submitted) and not (
                    self.broken or self._stalled
                ):
                    self._drain(drain_timeout)
            finally:
                self._lock.release()
        self._stream.close()

    def _drain(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout  # pushes (a watch) must not keep it waiting
        try:
            # submitted, never asked for: read now (kept submitted: a result asked for after
            # the close raises BrokerUnavailable, as the connection is gone)
            self._unanswered |= self._submitted
            while self._unanswered - self._abandoned:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no reply within {timeout:g} s")
                self._stream.transport.settimeout(left)
                msg = self._stream.receive()
                if isinstance(msg, dict) and msg.get("id") in self._unanswered:
                    self._settle(msg)
                elif is_push(msg):
                    self._deliver(msg)
        except Exception as exc:  # closing regardless: the daemon ends what is left
            log.debug("closing without the replies to %d requests: %s", len(self._unanswered), exc)


class Pending:
    """A request sent by :meth:`Session.submit`; :meth:`result` waits for its reply (asked
    again, it gives the same reply or raises the same error)."""

    __slots__ = ("_session", "_rid", "_outcome")

    def __init__(self, session: Session, rid: int) -> None:
        self._session, self._rid = session, rid
        self._outcome: tuple[bool, Any] | None = None

    def result(self) -> Any:
        if self._outcome is None:
            try:
                self._outcome = (True, self._session.result(self._rid))
            except Timeout:
                raise  # the reply may still come: asking again waits for it again
            except KVBrokerError as exc:
                self._outcome = (False, exc)
        ok, value = self._outcome
        if ok:
            return value
        raise value

    def __del__(self) -> None:
        if self._outcome is None:  # never answered: the session need not keep its reply
            self._session._dropped.append(self._rid)
