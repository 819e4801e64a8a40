"""The stand-in's sync: service (AOSP adb/SYNC.TXT, file_sync_protocol.h): adb push, pull, stat and ls.

`Sync.serve` answers STAT, STA2, LST2, LIST, LIS2, SEND (DATA..., DONE mtime; OKAY or FAIL "msg"),
RECV (DATA..., DONE) and QUIT on the phone's files (device path P is ROOT/P), refusing a non-root
user's writes outside the places an adb shell may write, and failing writes under full_disk.
"""
from __future__ import annotations

import contextlib
import errno as errno_mod
import os
import posixpath
import stat as stat_mod
import struct
from pathlib import Path
from typing import BinaryIO, Protocol

from toolkit.device.standin.phone import Faults
from toolkit.device.standin.transport import _Stream

# sync protocol (file_sync_protocol.h)
SYNC_DATA_MAX = 64 * 1024
_SYNC_REQ = struct.Struct("<4sI")
_STAT_V1 = struct.Struct("<4sIII")
_STAT_V2 = struct.Struct("<4sIQQIIIIQqqq")
_DENT_V1 = struct.Struct("<4sIIII")
_DENT_V2 = struct.Struct("<4sIQQIIIIQqqqI")
# where a non-root adb shell may write (for sync SEND)
_USER_WRITABLE = ("/data/local/tmp", "/sdcard", "/storage/emulated")


class _Phone(Protocol):
    """What the sync service needs of the phone it serves (a StandIn)."""

    root_user: bool

    @property
    def faults(self) -> Faults: ...
    def host_path(self, device_path: str) -> Path: ...


