"""The adb client, as the toolkit uses it: the real `adb` program (Debian's `adb` package, or the
Android SDK's platform-tools), talking to the adb server on this machine, which talks to the phone.

Every failure a user meets is one `SpecPrefetchError` line: adb missing, no device, several
devices without --serial, a device unauthorized or offline, a device lost mid-command (`DeviceLost`).
The server port follows adb's own ANDROID_ADB_SERVER_PORT (the tests start a private server).
"""
from __future__ import annotations

import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from toolkit.errors import SpecPrefetchError

ADB_HINT = "apt-get install adb (make setup installs it), or put the Android SDK's platform-tools on PATH"
# what adb prints when the transport went away under a command
_LOST = ("device offline", "not found", "error: closed", "no devices/emulators found", "device still connecting",
         "connection reset", "broken pipe", "protocol fault")


_MARK = "__specprefetch_rc="


class DeviceLost(SpecPrefetchError):
    """The device went away (unplugged, rebooted, adb connection dropped) during a command."""


@dataclass
class Listed:
    serial: str
    state: str  # device, unauthorized, offline, ...
    attrs: dict[str, str] = field(default_factory=dict)  # product, model, device, transport_id


def adb_path() -> str:
    exe = shutil.which("adb")
    if not exe:
        raise SpecPrefetchError(f"adb not found: {ADB_HINT}")
    return exe


