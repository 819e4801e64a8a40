"""The stand-in's shell: the shell: and exec: services, run with the host's /bin/sh in the device root.

`Shell` starts a command for a stream (`_Proc`, through a pty or pipes), pumps its output to the
stream (`_pump`; as shell v2 packets with `v2`) and the stream's input to it (stdin, close-stdin,
window size), and applies the package docstring's rewrite rule to the command line (`_MAPPED` and
the regexes; `_LineRewriter` for a script piped in). It also writes the shims put first on the
shell's PATH (getprop, taskset, uname, mount, df, id, whoami, nproc, su) and the props file, and
makes the environment its commands get.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import platform
import re
import shutil
import signal
import struct
import subprocess
import sys
import termios
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from toolkit.device.standin.phone import default_props
from toolkit.device.standin.transport import _Closed, _Stream


# shell protocol packet ids (shell_protocol.h)
SH_STDIN, SH_STDOUT, SH_STDERR, SH_EXIT, SH_CLOSE_STDIN, SH_WINSIZE = range(6)
_SH_HEADER = struct.Struct("<BI")

# --- shims put first on the shell's PATH ------------------------------------------------------
_SHIM_GETPROP = r"""#!/bin/sh
# getprop stand-in: the device's properties, from $SPX_STANDIN_AUX/props (key=value lines)
f="$SPX_STANDIN_AUX/props"
case "$1" in -*) shift;; esac
if [ $# -eq 0 ]; then
  exec awk '{i=index($0,"="); printf "[%s]: [%s]\n", substr($0,1,i-1), substr($0,i+1)}' "$f"
fi
exec awk -v k="$1" -v d="$2" 'BEGIN{v=d} {i=index($0,"="); if (substr($0,1,i-1)==k) v=substr($0,i+1)} END{print v}' "$f"
"""
_SHIM_TASKSET = r"""#!/bin/sh
# taskset stand-in: the phone has 8 CPUs, the host may have fewer; accept the mask, run unpinned
p=0
while :; do
  case "$1" in
    -a|--all-tasks) shift;;
    -p|--pid|-ap|-pa) p=1; shift;;
    *) break;;
  esac
done
if [ $p = 1 ]; then
  if [ $# -ge 2 ]; then echo "pid $2's current affinity mask: ff"; echo "pid $2's new affinity mask: $1"
  else echo "pid $1's current affinity mask: ff"; fi
  exit 0
fi
if [ $# -lt 2 ]; then echo "usage: taskset [-ap] [mask] [PID | cmd [args...]]" >&2; exit 1; fi
shift
exec "$@"
"""
_SHIM_UNAME = r"""#!/bin/sh
# uname stand-in: the phone's kernel and machine
s=Linux; n=localhost; r=6.6.30-android15-8-gspxstandin; v="#1 SMP PREEMPT Wed Jan 1 00:00:00 UTC 2025"; m=aarch64
[ $# -eq 0 ] && { echo $s; exit 0; }
o=""
for a in "$@"; do
  case "$a" in
    -a|--all) echo "$s $n $r $v $m"; exit 0;;
    -s) o="$o $s";; -n) o="$o $n";; -r) o="$o $r";; -v) o="$o $v";; -m|-p|-i) o="$o $m";; -o) o="$o Toybox";;
    *) echo "uname: unknown option $a" >&2; exit 1;;
  esac
