"""The stand-in phone itself: `StandIn` (listening, connections, services, faults) and the CLI verb.

`StandIn` listens on a loopback port, hands each TCP connection to the transport (`_Conn`), answers
each OPENed service (shell: and exec: by its `Shell`, sync: by its `Sync`, root: and unroot: itself)
and runs the faults (disconnect timer, revive, full_disk flag file, unauthorized / offline by
dropping the connections). `serve` runs one until Ctrl-C; `main` is `specprefetch device standin`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import posixpath
import shutil
import signal
import socket
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Self

from toolkit.device.standin.phone import DEVICE, MODEL, PRODUCT, Faults, _set_system_modes, populate
from toolkit.device.standin.shell import _SAFE_ROOT_RE, Shell
from toolkit.device.standin.sync import Sync
from toolkit.device.standin.transport import EMULATOR_PORTS, FEATURES, _Conn, _Stream
from toolkit.errors import SpecPrefetchError

log = logging.getLogger(__name__)


class StandIn:
    """A stand-in SM8750 phone on loopback for the real adb server (package docstring for the details).

        with StandIn() as phone:              # or StandIn(root=..., port=..., faults=..., root_user=...)
            adb connect phone.serial           # "127.0.0.1:PORT"
    """

    def __init__(self, root: Path | str | None = None, port: int = 0,
                 faults: Faults | Mapping[str, Any] | None = None, root_user: bool = False,
                 host: str = "127.0.0.1", props: Mapping[str, str] | None = None) -> None:
        self._root = Path(tempfile.mkdtemp(prefix="spx-phone-")) if root is None else Path(root).resolve()
        # a temporary root goes at stop(), or at exit / garbage collection if stop() is never called
        self._drop_root = weakref.finalize(self, shutil.rmtree, self._root, True) if root is None else None
        if not _SAFE_ROOT_RE.match(str(self._root)):
            raise SpecPrefetchError(f"stand-in device root {self._root}: the path must have no spaces or "
                                    "shell characters (device paths are rewritten into it textually)")
        if not 0 <= port <= 65535:
            raise SpecPrefetchError(f"stand-in port {port}: must be 0 (any free port) to 65535")
        self._host, self._port = host, port
        self._faults = Faults.of(faults)
        self.root_user = root_user
        self._extra_props = dict(props or {})
        self._aux: Path | None = None
        self._listener: socket.socket | None = None
        self._conns: set[_Conn] = set()
        self._lock = threading.RLock()
        self._timers: list[threading.Timer] = []
        self._gone = False
        self._started = False
        self.history: list[str] = []  # every service the server opened, in order (for tests)
        self._shell = Shell(self, on_command=self._arm_disconnect)
        self._sync = Sync(self)

    # --- public API ---------------------------------------------------------------------------
    @property
    def root(self) -> Path:
        """The host directory that is the device's "/"."""
        return self._root

    @property
    def port(self) -> int:
        return self._port

    @property
    def serial(self) -> str:
        """What adb calls this device once connected: "127.0.0.1:PORT"."""
        return f"{self._host}:{self._port}"

    @property
    def faults(self) -> Faults:
        return self._faults

    @property
    def gone(self) -> bool:
        """True after a disconnect fault fired, until revive()."""
        return self._gone

    def host_path(self, device_path: str) -> Path:
        """The host file behind a device path (for the sync service, every path lives in the root)."""
        norm = posixpath.normpath(posixpath.join("/", device_path))
        return Path(str(self._root) + ("" if norm == "/" else norm))

    def start(self) -> int:
        """Listen (daemon threads) and return the bound port."""
        if self._started:
            return self._port
        populate(self._root)
        _set_system_modes(self._root, writable=self.root_user)
        self._listen()
        self._aux = Path(tempfile.mkdtemp(prefix="spx-phone-aux-"))  # shims, props, fault flags
        self._drop_aux = weakref.finalize(self, shutil.rmtree, self._aux, True)
        self._write_shims()
        self._write_fault_flags()
        self._started = True
        log.info("stand-in phone listening on %s (root %s)", self.serial, self._root)
        return self._port

    def stop(self) -> None:
        """Stop listening, drop every connection, kill every command, remove what start() created."""
        with self._lock:
            self._started = False
            for t in self._timers:
                t.cancel()
            self._timers.clear()
            self._close_listener()
            conns = list(self._conns)
        for c in conns:
            c.drop()
        if self._aux is not None:
            self._drop_aux()
            self._aux = None
        if self._drop_root is not None:
            self._drop_root()  # its 0444 files sit in 0755 dirs: rmtree removes them

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def set_faults(self, faults: Faults | Mapping[str, Any] | None = None, **changes: Any) -> Faults:
        """Switch faults at run time: a whole Faults (or dict), and/or single fields as keywords."""
        new = (Faults.of(faults) if faults is not None else self._faults).replace(**changes)
        with self._lock:
            old, self._faults = self._faults, new
            conns = list(self._conns) if (old.unauthorized, old.offline) != (new.unauthorized, new.offline) else []
        self._write_fault_flags()
        for c in conns:  # the server reconnects (after 250 ms) and meets the new state
            c.drop()
        return new

    def revive(self) -> None:
        """After a disconnect fault: listen again on the same port (the server retries every 10 s)."""
        with self._lock:
            if not self._gone or not self._started:
                return
            self._listen()
            self._gone = False

    def banner(self) -> str:
        return (f"device::ro.product.name={PRODUCT};ro.product.model={MODEL};ro.product.device={DEVICE};"
                f"features={','.join(FEATURES)}")

    # --- listening and connections --------------------------------------------------------------
    def _listen(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self._host, self._port))
        except OSError as e:
            sock.close()
            raise SpecPrefetchError(f"stand-in phone cannot listen on {self._host}:{self._port}: {e.strerror}") from e
        sock.listen(8)
        self._port = sock.getsockname()[1]
        self._listener = sock
        threading.Thread(target=self._accept_loop, args=(sock,), daemon=True, name="standin-accept").start()

    def _close_listener(self) -> None:
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
            self._listener = None

    def _accept_loop(self, sock: socket.socket) -> None:
        while True:
            try:
                client, _ = sock.accept()
            except OSError:
                return
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(self, client)
            with self._lock:
                if self._listener is not sock:
                    client.close()
                    return
                self._conns.add(conn)
            threading.Thread(target=conn.run, daemon=True, name="standin-conn").start()

    def _forget_conn(self, conn: _Conn) -> None:
        with self._lock:
            self._conns.discard(conn)

    def _disconnect_now(self) -> None:
        """The disconnect fault: the phone vanishes (connections cut, connection attempts refused)."""
        with self._lock:
            if not self._started:
                return
            self._gone = True
            self._close_listener()
            conns = list(self._conns)
        log.info("stand-in phone %s: disconnect fault fired", self.serial)
        for c in conns:
            c.drop()

    def _arm_disconnect(self, command: str) -> None:
        f = self._faults
        if f.disconnect_after_s is None or f.disconnect_match not in command:
            return
        timer = threading.Timer(f.disconnect_after_s, self._disconnect_now)
        timer.daemon = True
        with self._lock:
            self._timers.append(timer)
        timer.start()

    # --- services -------------------------------------------------------------------------------
    def _service(self, service: str) -> Callable[[_Stream], None] | None:
        """The handler for an OPENed service, or None to refuse it."""
        with self._lock:
            self.history.append(service)
        head, sep, rest = service.partition(":")
        if not sep:
            return None
        name, *args = head.split(",")
        if name == "shell":
            protocol = "v2" in args
            kind = "pty" if "pty" in args else "raw" if "raw" in args else ("pty" if not rest else "raw")
            term = next((a[5:] for a in args if a.startswith("TERM=")), "dumb")
            return lambda s: self._shell.serve(s, rest, protocol=protocol, pty_mode=kind == "pty", term=term)
        if name == "exec" and not args:
            return lambda s: self._shell.serve(s, rest, protocol=False, pty_mode=False, term="dumb")
        if name == "sync" and not args:
            return self._sync.serve
        if name in ("root", "unroot") and not args:
            return lambda s: self._root_service(s, name)
        return None

    def _root_service(self, stream: _Stream, name: str) -> None:
        if name == "root":
            msg = "adbd is already running as root\n" if self.root_user else \
                "adbd cannot run as root in production builds\n"
        else:
            msg = "adbd not running as root\n" if not self.root_user else \
                "adbd cannot unroot: the stand-in phone runs as root (root_user=True)\n"
        stream.write(msg.encode())

    def rewrite(self, command: str) -> str:
        """The package docstring's rewrite rule: device paths in a command line -> host paths."""
        return self._shell.rewrite(command)

    # --- shell environment ------------------------------------------------------------------------
    def _write_shims(self) -> None:
        assert self._aux is not None
        self._shell.write_shims(self._aux, self._port, self._extra_props)

    def _write_fault_flags(self) -> None:
        """The shims read the faults they show (df: full_disk) from flag files."""
        if self._aux is None:
            return
        flag = self._aux / "full_disk"
        if self._faults.full_disk:
            flag.touch()
        else:
            flag.unlink(missing_ok=True)


