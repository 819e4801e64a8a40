"""The stand-in's adb transport: the device side of AOSP adb/protocol.txt over one TCP connection.

Packet constants and headers, `_Conn` (a connection's reader thread: CNXN / AUTH / OPEN / OKAY /
WRTE / CLSE, and the unauthorized and offline faults), `_Stream` (one OPENed service, with adb's
flow control) and `_run_service` (a service's thread). Which service an OPEN gets is up to the
device the connection serves (`StandIn._service`).
"""
from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import threading
from collections import deque
from collections.abc import Callable
from typing import Protocol

from toolkit.device.standin.phone import Faults

log = logging.getLogger(__name__)

# --- transport constants (adb.h, protocol.txt) -------------------------------------------------
A_SYNC, A_CNXN, A_AUTH = 0x434E5953, 0x4E584E43, 0x48545541
A_OPEN, A_OKAY, A_CLSE, A_WRTE = 0x4E45504F, 0x59414B4F, 0x45534C43, 0x45545257
A_VERSION = 0x01000001            # also A_VERSION_SKIP_CHECKSUM
MAX_PAYLOAD = 256 * 1024          # what we offer; the server offers 1 MiB, the smaller wins
MAX_PAYLOAD_V1 = 4096
AUTH_TOKEN, AUTH_SIGNATURE, AUTH_RSAPUBLICKEY = 1, 2, 3
_HEADER = struct.Struct("<6I")

FEATURES = ("shell_v2", "stat_v2", "ls_v2", "fixed_push_mkdir")
EMULATOR_PORTS = (5555, 5585)  # an adb server probes these at start for emulators (`device standin` refuses them)


class _Device(Protocol):
    """What a connection needs of the phone it serves (a StandIn)."""

    @property
    def faults(self) -> Faults: ...
    def banner(self) -> str: ...
    def _service(self, service: str) -> Callable[[_Stream], None] | None: ...
    def _forget_conn(self, conn: _Conn) -> None: ...


class _Closed(Exception):
    """The stream or its connection is gone."""


class _Stream:
    """One adb stream (a service the server OPENed) on a connection, with adb's flow control."""

    def __init__(self, conn: _Conn, local_id: int, remote_id: int) -> None:
        self.conn, self.local_id, self.remote_id = conn, local_id, remote_id
        self._cv = threading.Condition()
        self._inbox: deque[bytes] = deque()
        self._buf = bytearray()
        self._can_write = True
        self._closed = False
        self._on_close: list[Callable[[], None]] = []

    # called from the connection's reader thread
    def feed(self, data: bytes) -> None:
        with self._cv:
            if not self._closed:
                self._inbox.append(data)
                self._cv.notify_all()

    def okay(self) -> None:
        with self._cv:
            self._can_write = True
            self._cv.notify_all()

    def remote_closed(self) -> None:
        """The server closed the stream (or the connection died): no CLSE back."""
        self._finish(send_close=False)

    # called from the service's threads
    def on_close(self, fn: Callable[[], None]) -> None:
        with self._cv:
            if not self._closed:
                self._on_close.append(fn)
                return
        fn()

    @property
    def closed(self) -> bool:
        return self._closed

    def read_some(self) -> bytes:
        """The next chunk the server wrote (b"" once closed); acknowledging it lets the server send more."""
        with self._cv:
            while not self._inbox and not self._closed:
                self._cv.wait()
            if not self._inbox:
                return b""
            chunk = self._inbox.popleft()
        with contextlib.suppress(_Closed):
            self.conn.send(A_OKAY, self.local_id, self.remote_id)
        return chunk

    def read_exact(self, n: int) -> bytes | None:
        while len(self._buf) < n:
            chunk = self.read_some()
            if not chunk:
                return None
            self._buf += chunk
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    def write(self, data: bytes | bytearray) -> None:
        """Send `data` as WRTEs of at most the agreed payload, each after the previous one's OKAY."""
        view = memoryview(data)
        step = self.conn.max_out
        for off in range(0, len(view), step):
            with self._cv:
                while not self._can_write and not self._closed:
                    self._cv.wait()
                if self._closed:
                    raise _Closed()
                self._can_write = False
            self.conn.send(A_WRTE, self.local_id, self.remote_id, view[off:off + step])

    def close(self) -> None:
        """We are done: CLSE to the server."""
        self._finish(send_close=True)

    def _finish(self, send_close: bool) -> None:
        with self._cv:
            if self._closed:
                return
            self._closed = True
            callbacks, self._on_close = self._on_close, []
            self._cv.notify_all()
        self.conn.forget(self.local_id)
        if send_close:
            with contextlib.suppress(_Closed):
                self.conn.send(A_CLSE, self.local_id, self.remote_id)
        for fn in callbacks:
            try:
                fn()
            except Exception:  # a cleanup failing must not stop the others
                log.exception("stand-in: stream cleanup failed")