done
echo ${o# }
"""
_SHIM_MOUNT = r"""#!/bin/sh
# mount stand-in: list the device's mounts; mounting is not possible here
if [ $# -eq 0 ]; then exec awk '{printf "%s on %s type %s (%s)\n", $1, $2, $3, $4}' "$SPX_STANDIN_ROOT/proc/mounts"; fi
echo "mount: the stand-in phone cannot mount" >&2; exit 1
"""
_SHIM_DF = r'''#!{python} -S
"""df stand-in: the host's numbers for the mapped path, shown as the device's mount; /data full under full_disk."""
import os, sys
root = os.environ["SPX_STANDIN_ROOT"]
full = os.path.exists(os.path.join(os.environ["SPX_STANDIN_AUX"], "full_disk"))
mounts = [l.split()[:2] for l in open(os.path.join(root, "proc/mounts")) if l.strip()]
human = any(a.startswith("-") and "h" in a for a in sys.argv[1:])
paths = [a for a in sys.argv[1:] if not a.startswith("-")] or ["/", "/data"]
def size(kb):
    if not human: return str(kb)
    for unit in "KMGT":
        if kb < 1024 or unit == "T": return f"{{kb:.1f}}{{unit}}" if kb < 10 and unit != "K" else f"{{kb:.0f}}{{unit}}"
        kb /= 1024
rows, rc = [], 0
for p in paths:
    dev_path = p[len(root):] or "/" if p == root or p.startswith(root + "/") else p
    host = root + dev_path if dev_path.startswith("/") else os.path.join(root, dev_path)
    if not os.path.exists(host):
        print(f"df: {{p}}: No such file or directory", file=sys.stderr); rc = 1; continue
    best = max((m for m in mounts if dev_path == m[1] or dev_path.startswith(m[1].rstrip("/") + "/")),
               key=lambda m: len(m[1]))
    st = os.statvfs(host)
    total = st.f_blocks * st.f_frsize // 1024
    avail = st.f_bavail * st.f_frsize // 1024
    used = total - st.f_bfree * st.f_frsize // 1024
    if full and best[1] == "/data":
        avail, used = 0, total
    pct = f"{{(100 * used + total - 1) // total if total else 0}}%"
    rows.append((best[0], size(total), size(used), size(avail), pct, best[1]))
head = ("Filesystem", "Size" if human else "1K-blocks", "Used", "Avail" if human else "Available", "Use%", "Mounted on")
w = [max(len(r[i]) for r in [head, *rows]) for i in range(5)]
for r in [head, *rows]:
    print(f"{{r[0]:<{{w[0]}}}} {{r[1]:>{{w[1]}}}} {{r[2]:>{{w[2]}}}} {{r[3]:>{{w[3]}}}} {{r[4]:>{{w[4]}}}} {{r[5]}}")
sys.exit(rc)
'''


def _shim_id(uid: int) -> str:
    name = "root" if uid == 0 else "shell"
    groups = ("0(root)" if uid == 0 else
              "2000(shell),1004(input),1007(log),1011(adb),1015(sdcard_rw),1028(sdcard_r),1078(ext_data_rw),"
              "1079(ext_obb_rw),3001(net_bt_admin),3002(net_bt),3003(inet),3006(net_bw_stats),3009(readproc),"
              "3011(uhid),3012(readtracefs)")
    context = "u:r:su:s0" if uid == 0 else "u:r:shell:s0"
    return (f"#!/bin/sh\n# id stand-in: the adb shell user of the phone\n"
            f'case "$1" in\n  -u|-g) echo {uid};;\n  -un|-nu|-gn|-ng|-n) echo {name};;\n'
            f'  -G) echo "{" ".join(g.split("(")[0] for g in groups.split(","))}";;\n'
            f'  *) echo "uid={uid}({name}) gid={uid}({name}) groups={groups} context={context}";;\nesac\n')


_SHIM_SU_ROOT = r"""#!/bin/sh
# su stand-in (root_user): the shell already runs as root; run the command
case "$1" in root|0) shift;; esac
if [ "$1" = "-c" ]; then shift; exec /bin/sh -c "$*"; fi
[ $# -eq 0 ] && exec /bin/sh
exec "$@"
"""
_SHIM_SU_ABSENT = """#!/bin/sh
# su stand-in: a phone that is not rooted has no su
echo "/system/bin/sh: su: inaccessible or not found" >&2
exit 127
"""

# device path prefixes the shell rewrite maps into the root (device path -> path inside the root)
_MAPPED = {p: p for p in ("/data", "/sdcard", "/storage", "/sys/devices/system/cpu", "/sys/class/thermal",
                          "/proc/mounts", "/proc/meminfo", "/proc/cpuinfo", "/proc/sys/vm/drop_caches")}
_MAPPED["/proc/self/mounts"] = "/proc/mounts"
_PATH_RE = re.compile(r"(?<![\w./~$-])(" + "|".join(re.escape(p) for p in sorted(_MAPPED, key=len, reverse=True))
                      + r")(?![\w.-])((?:/[^\s;&|<>()'\"`$\\]*)?)")
# a quoted, space-padded path is a text pattern (`mount | grep ' /data '`), not a path: left alone
_PADDED_RE = re.compile(r"""(['"]) /[^\s'"]* \1""")
_SYSTEM_BIN_RE = re.compile(r"(?<![\w./~$-])/system/bin/(?=[\w.+-])")
# text that ends in command position: the next word is a program to start
_CMD_POS_RE = re.compile(r"(?:^|[;&|(`\n{]|\$\(|\b(?:exec|then|do|else|time|nohup|env|taskset(?:\s+-a)?\s+\S+))"
                         r"\s*(?:\w+=\S*\s+)*$")
_SAFE_ROOT_RE = re.compile(r"^[\w./+@%,:=-]+$")


class _Proc:
    """A shell command running for a stream: its process group is killed when the stream closes."""

    def __init__(self, popen: subprocess.Popen[bytes], master_fd: int | None) -> None:
        self.popen, self.master_fd = popen, master_fd
        self._users = 2  # the output pumps and the input thread share the pty master
        self._lock = threading.Lock()

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)

    def exit_code(self) -> int:
        """As adbd reports it: the exit status, or 128 + the signal that ended the command."""
        rc = self.popen.wait()
        return 128 - rc if rc < 0 else rc & 0xFF

    def release(self, files: tuple[Any, ...]) -> None:
        """A thread is done with `files` (and with the pty master: closed when both threads are)."""
        for f in files:
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()
        with self._lock:
            self._users -= 1
            last = self._users == 0
        if last and self.master_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.master_fd)


def _pump(read: Callable[[], bytes], emit: Callable[[bytes], None]) -> None:
    """Copy what a process writes to the stream until EOF (or until the stream is closed)."""
    while True:
        try:
            data = read()
        except OSError:  # EIO from a pty master once the child is gone
            return
        if not data:
            return
        try:
            emit(data)
        except _Closed:
            return


class _LineRewriter:
    """For a shell started with no command: rewrite device paths in the script on its stdin, by line."""

    def __init__(self, rewrite: Callable[[str], str]) -> None:
        self.rewrite, self.pending = rewrite, b""

    def feed(self, data: bytes) -> bytes:
        """The complete lines so far, rewritten; a partial last line waits for its newline."""
        self.pending += data
        cut = self.pending.rfind(b"\n") + 1
        done, self.pending = self.pending[:cut], self.pending[cut:]
        return self._apply(done) if done else b""

    def flush(self) -> bytes:
        out, self.pending = self._apply(self.pending), b""
        return out

    def _apply(self, data: bytes) -> bytes:
        return self.rewrite(data.decode("utf-8", "surrogateescape")).encode("utf-8", "surrogateescape")


class _Phone(Protocol):
    """What the shell needs of the phone it runs on (a StandIn)."""

    root_user: bool

    @property
    def root(self) -> Path: ...


class Shell:
    """The shell: and exec: services of one phone (`on_command(command)` as each command starts)."""

    def __init__(self, phone: _Phone, on_command: Callable[[str], None]) -> None:
        self._phone, self._on_command = phone, on_command
        self._env: dict[str, str] = {}

    def rewrite(self, command: str) -> str:
        """The package docstring's rewrite rule: device paths in a command line -> host paths."""
        root = str(self._phone.root)
        command = _SYSTEM_BIN_RE.sub("", command)
        patterns = [m.span() for m in _PADDED_RE.finditer(command)]

        def sub(m: re.Match[str]) -> str:
            if any(a <= m.start() < b for a, b in patterns):
                return m.group(0)
            host = root + _MAPPED[m.group(1)] + m.group(2)
            if _CMD_POS_RE.search(m.string, 0, m.start()) and _is_device_script(host):
                return "sh " + host
            return host
        return _PATH_RE.sub(sub, command)

    def _spawn(self, command: str, pty_mode: bool, term: str, merge_stderr: bool) -> _Proc:
        argv = ["/bin/sh", "-c", self.rewrite(command)] if command else ["/bin/sh"] + (["-i"] if pty_mode else [])
        if os.geteuid() == 0 and not self._phone.root_user and shutil.which("setpriv"):
            # a root host user ignores file modes; without CAP_DAC_OVERRIDE the 0444 files refuse writes
            argv = ["setpriv", "--bounding-set", "-dac_override", *argv]
        env = dict(self._env, TERM=term)
        master: int | None = None
        if pty_mode:
            master, slave = os.openpty()
            # setsid -c: a new session with the pty as its controlling terminal, as adbd gives
            setsid = ["setsid", "-c"] if shutil.which("setsid") else []
            try:
                popen = subprocess.Popen([*setsid, *argv], stdin=slave, stdout=slave, stderr=slave,
                                         cwd=self._phone.root, env=env, start_new_session=not setsid)
            finally:
                os.close(slave)
        else:
            popen = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
                                     cwd=self._phone.root, env=env, start_new_session=True, bufsize=0)
        return _Proc(popen, master)

    def serve(self, stream: _Stream, command: str, *, protocol: bool, pty_mode: bool, term: str) -> None:
        """shell: and exec: services; with `protocol`, the shell v2 packets."""
        try:
            proc = self._spawn(command, pty_mode, term, merge_stderr=not protocol)
        except OSError as e:
            msg = f"/system/bin/sh: cannot start: {e.strerror}\n".encode()
            if protocol:
                stream.write(_SH_HEADER.pack(SH_STDERR, len(msg)) + msg + _SH_HEADER.pack(SH_EXIT, 1) + b"\x7f")
            else:
                stream.write(msg)
            return
        stream.on_close(proc.kill)
        self._on_command(command)
        write_lock = threading.Lock()

        def emit(kind: int) -> Callable[[bytes], None]:
            def send(data: bytes) -> None:
                with write_lock:  # a packet must not interleave with another
                    stream.write(_SH_HEADER.pack(kind, len(data)) + data if protocol else data)
            return send

        popen, master = proc.popen, proc.master_fd
        if master is not None:
            readers = [threading.Thread(target=_pump, args=(lambda: os.read(master, 65536), emit(SH_STDOUT)))]
        else:
            assert popen.stdout is not None
            out_fd = popen.stdout.fileno()
            readers = [threading.Thread(target=_pump, args=(lambda: os.read(out_fd, 65536), emit(SH_STDOUT)))]
            if popen.stderr is not None:
                err_fd = popen.stderr.fileno()
                readers.append(threading.Thread(target=_pump, args=(lambda: os.read(err_fd, 65536), emit(SH_STDERR))))
        for t in readers:
            t.daemon = True
            t.start()
        threading.Thread(target=self._input, args=(stream, proc, protocol, not command),
                         daemon=True).start()
        for t in readers:
            t.join()
        code = proc.exit_code()
        proc.release((popen.stdout, popen.stderr))
        if protocol:
            with contextlib.suppress(_Closed):
                emit(SH_EXIT)(bytes([code]))

    def _input(self, stream: _Stream, proc: _Proc, protocol: bool, script_on_stdin: bool) -> None:
        """What the server writes to a shell stream: stdin bytes (raw) or shell v2 packets."""
        master = proc.master_fd
        rewriter = _LineRewriter(self.rewrite) if script_on_stdin and master is None else None
        stdin = proc.popen.stdin

        def write_all(data: bytes) -> None:
            view = memoryview(data)
            try:
                fd = master if master is not None else stdin.fileno() if stdin is not None else None
                while fd is not None and view:
                    view = view[os.write(fd, view):]
            except (OSError, ValueError):
                pass  # the command stopped reading, or its stdin is closed

        def to_stdin(data: bytes) -> None:
            write_all(rewriter.feed(data) if rewriter is not None else data)

        def close_stdin() -> None:
            if rewriter is not None:
                write_all(rewriter.flush())
            if master is None and stdin is not None:
                with contextlib.suppress(OSError):
                    stdin.close()

        while True:
            if not protocol:
                data = stream.read_some()
                if not data:
                    break
                to_stdin(data)
                continue
            header = stream.read_exact(_SH_HEADER.size)
            if header is None:
                break
            kind, length = _SH_HEADER.unpack(header)
            payload = stream.read_exact(length) if length else b""
            if payload is None:
                break
            if kind == SH_STDIN:
                to_stdin(payload)
            elif kind == SH_CLOSE_STDIN:
                close_stdin()
            elif kind == SH_WINSIZE and master is not None:
                _set_winsize(master, payload)
        # the stream is closed: its on_close already killed the command
        proc.release((stdin,))

    def write_shims(self, aux: Path, port: int, extra_props: dict[str, str]) -> None:
        """The shims and the props file (ro.serialno from `port`) into `aux`, and the environment of the commands."""
        bin_dir = aux / "bin"
        bin_dir.mkdir()
        root_user = self._phone.root_user
        uid = 0 if root_user else 2000
        shims = {"getprop": _SHIM_GETPROP, "taskset": _SHIM_TASKSET, "uname": _SHIM_UNAME, "mount": _SHIM_MOUNT,
                 "df": _SHIM_DF.format(python=sys.executable), "id": _shim_id(uid),
                 "whoami": f"#!/bin/sh\necho {'root' if uid == 0 else 'shell'}\n",
                 "nproc": "#!/bin/sh\n# nproc stand-in: the phone's 8 CPUs\necho 8\n",
                 "su": _SHIM_SU_ROOT if root_user else _SHIM_SU_ABSENT}
        for name, text in shims.items():
            (bin_dir / name).write_text(text)
            (bin_dir / name).chmod(0o755)
        props = default_props(f"spx-standin-{port}", root_user) | extra_props
        (aux / "props").write_text("".join(f"{k}={v}\n" for k, v in sorted(props.items())))
        machine = platform.machine().lower()
        # arm64 binaries need qemu on another host; a stand-in reporting x86_64 runs this machine's own
        native = machine in ("aarch64", "arm64") or props.get("ro.product.cpu.abi", "").startswith("x86")
        emulator = "" if native else (shutil.which("qemu-aarch64") or "")
        root = str(self._phone.root)
        self._env = {
            "PATH": f"{bin_dir}:{os.environ.get('PATH') or '/usr/local/bin:/usr/bin:/bin'}",
            "HOME": root, "TMPDIR": root + "/data/local/tmp", "ANDROID_DATA": root + "/data",
            "ANDROID_ROOT": "/system", "EXTERNAL_STORAGE": root + "/sdcard", "HOSTNAME": "localhost",
            "USER": "root" if root_user else "shell", "LOGNAME": "root" if root_user else "shell",
            "SHELL": "/bin/sh", "LANG": "C.UTF-8", "SPX_EMULATOR": emulator,
            "SPX_STANDIN_ROOT": root, "SPX_STANDIN_AUX": str(aux),
        }


def _is_device_script(host: str) -> bool:
    """A file whose interpreter is the phone's (#!/system/bin/...), which the host cannot start itself."""
    try:
        with open(host, "rb") as fh:
            return fh.read(14) == b"#!/system/bin/"
    except OSError:
        return False


def _set_winsize(fd: int, payload: bytes) -> None:
    """Window-size packet text: "ROWSxCOLS,XPIXELSxYPIXELS"."""
    m = re.match(rb"(\d+)x(\d+),(\d+)x(\d+)", payload)
    if m:
        rows, cols, xp, yp = (int(g) for g in m.groups())
        with contextlib.suppress(OSError):
            fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, xp, yp))