def _run(args: list[str], *, timeout: float | None, input: bytes | None = None) -> subprocess.CompletedProcess:
    try:  # never the caller's stdin: `adb shell` would forward it to the device (and stop a background job)
        return subprocess.run([adb_path(), *args], capture_output=True, timeout=timeout, input=input,
                              stdin=None if input is not None else subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise SpecPrefetchError(f"adb {' '.join(args[:3])}: no answer in {timeout:.0f} s") from None


def devices() -> list[Listed]:
    """`adb devices -l`: every device the server knows, whatever its state."""
    r = _run(["devices", "-l"], timeout=60)
    if r.returncode != 0:
        raise SpecPrefetchError(f"adb devices failed: {r.stderr.decode(errors='replace').strip()[:200]}")
    out = []
    for line in r.stdout.decode(errors="replace").splitlines():
        line = line.strip()
        if not line or line.startswith(("List of devices", "*")):
            continue
        parts = line.split()
        if len(parts) < 2:
            continue
        attrs = dict(p.split(":", 1) for p in parts[2:] if ":" in p)
        out.append(Listed(parts[0], parts[1], attrs))
    return out


def _state_error(d: Listed) -> str:
    if d.state == "unauthorized":
        return (f"device {d.serial} is unauthorized: unlock the phone and accept the USB debugging prompt "
                "(or revoke the authorisations in Developer options and reconnect)")
    if d.state == "offline":
        return f"device {d.serial} is offline: reconnect it (adb reconnect) or restart adb (adb kill-server)"
    return f"device {d.serial} is {d.state}, not ready"


def choose(serial: str | None) -> "Adb":
    """The one device to use: `serial`, or the only attached one."""
    found = devices()
    if serial is not None:
        match = [d for d in found if d.serial == serial]
        if not match:
            listed = ", ".join(d.serial for d in found) or "none"
            raise SpecPrefetchError(f"--serial {serial}: no such device (attached: {listed})")
        d = match[0]
    else:
        if not found:
            raise SpecPrefetchError("no device attached (adb devices lists none): connect a phone with USB "
                                    "debugging on, or try the flow with `specprefetch device standin`")
        if len(found) > 1:
            raise SpecPrefetchError(f"several devices attached ({', '.join(d.serial for d in found)}): "
                                    "choose one with --serial")
        d = found[0]
    if d.state != "device":
        raise SpecPrefetchError(_state_error(d))
    return Adb(d.serial)


@dataclass
class Adb:
    """One device, by serial."""
    serial: str

    def _check_lost(self, r: subprocess.CompletedProcess, what: str) -> None:
        err = (r.stderr + b"\n" + r.stdout).decode(errors="replace").strip()
        if r.returncode != 0 and (any(s in err.lower() for s in _LOST) or self.state() != "device"):
            raise DeviceLost(f"device {self.serial} lost during {what} (now {self.state()})")

    def state(self) -> str:
        """adb's state for this serial now: device, offline, unauthorized, ... or gone."""
        for d in devices():
            if d.serial == self.serial:
                return d.state
        return "gone"

    def shell(self, cmd: str, *, timeout: float | None = 120, check: bool = True) -> subprocess.CompletedProcess:
        """Run `cmd` in the device's shell (shell protocol v2: its exit code and stderr come back).
        With check, a non-zero exit is an error naming the command. The command runs in a subshell
        followed by an end marker: adb clients before 34 exit 0 when the device vanishes mid-command
        (no exit packet came), so a missing marker, not the exit code, is what tells a lost device."""
        r = _run(["-s", self.serial, "shell", f"( {cmd}\n); echo {_MARK}$?"], timeout=timeout)
        out = r.stdout.decode(errors="replace")
        cut = out.rfind(_MARK)
        if cut < 0 or not out[cut + len(_MARK):].strip().isdigit():
            state = self.state()
            err = r.stderr.decode(errors="replace").strip().splitlines()
            if state == "device":  # the shell went away, the device did not
                raise SpecPrefetchError(f"on {self.serial}: `{cmd[:60]}` ended without finishing (adb exit "
                                        f"{r.returncode})" + (f": {err[-1]}" if err else ""))
            raise DeviceLost(f"device {self.serial} lost during `{cmd[:60]}` (now {state})"
                             + (f": {err[-1]}" if err else ""))
        rc = int(out[cut + len(_MARK):].strip())
        r = subprocess.CompletedProcess(r.args, rc, out[:cut].encode(), r.stderr)
        if check and r.returncode != 0:
            err = r.stderr.decode(errors="replace").strip().splitlines()
            raise SpecPrefetchError(f"on {self.serial}: `{cmd[:80]}` exited {r.returncode}"
                                    + (f": {err[-1]}" if err else ""))
        return r

    def text(self, cmd: str, **kw) -> str:
        return self.shell(cmd, **kw).stdout.decode(errors="replace")

    @staticmethod
    def _error_line(r: subprocess.CompletedProcess) -> str:
        """adb's own error line (older clients print push/pull errors on stdout, before a summary)."""
        lines = (r.stderr + b"\n" + r.stdout).decode(errors="replace").splitlines()
        errs = [ln.strip() for ln in lines if "error" in ln.lower() or "failed" in ln.lower()]
        return errs[0] if errs else (next((ln for ln in lines if ln.strip()), f"exit {r.returncode}"))

    def push(self, local: Path, remote: str, *, timeout: float | None = 1800) -> None:
        r = _run(["-s", self.serial, "push", str(local), remote], timeout=timeout)
        if r.returncode != 0:
            self._check_lost(r, f"push of {local}")
            msg = self._error_line(r)
            if "space" in msg.lower():
                raise SpecPrefetchError(f"push of {local} to {self.serial}:{remote}: no space left on the device "
                                        f"({msg})")
            raise SpecPrefetchError(f"push of {local} to {self.serial}:{remote} failed: {msg}")

    def pull(self, remote: str, local: Path, *, timeout: float | None = 600) -> None:
        r = _run(["-s", self.serial, "pull", remote, str(local)], timeout=timeout)
        if r.returncode != 0:
            self._check_lost(r, f"pull of {remote}")
            raise SpecPrefetchError(f"pull of {self.serial}:{remote} failed: {self._error_line(r)}")

    def getprop(self) -> dict[str, str]:
        props = {}
        for line in self.text("getprop").splitlines():
            if line.startswith("[") and "]: [" in line:
                k, v = line[1:].split("]: [", 1)
                props[k] = v.rstrip("]")
        return props

    def is_root(self) -> bool:
        return self.text("id -u", check=False).strip() == "0"


def q(s: str) -> str:
    """Quote for the device's shell (mksh/toybox on Android, sh on the stand-in)."""
    return shlex.quote(s)