class _Conn:
    """One TCP connection from the adb server: a reader thread dispatching packets to streams."""

    def __init__(self, standin: _Device, sock: socket.socket) -> None:
        self.standin, self.sock = standin, sock
        self.max_out = MAX_PAYLOAD_V1
        self.version = 0
        self._send_lock = threading.Lock()
        self._streams: dict[int, _Stream] = {}
        self._lock = threading.Lock()
        self._next_id = 1
        self._dead = False

    def send(self, command: int, arg0: int, arg1: int, data: bytes | memoryview = b"") -> None:
        check = 0 if self.version >= A_VERSION else sum(bytes(data)) & 0xFFFFFFFF
        header = _HEADER.pack(command, arg0, arg1, len(data), check, command ^ 0xFFFFFFFF)
        try:
            with self._send_lock:
                if self._dead:
                    raise _Closed()
                self.sock.sendall(header)
                if len(data):
                    self.sock.sendall(data)
        except OSError as e:
            self.drop()
            raise _Closed() from e

    def forget(self, local_id: int) -> None:
        with self._lock:
            self._streams.pop(local_id, None)

    def drop(self) -> None:
        """Cut the TCP connection (the reader thread then ends every stream)."""
        self._dead = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def _recv_exact(self, n: int) -> bytes:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            r = self.sock.recv_into(view[got:])
            if r == 0:
                raise ConnectionError("closed by the adb server")
            got += r
        return bytes(buf)

    def run(self) -> None:
        try:
            while not self._dead:
                command, arg0, arg1, length, _check, magic = _HEADER.unpack(self._recv_exact(_HEADER.size))
                if magic != command ^ 0xFFFFFFFF or length > max(MAX_PAYLOAD, MAX_PAYLOAD_V1):
                    log.warning("stand-in: bad packet header from the adb server; dropping the connection")
                    break
                payload = self._recv_exact(length) if length else b""
                self._dispatch(command, arg0, arg1, payload)
        except (OSError, ConnectionError, _Closed):
            pass
        finally:
            self._dead = True
            with contextlib.suppress(OSError):
                self.sock.close()
            with self._lock:
                streams, self._streams = list(self._streams.values()), {}
            for s in streams:
                s.remote_closed()
            self.standin._forget_conn(self)

    def _dispatch(self, command: int, arg0: int, arg1: int, payload: bytes) -> None:
        faults = self.standin.faults
        if command == A_CNXN:
            if faults.offline:
                return  # never answered: the server lists the device as offline
            self.version = min(arg0, A_VERSION)
            self.max_out = min(MAX_PAYLOAD, arg1) if arg1 else MAX_PAYLOAD_V1
            if faults.unauthorized:
                self.send(A_AUTH, AUTH_TOKEN, 0, os.urandom(20))
                return
            with self._lock:  # a second CNXN restarts the session
                streams, self._streams = list(self._streams.values()), {}
            for s in streams:
                s.remote_closed()
            self.send(A_CNXN, A_VERSION, self.max_out, self.standin.banner().encode())
        elif command == A_AUTH:
            # the server signs our token with each of its keys, then offers its public key; a
            # device that is not authorized asks again for every signature and ignores the key
            if faults.unauthorized and arg0 == AUTH_SIGNATURE:
                self.send(A_AUTH, AUTH_TOKEN, 0, os.urandom(20))
        elif command == A_OPEN:
            service = payload.rstrip(b"\0").decode("utf-8", "surrogateescape")
            handler = self.standin._service(service) if arg0 and not arg1 else None
            if handler is None:
                self.send(A_CLSE, 0, arg0)
                return
            with self._lock:
                local_id, self._next_id = self._next_id, self._next_id + 1
                stream = _Stream(self, local_id, arg0)
                self._streams[local_id] = stream
            self.send(A_OKAY, local_id, arg0)
            threading.Thread(target=_run_service, args=(handler, stream), daemon=True,
                             name=f"standin-{service[:24]}").start()
        elif command in (A_OKAY, A_WRTE, A_CLSE):
            with self._lock:
                target = self._streams.get(arg1)
            if target is None or (target.remote_id != arg0 and command != A_CLSE):
                return
            if command == A_OKAY:
                target.okay()
            elif command == A_WRTE:
                target.feed(payload)
            else:
                target.remote_closed()
        else:
            log.debug("stand-in: ignoring packet %08x", command)


def _run_service(handler: Callable[[_Stream], None], stream: _Stream) -> None:
    try:
        handler(stream)
    except _Closed:
        pass
    except Exception:
        log.exception("stand-in: service failed")
    finally:
        stream.close()