# --- the CLI verb ---------------------------------------------------------------------------------
def serve(port: int = 0, root: Path | str | None = None, faults: Faults | Mapping[str, Any] | None = None,
          root_user: bool = False, on_ready: Callable[[StandIn], None] | None = None,
          props: Mapping[str, str] | None = None) -> None:
    """Run a stand-in phone until Ctrl-C (or SIGTERM), then clean up what it started."""
    def stop(_signum: int, _frame: object) -> None:
        raise KeyboardInterrupt
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, stop) if main_thread else None
    try:
        with StandIn(root=root, port=port, faults=faults, root_user=root_user, props=props) as phone:
            if on_ready is not None:
                on_ready(phone)
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


def main(port: int, root: Path | str | None, faults: Mapping[str, Any], root_user: bool,
         props: Mapping[str, str] | None = None) -> None:
    """`specprefetch device standin`: print the `adb connect` line to use, then serve until Ctrl-C."""
    if EMULATOR_PORTS[0] <= port <= EMULATOR_PORTS[1]:
        raise SpecPrefetchError(f"--port {port}: adb looks for emulators on {EMULATOR_PORTS[0]}-{EMULATOR_PORTS[1]} "
                                "(the stand-in would also be listed as emulator-5554); choose a port outside it, "
                                "e.g. 15555, or 0 for any free one")
    checked = Faults.of(faults)

    def ready(phone: StandIn) -> None:
        on = [k for k, v in dataclasses.asdict(checked).items() if v not in (None, False, "")]
        print(f"stand-in SM8750 phone ready: adb connect {phone.serial}  (device root {phone.root}"
              f"{'; root' if root_user else ''}{'; faults: ' + ', '.join(on) if on else ''}; Ctrl-C stops)",
              flush=True)
    serve(port, root, checked, root_user, on_ready=ready, props=props)

