"""A private adb server on a free port, for tests and the demo (never the user's 5037).

`adb_server()` starts one (`adb -P PORT start-server`, isolated from USB, mDNS and emulators by
default) and kills it at exit; `AdbServer.adb(...)` runs the real adb client against it.
`free_port` and `_port_open` are its loopback port helpers.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from toolkit.errors import SpecPrefetchError


@dataclasses.dataclass
class AdbServer:
    """A private adb server: `.adb(...)` runs the real adb client against it."""
    port: int
    env: dict[str, str]
    adb_path: str
    log_path: Path

    def adb(self, *args: str, check: bool = True, timeout: float = 30.0,
            input: str | None = None) -> subprocess.CompletedProcess[str]:
        """Run `adb -P PORT ARGS...`; with check, a non-zero exit raises SpecPrefetchError."""
        cmd = [self.adb_path, "-P", str(self.port), *args]
        try:
            r = subprocess.run(cmd, check=False, env=self.env, input=input, capture_output=True, text=True,
                               errors="replace", timeout=timeout,
                               stdin=subprocess.DEVNULL if input is None else None)
        except subprocess.TimeoutExpired as e:
            raise SpecPrefetchError(f"adb {' '.join(args)} did not finish in {timeout:g} s") from e
        if check and r.returncode != 0:
            lines = [ln for ln in (r.stderr + r.stdout).splitlines() if ln.strip()]
            raise SpecPrefetchError(f"adb {' '.join(args)} failed (exit {r.returncode}): "
                                    f"{lines[-1] if lines else 'no output'}")
        return r

    def devices(self) -> dict[str, str]:
        """serial -> state ("device", "offline", "unauthorized", ...) as `adb devices` lists them."""
        out = self.adb("devices").stdout
        rows = (ln.split("\t") for ln in out.splitlines()[1:] if "\t" in ln)
        return {serial: state for serial, state in rows}

    def connect(self, serial: str, state: str = "device", timeout: float = 10.0) -> str:
        """`adb connect SERIAL`, then wait until adb lists it in `state`; returns what connect printed."""
        out = self.adb("connect", serial, timeout=timeout + 5).stdout.strip()
        deadline = time.monotonic() + timeout
        while (now := self.devices().get(serial)) != state:
            if time.monotonic() > deadline:
                raise SpecPrefetchError(f"{serial} is {now or 'not listed'} after {timeout:g} s, not {state} "
                                        f"(adb connect said: {out})")
            time.sleep(0.05)
        return out


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


@contextlib.contextmanager
def adb_server(port: int | None = None, *, isolated: bool = True) -> Iterator[AdbServer]:
    """Start a private adb server (`adb -P PORT start-server`) on a free port and kill it at exit.

    isolated (default): a private HOME (its own adb key) and TMPDIR, no USB, mDNS or emulator
    scanning (ADB_USB=0, ADB_MDNS=0, ADB_EMU=0), so it never competes with the user's server for a
    phone plugged in over USB. ANDROID_SERIAL is removed from the environment.
    """
    adb = shutil.which("adb")
    if adb is None:
        raise SpecPrefetchError("adb not found on PATH: install it (apt-get install adb, or Android platform-tools)")
    port = port or free_port()
    if _port_open(port):
        raise SpecPrefetchError(f"port {port} is already in use; cannot start a private adb server there")
    tmp = Path(tempfile.mkdtemp(prefix="spx-adb-"))
    env = {k: v for k, v in os.environ.items()
           if k not in ("ANDROID_SERIAL", "ADB_SERVER_SOCKET", "ANDROID_ADB_SERVER_ADDRESS", "ADB_TRACE")}
    env.update(ANDROID_ADB_SERVER_PORT=str(port), ANDROID_ADB_LOG_PATH=str(tmp / "adb.log"))
    if isolated:
        (tmp / "home").mkdir()
        env.update(HOME=str(tmp / "home"), TMPDIR=str(tmp), ADB_USB="0", ADB_MDNS="0", ADB_EMU="0")
    server = AdbServer(port=port, env=env, adb_path=adb, log_path=tmp / "adb.log")
    try:
        # the server forks away from start-server; give it files, not pipes, for its output
        with open(tmp / "start.out", "w") as out:
            r = subprocess.run([adb, "-P", str(port), "start-server"], check=False, env=env,
                               stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, timeout=30)
        if r.returncode != 0:
            text = (tmp / "start.out").read_text(errors="replace").strip().splitlines()
            raise SpecPrefetchError(f"adb start-server on port {port} failed: {text[-1] if text else r.returncode}")
        yield server
    finally:
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            subprocess.run([adb, "-P", str(port), "kill-server"], check=False, env=env, stdin=subprocess.DEVNULL,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=10)
        deadline = time.monotonic() + 5
        while _port_open(port) and time.monotonic() < deadline:
            time.sleep(0.05)
        shutil.rmtree(tmp, ignore_errors=True)