class Sync:
    """The sync: service of one phone."""

    def __init__(self, phone: _Phone) -> None:
        self._phone = phone

    def serve(self, stream: _Stream) -> None:
        """The sync: service: one request after another until QUIT, a failure or the stream's end."""
        while True:
            req = stream.read_exact(_SYNC_REQ.size)
            if req is None:
                return
            ident, length = _SYNC_REQ.unpack(req)
            if length > 1024:
                return self._sync_fail(stream, "path too long")
            raw = stream.read_exact(length) if length else b""
            if raw is None:
                return
            path = raw.decode("utf-8", "surrogateescape")
            if ident == b"STAT":
                stream.write(self._stat_v1(path))
            elif ident in (b"STA2", b"LST2"):
                stream.write(self._stat_v2(ident, path))
            elif ident in (b"LIST", b"LIS2"):
                stream.write(self._list(path, v2=ident == b"LIS2"))
            elif ident == b"SEND":
                if not self._send(stream, path):
                    return
            elif ident == b"RECV":
                if not self._recv(stream, path):
                    return
            elif ident == b"QUIT":
                return
            else:
                return self._sync_fail(stream, f"unknown command {int.from_bytes(ident, 'little'):08x}")

    @staticmethod
    def _sync_fail(stream: _Stream, message: str) -> None:
        data = message.encode()
        stream.write(b"FAIL" + struct.pack("<I", len(data)) + data)

    def _host_for_sync(self, path: str) -> str:
        host = str(self._phone.host_path(path))
        return host + "/" if path.endswith("/") and path != "/" else host

    def _stat_v1(self, path: str) -> bytes:
        try:
            st = os.lstat(self._host_for_sync(path))
        except OSError:
            return _STAT_V1.pack(b"STAT", 0, 0, 0)
        return _STAT_V1.pack(b"STAT", st.st_mode, st.st_size & 0xFFFFFFFF, int(st.st_mtime) & 0xFFFFFFFF)

    def _stat_v2(self, ident: bytes, path: str) -> bytes:
        try:
            fn = os.stat if ident == b"STA2" else os.lstat
            st = fn(self._host_for_sync(path))
        except OSError as e:
            return _STAT_V2.pack(ident, e.errno or errno_mod.EIO, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
        return _STAT_V2.pack(ident, 0, st.st_dev, st.st_ino, st.st_mode, st.st_nlink, st.st_uid, st.st_gid,
                             st.st_size, int(st.st_atime), int(st.st_mtime), int(st.st_ctime))

    def _list(self, path: str, v2: bool) -> bytes:
        host = self._phone.host_path(path)
        out = bytearray()
        try:
            names = [".", "..", *sorted(os.listdir(host))]
        except OSError:
            names = []
        for name in names:
            encoded = name.encode("utf-8", "surrogateescape")
            try:
                st = os.lstat(os.path.join(host, name))
            except OSError as e:
                if v2:
                    out += _DENT_V2.pack(b"DNT2", e.errno or errno_mod.EIO, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                         len(encoded)) + encoded
                continue
            if v2:
                out += _DENT_V2.pack(b"DNT2", 0, st.st_dev, st.st_ino, st.st_mode, st.st_nlink, st.st_uid,
                                     st.st_gid, st.st_size, int(st.st_atime), int(st.st_mtime),
                                     int(st.st_ctime), len(encoded)) + encoded
            else:
                out += _DENT_V1.pack(b"DENT", st.st_mode, st.st_size & 0xFFFFFFFF,
                                     int(st.st_mtime) & 0xFFFFFFFF, len(encoded)) + encoded
        done = _DENT_V2 if v2 else _DENT_V1
        out += b"DONE" + bytes(done.size - 4)
        return bytes(out)

    def _read_sync_data(self, stream: _Stream) -> tuple[bytes, int | bytes] | None:
        """The next DATA chunk or DONE of a SEND: (b"DATA", bytes) / (b"DONE", mtime); None at EOF."""
        head = stream.read_exact(8)
        if head is None:
            return None
        ident, n = _SYNC_REQ.unpack(head)
        if ident == b"DONE":
            return ident, n
        if ident != b"DATA" or n > SYNC_DATA_MAX:
            return ident, b""
        data = stream.read_exact(n) if n else b""
        return None if data is None else (ident, data)

    def _send(self, stream: _Stream, spec: str) -> bool:
        """SEND "path,mode": DATA chunks then DONE mtime; OKAY, or FAIL (then read to DONE and stop)."""
        path, comma, mode_text = spec.rpartition(",")
        if not comma:
            self._sync_fail(stream, "missing , in ID_SEND")
            return False
        try:
            mode = int(mode_text, 0)
        except ValueError:
            self._sync_fail(stream, "bad mode")
            return False
        host = self._phone.host_path(path)
        failure = self._send_refusal(path)
        if stat_mod.S_ISLNK(mode):
            return self._send_link(stream, host, failure)
        mode &= 0o777  # as adbd: user bits copied to group, then group to other (0644 -> 0666)
        mode |= (mode >> 3) & 0o070
        mode |= (mode >> 3) & 0o007
        done = False  # DONE read: nothing of this file is left to drain
        with contextlib.ExitStack() as stack:
            fh: BinaryIO | None = None
            if failure is None:
                try:
                    if host.is_file() or host.is_symlink():
                        host.unlink()
                    host.parent.mkdir(parents=True, exist_ok=True)
                    fh = stack.enter_context(open(host, "wb"))
                except OSError as e:
                    failure = f"couldn't create file: {e.strerror}"
            if fh is not None:
                outcome = self._store(stream, fh)
                if outcome is None:  # the stream ended mid-file
                    host.unlink(missing_ok=True)
                    return False
                if isinstance(outcome, str):
                    failure = outcome
                else:
                    done = True
                    try:
                        fh.close()
                        os.chmod(host, mode)
                        os.utime(host, (outcome, outcome))
                    except OSError as e:
                        failure = f"write failed: {e.strerror}"
                    else:
                        stream.write(b"OKAY" + bytes(4))
                        return True
        # as adbd: remove the partial file, report the failure, then drop the rest of the file up to DONE
        if fh is not None:
            host.unlink(missing_ok=True)
        self._sync_fail(stream, failure or "write failed")
        while not done and (item := self._read_sync_data(stream)) is not None and item[0] == b"DATA":
            pass
        return False

    def _store(self, stream: _Stream, fh: BinaryIO) -> int | str | None:
        """Write a SEND's DATA chunks to `fh`: the DONE mtime, a failure message, or None if the stream ended."""
        while True:
            item = self._read_sync_data(stream)
            if item is None:
                return None
            ident, value = item
            if ident == b"DONE":
                assert isinstance(value, int)
                return value
            if ident != b"DATA":
                return "invalid data message"
            assert isinstance(value, bytes)
            if value and self._phone.faults.full_disk:
                return f"write failed: {os.strerror(errno_mod.ENOSPC)}"
            try:
                fh.write(value)
            except OSError as e:
                return f"write failed: {e.strerror}"

    def _send_link(self, stream: _Stream, host: Path, failure: str | None) -> bool:
        target = b""
        while (item := self._read_sync_data(stream)) is not None and item[0] == b"DATA":
            assert isinstance(item[1], bytes)
            target += item[1]
        if item is None:
            return False
        if failure is None:
            try:
                if host.is_symlink() or host.is_file():
                    host.unlink()
                host.parent.mkdir(parents=True, exist_ok=True)
                os.symlink(target.rstrip(b"\0").decode("utf-8", "surrogateescape"), host)
            except OSError as e:
                failure = f"symlink failed: {e.strerror}"
        if failure is not None:
            self._sync_fail(stream, failure)
            return False
        stream.write(b"OKAY" + bytes(4))
        return True

    def _send_refusal(self, path: str) -> str | None:
        """Why a non-root adb shell user may not write `path` (None: it may)."""
        if self._phone.root_user:
            return None
        norm = posixpath.normpath(posixpath.join("/", path))
        if any(norm == p or norm.startswith(p + "/") for p in _USER_WRITABLE):
            return None
        return f"couldn't create file: {os.strerror(errno_mod.EACCES)}"

    def _recv(self, stream: _Stream, path: str) -> bool:
        """RECV path: DATA chunks (batched into full WRTEs), then DONE; or FAIL."""
        with contextlib.ExitStack() as stack:
            try:
                fh = stack.enter_context(open(self._phone.host_path(path), "rb"))
            except OSError as e:
                self._sync_fail(stream, f"open failed: {e.strerror}")
                return False
            batch = bytearray()
            while True:
                try:
                    chunk = fh.read(SYNC_DATA_MAX)
                except OSError as e:
                    stream.write(batch)
                    self._sync_fail(stream, f"read failed: {e.strerror}")
                    return False
                if not chunk:
                    break
                batch += b"DATA" + struct.pack("<I", len(chunk)) + chunk
                if len(batch) >= stream.conn.max_out:
                    stream.write(batch)
                    batch = bytearray()
            stream.write(batch + b"DONE" + bytes(4))
        return True
