"""A stand-in phone that the real adb server reaches over loopback (`adb connect 127.0.0.1:PORT`).

It speaks the device side of the adb transport (AOSP adb/protocol.txt): 24-byte little-endian
message headers (command, arg0, arg1, data_length, data_check, magic = command ^ 0xffffffff) and
CNXN / AUTH / OPEN / OKAY / WRTE / CLSE. Flow control is the one adb 29 uses: every WRTE we receive
is answered by an OKAY once its data has been consumed, and we send the next WRTE of a stream only
after the server's OKAY for the previous one. Checksums (a byte sum, not a CRC) are not checked on
receipt, as the server does not check them either; we send 0 once version 0x01000001 is agreed.

Services (device side, as adbd answers them):
- `shell[,v2][,raw|,pty][,TERM=..]:CMD`: with `v2` the shell protocol (packets of id byte + 4-byte
  LE length; 0 stdin, 1 stdout, 2 stderr, 3 exit, 4 close-stdin, 5 window size), so `adb shell`
  gets exit codes and a separate stderr; without it raw bytes, stderr merged into stdout.
- `exec:CMD`: raw, stderr merged (adb exec-out).
- `sync:`: STAT, STA2, LST2, LIST, LIS2, SEND (DATA..., DONE mtime; OKAY or FAIL "msg"), RECV
  (DATA..., DONE), QUIT (AOSP adb/SYNC.TXT, file_sync_protocol.h).
- `root:` / `unroot:`: the one-line answers of a user build (or of a rooted one with root_user).
Anything else is refused with CLSE(0, id), which adb prints as "error: closed".
The banner advertises only the features implemented here: shell_v2, stat_v2, ls_v2, fixed_push_mkdir.

The emulated phone is a directory, the device root: device path P lives at ROOT/P for the sync
service. ROOT holds a fake Snapdragon 8 Elite (SM8750) view, written when missing:
/sys/devices/system/cpu (cpu0-5 performance cluster, max 3532800 kHz; cpu6-7 prime cluster, max
4320000 kHz; cpuN/cpufreq links to cpufreq/policy0 and policy6 as on a phone), /sys/class/thermal
(aoss-0, cpu-*, cpuss-0, gpuss-0, ddr, skin-msm-therm, battery; millidegrees), /proc/mounts (/data is
f2fs with inlinecrypt), /proc/meminfo (a FAKE 12 GB phone, fixed numbers, MemAvailable present, not
the host's), /proc/cpuinfo (8 Oryon cores) and /proc/sys/vm/drop_caches (a plain file).

Shell commands run with the host's /bin/sh, cwd ROOT (device "/"). THE REWRITE RULE: the stand-in is
a test double and the commands the toolkit sends are known, so the command line (only it: not the
contents of scripts it starts, not environment values) is rewritten textually before it runs:
- a device absolute path starting with /data, /sdcard, /storage, /sys/devices/system/cpu,
  /sys/class/thermal, /proc/mounts, /proc/self/mounts, /proc/meminfo, /proc/cpuinfo or
  /proc/sys/vm/drop_caches becomes ROOT + path, when it is not part of a longer path or word
  (`/tmp/x/data` and `/database` are left alone);
- except in a quoted, space-padded pattern such as `grep ' /data '`, which is left as it is;
- `/system/bin/NAME` becomes `NAME`, found on PATH (so /system/bin/sh is the host's sh);
- a device script whose first line is `#!/system/bin/...`, in command position (`/data/.../run.sh`,
  `exec X`, `taskset MASK X`, after ; && || |), is started as `sh SCRIPT`;
- with no command (a script piped to `adb shell`), stdin is rewritten line by line; a pty session's
  keystrokes are not.
Shims come first on PATH: getprop (SM8750 properties), taskset (accepts the mask, runs unpinned:
the host may have fewer than 8 CPUs), nproc (8), uname (aarch64), id and whoami (uid 2000 shell, or
0 with root_user), su (absent unless root_user), mount (lists ROOT/proc/mounts) and df (the host's
numbers for the mapped path, shown as the device's mount; ~0 free on /data under full_disk). As on a
user build, without root_user /proc/sys/vm/drop_caches and the sys files cannot be written (when
the host user is root, the shell runs without CAP_DAC_OVERRIDE for that, through setpriv). The
environment has SPX_EMULATOR: the full path of qemu-aarch64 on a non-arm64 host, empty on an arm64
one or when the stand-in reports an x86 ABI (then pushed binaries are this machine's), so
`$SPX_EMULATOR ./arm64-binary` runs pushed binaries (no binfmt_misc).

Faults (constructor and `StandIn.set_faults`):
- disconnect_after_s (with disconnect_match, a substring of the shell command, "" = any): N seconds
  after a matching shell/exec command starts, every TCP connection is dropped and the listening
  socket closed, so the server's reconnect attempts are refused (adb lists the device as offline,
  and drops it after its ~60 s of retries); `revive()` listens again on the same port. The timer
  runs whether or not the command has ended. Note: adb 29 (Debian's) exits 0 from an `adb shell`
  whose device vanished (no exit packet came); newer clients exit 255. Detect the loss otherwise.
- full_disk: sync SEND with data fails with "write failed: No space left on device" (adb push prints
  "remote write failed: No space left on device"); df shows /data with 0 available. Writes made by
  shell commands and statvfs() from a program are not affected.
- unauthorized: CNXN is answered with AUTH token requests forever; adb lists it as unauthorized.
- offline: CNXN is never answered; adb lists it as offline (`adb connect` waits 10 s first).
Changing unauthorized or offline at run time drops live connections so the server reconnects.

Also here: `adb_server()`, a private adb server on a free port for tests (never the user's 5037).
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno as errno_mod
import fcntl
import logging
import os
import platform
import posixpath
import re
import shutil
import signal
import socket
import stat as stat_mod
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO, Self

from toolkit.errors import SpecPrefetchError

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
PRODUCT, MODEL, DEVICE = "sun", "SM8750 stand-in", "sun"

# shell protocol packet ids (shell_protocol.h)
SH_STDIN, SH_STDOUT, SH_STDERR, SH_EXIT, SH_CLOSE_STDIN, SH_WINSIZE = range(6)
_SH_HEADER = struct.Struct("<BI")

# sync protocol (file_sync_protocol.h)
SYNC_DATA_MAX = 64 * 1024
_SYNC_REQ = struct.Struct("<4sI")
_STAT_V1 = struct.Struct("<4sIII")
_STAT_V2 = struct.Struct("<4sIQQIIIIQqqq")
_DENT_V1 = struct.Struct("<4sIIII")
_DENT_V2 = struct.Struct("<4sIQQIIIIQqqqI")

# --- the emulated phone ------------------------------------------------------------------------
PERF_FREQS = (384000, 556800, 748800, 960000, 1152000, 1363200, 1555200, 1785600, 1996800, 2227200,
              2438400, 2649600, 2841600, 3072000, 3283200, 3532800)
PRIME_FREQS = (1017600, 1209600, 1401600, 1689600, 1958400, 2246400, 2438400, 2649600, 2841600,
               3072000, 3283200, 3513600, 3840000, 4089600, 4320000)
CLUSTERS = (("policy0", (0, 1, 2, 3, 4, 5), PERF_FREQS, 1785600),
            ("policy6", (6, 7), PRIME_FREQS, 2246400))
THERMAL_ZONES = (("aoss-0", 36500), ("cpu-0-0-0", 41200), ("cpu-0-1-0", 40800), ("cpu-1-0-0", 43100),
                 ("cpuss-0", 40100), ("gpuss-0", 37600), ("ddr", 38000), ("skin-msm-therm", 33400),
                 ("battery", 30500))
DATA_MOUNT_OPTS = ("rw,lazytime,seclabel,nosuid,nodev,noatime,background_gc=on,gc_merge,nodiscard,"
                   "fsync_mode=nobarrier,compress_algorithm=lz4,compress_log_size=2,compress_mode=user,"
                   "atgc,discard_unit=block,memory=normal,inlinecrypt")
MOUNTS = (("/dev/block/dm-5", "/", "erofs", "ro,seclabel,relatime,user_xattr,acl,cache_strategy=readaround"),
          ("tmpfs", "/dev", "tmpfs", "rw,seclabel,nosuid,relatime,size=5720220k,nr_inodes=1430055,mode=755"),
          ("proc", "/proc", "proc", "rw,relatime,gid=3009,hidepid=invisible"),
          ("sysfs", "/sys", "sysfs", "rw,seclabel,relatime"),
          ("/dev/block/dm-52", "/data", "f2fs", DATA_MOUNT_OPTS),
          ("/dev/fuse", "/storage/emulated", "fuse",
           "rw,lazytime,nosuid,nodev,noexec,noatime,user_id=0,group_id=0,allow_other"))
MEMINFO = """\
MemTotal:       11440440 kB
MemFree:          612948 kB
MemAvailable:    5234980 kB
Buffers:            4096 kB
Cached:          4812340 kB
SwapCached:        20480 kB
Active:          3981236 kB
Inactive:        3123720 kB
Active(anon):    1502212 kB
Inactive(anon):   688384 kB
Active(file):    2479024 kB
Inactive(file):  2435336 kB
Unevictable:      212340 kB
Mlocked:          210112 kB
SwapTotal:       8388604 kB
SwapFree:        6291452 kB
Dirty:              1204 kB
Writeback:             0 kB
AnonPages:       2398212 kB
Mapped:          1612936 kB
Shmem:             38212 kB
KReclaimable:     402112 kB
Slab:             812340 kB
SReclaimable:     260468 kB
SUnreclaim:       551872 kB
KernelStack:       82112 kB
PageTables:       161024 kB
CommitLimit:    14108824 kB
Committed_AS:   98123456 kB
VmallocTotal:   262930368 kB
VmallocUsed:      301232 kB
CmaTotal:         212992 kB
CmaFree:            2048 kB
"""
CPU_FEATURES = ("fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm jscvt "
                "fcma lrcpc dcpop sha3 sm3 sm4 asimddp sha512 asimdfhm dit uscat ilrcpc flagm ssbs sb "
                "paca pacg dcpodp flagm2 frint i8mm bf16 bti")


def default_props(serial: str, root_user: bool) -> dict[str, str]:
    """The properties `getprop` shows: a Snapdragon 8 Elite phone on Android 15."""
    build_type = "userdebug" if root_user else "user"
    return {
        "ro.soc.model": "SM8750", "ro.soc.manufacturer": "QTI", "ro.board.platform": "sun",
        "ro.hardware": "qcom", "ro.product.cpu.abi": "arm64-v8a", "ro.product.cpu.abilist": "arm64-v8a",
        "ro.product.cpu.abilist64": "arm64-v8a", "ro.product.cpu.abilist32": "",
        "ro.product.model": MODEL, "ro.product.name": PRODUCT, "ro.product.device": DEVICE,
        "ro.product.brand": "qti", "ro.product.manufacturer": "QTI",
        "ro.build.version.sdk": "35", "ro.build.version.release": "15", "ro.build.type": build_type,
        "ro.build.fingerprint": f"qti/{PRODUCT}/{DEVICE}:15/AP3A.240905.015/1:{build_type}/release-keys",
        "ro.debuggable": "1" if root_user else "0", "ro.secure": "1", "ro.serialno": serial,
        "ro.config.low_ram": "false", "sys.boot_completed": "1", "service.adb.root": "1" if root_user else "0",
    }


@dataclasses.dataclass(frozen=True)
class Faults:
    """Faults the stand-in can show (see the module docstring for what each does)."""
    disconnect_after_s: float | None = None
    disconnect_match: str = ""
    full_disk: bool = False
    unauthorized: bool = False
    offline: bool = False

    @classmethod
    def of(cls, value: Faults | Mapping[str, Any] | None) -> Faults:
        """Faults from a Faults, a dict of its fields (as the CLI passes them) or None."""
        if value is None:
            return cls()
        if isinstance(value, Faults):
            return value
        return cls().replace(**dict(value))

    def replace(self, **changes: Any) -> Faults:
        names = {f.name for f in dataclasses.fields(self)}
        for k in changes:
            if k not in names:
                raise SpecPrefetchError(f"unknown stand-in fault '{k}' (known: {', '.join(sorted(names))})")
        new = dataclasses.replace(self, **changes)
        d = new.disconnect_after_s
        if d is not None and (isinstance(d, bool) or not isinstance(d, (int, float)) or not d >= 0):
            raise SpecPrefetchError(f"disconnect_after_s must be a number of seconds >= 0, not {d!r}")
        for flag in ("full_disk", "unauthorized", "offline"):
            if not isinstance(getattr(new, flag), bool):
                raise SpecPrefetchError(f"stand-in fault {flag} must be true or false, not {getattr(new, flag)!r}")
        if not isinstance(new.disconnect_match, str):
            raise SpecPrefetchError("disconnect_match must be a string")
        return new


def _write_missing(path: Path, text: str) -> None:
    if not path.exists() and not path.is_symlink():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def populate(root: Path) -> None:
    """Write the fake SM8750 /sys and /proc files and the usual directories into `root`, where missing."""
    for d in ("data/local/tmp", "storage/emulated/0", "system/bin", "dev"):
        (root / d).mkdir(parents=True, exist_ok=True)
    if not (root / "sdcard").is_symlink() and not (root / "sdcard").exists():
        (root / "sdcard").symlink_to("storage/emulated/0")
    cpu = root / "sys/devices/system/cpu"
    for name in ("online", "possible", "present"):
        _write_missing(cpu / name, "0-7\n")
    for policy, cpus, freqs, cur in CLUSTERS:
        p = cpu / "cpufreq" / policy
        related = " ".join(map(str, cpus)) + "\n"
        files = {
            "related_cpus": related, "affected_cpus": related,
            "cpuinfo_max_freq": f"{freqs[-1]}\n", "cpuinfo_min_freq": f"{freqs[0]}\n",
            "scaling_max_freq": f"{freqs[-1]}\n", "scaling_min_freq": f"{freqs[0]}\n",
            "scaling_cur_freq": f"{cur}\n", "scaling_governor": "walt\n",
            "scaling_available_governors": "walt performance schedutil powersave\n",
            "scaling_available_frequencies": " ".join(map(str, freqs)) + " \n",
            # time in state, in 10 ms units: a fixed, plausible residency per frequency
            "stats/time_in_state": "".join(f"{f} {(i * 7919 + 1013) % 20000}\n" for i, f in enumerate(freqs)),
            "stats/total_trans": f"{sum(cpus) * 101 + 4242}\n",
        }
        for rel, text in files.items():
            _write_missing(p / rel, text)
        for c in cpus:
            link = cpu / f"cpu{c}" / "cpufreq"
            link.parent.mkdir(parents=True, exist_ok=True)
            if not link.is_symlink() and not link.exists():
                link.symlink_to(f"../cpufreq/{policy}")
            _write_missing(cpu / f"cpu{c}" / "online", "1\n")
            _write_missing(cpu / f"cpu{c}" / "topology/cluster_id", f"{0 if c < 6 else 1}\n")
            _write_missing(cpu / f"cpu{c}" / "topology/core_id", f"{c if c < 6 else c - 6}\n")
    thermal = root / "sys/class/thermal"
    for i, (kind, milli) in enumerate(THERMAL_ZONES):
        z = thermal / f"thermal_zone{i}"
        _write_missing(z / "type", kind + "\n")
        _write_missing(z / "temp", f"{milli}\n")
        _write_missing(z / "mode", "enabled\n")
        _write_missing(z / "policy", "step_wise\n")
    proc = root / "proc"
    _write_missing(proc / "mounts", "".join(f"{dev} {mnt} {fs} {opts} 0 0\n" for dev, mnt, fs, opts in MOUNTS))
    _write_missing(proc / "meminfo", MEMINFO)
    _write_missing(proc / "cpuinfo", "".join(
        f"processor\t: {i}\nBogoMIPS\t: 38.40\nFeatures\t: {CPU_FEATURES}\nCPU implementer\t: 0x51\n"
        f"CPU architecture: 8\nCPU variant\t: 0x{2 if i < 6 else 3:x}\nCPU part\t: 0x001\nCPU revision\t: 2\n\n"
        for i in range(8)))
    _write_missing(proc / "sys/vm/drop_caches", "0\n")


def _set_system_modes(root: Path, writable: bool) -> None:
    """sys and proc files: writable only by root (as on a user build, where the shell is uid 2000)."""
    for top in (root / "sys", root / "proc"):
        for dirpath, _dirs, files in os.walk(top):
            for f in files:
                os.chmod(os.path.join(dirpath, f), 0o644 if writable else 0o444)


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
# where a non-root adb shell may write (for sync SEND)
_USER_WRITABLE = ("/data/local/tmp", "/sdcard", "/storage/emulated")


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

    def __init__(self, standin: StandIn, sock: socket.socket) -> None:
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


class StandIn:
    """A stand-in SM8750 phone on loopback for the real adb server (module docstring for the details).

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
        self._env: dict[str, str] = {}
        self._listener: socket.socket | None = None
        self._conns: set[_Conn] = set()
        self._lock = threading.RLock()
        self._timers: list[threading.Timer] = []
        self._gone = False
        self._started = False
        self.history: list[str] = []  # every service the server opened, in order (for tests)

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
            return lambda s: self._shell(s, rest, protocol=protocol, pty_mode=kind == "pty", term=term)
        if name == "exec" and not args:
            return lambda s: self._shell(s, rest, protocol=False, pty_mode=False, term="dumb")
        if name == "sync" and not args:
            return self._sync
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
        """The module docstring's rewrite rule: device paths in a command line -> host paths."""
        root = str(self._root)
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
        if os.geteuid() == 0 and not self.root_user and shutil.which("setpriv"):
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
                                         cwd=self._root, env=env, start_new_session=not setsid)
            finally:
                os.close(slave)
        else:
            popen = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
                                     cwd=self._root, env=env, start_new_session=True, bufsize=0)
        return _Proc(popen, master)

    def _shell(self, stream: _Stream, command: str, *, protocol: bool, pty_mode: bool, term: str) -> None:
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
        self._arm_disconnect(command)
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
        threading.Thread(target=self._shell_input, args=(stream, proc, protocol, not command),
                         daemon=True).start()
        for t in readers:
            t.join()
        code = proc.exit_code()
        proc.release((popen.stdout, popen.stderr))
        if protocol:
            with contextlib.suppress(_Closed):
                emit(SH_EXIT)(bytes([code]))

    def _shell_input(self, stream: _Stream, proc: _Proc, protocol: bool, script_on_stdin: bool) -> None:
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

    # --- sync -----------------------------------------------------------------------------------
    def _sync(self, stream: _Stream) -> None:
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
        host = str(self.host_path(path))
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
        host = self.host_path(path)
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
        host = self.host_path(path)
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
            if value and self._faults.full_disk:
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
        if self.root_user:
            return None
        norm = posixpath.normpath(posixpath.join("/", path))
        if any(norm == p or norm.startswith(p + "/") for p in _USER_WRITABLE):
            return None
        return f"couldn't create file: {os.strerror(errno_mod.EACCES)}"

    def _recv(self, stream: _Stream, path: str) -> bool:
        """RECV path: DATA chunks (batched into full WRTEs), then DONE; or FAIL."""
        with contextlib.ExitStack() as stack:
            try:
                fh = stack.enter_context(open(self.host_path(path), "rb"))
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

    # --- shell environment ------------------------------------------------------------------------
    def _write_shims(self) -> None:
        assert self._aux is not None
        bin_dir = self._aux / "bin"
        bin_dir.mkdir()
        uid = 0 if self.root_user else 2000
        shims = {"getprop": _SHIM_GETPROP, "taskset": _SHIM_TASKSET, "uname": _SHIM_UNAME, "mount": _SHIM_MOUNT,
                 "df": _SHIM_DF.format(python=sys.executable), "id": _shim_id(uid),
                 "whoami": f"#!/bin/sh\necho {'root' if uid == 0 else 'shell'}\n",
                 "nproc": "#!/bin/sh\n# nproc stand-in: the phone's 8 CPUs\necho 8\n",
                 "su": _SHIM_SU_ROOT if self.root_user else _SHIM_SU_ABSENT}
        for name, text in shims.items():
            (bin_dir / name).write_text(text)
            (bin_dir / name).chmod(0o755)
        props = default_props(f"spx-standin-{self._port}", self.root_user) | self._extra_props
        (self._aux / "props").write_text("".join(f"{k}={v}\n" for k, v in sorted(props.items())))
        machine = platform.machine().lower()
        # arm64 binaries need qemu on another host; a stand-in reporting x86_64 runs this machine's own
        native = machine in ("aarch64", "arm64") or props.get("ro.product.cpu.abi", "").startswith("x86")
        emulator = "" if native else (shutil.which("qemu-aarch64") or "")
        root = str(self._root)
        self._env = {
            "PATH": f"{bin_dir}:{os.environ.get('PATH') or '/usr/local/bin:/usr/bin:/bin'}",
            "HOME": root, "TMPDIR": root + "/data/local/tmp", "ANDROID_DATA": root + "/data",
            "ANDROID_ROOT": "/system", "EXTERNAL_STORAGE": root + "/sdcard", "HOSTNAME": "localhost",
            "USER": "root" if self.root_user else "shell", "LOGNAME": "root" if self.root_user else "shell",
            "SHELL": "/bin/sh", "LANG": "C.UTF-8", "SPX_EMULATOR": emulator,
            "SPX_STANDIN_ROOT": root, "SPX_STANDIN_AUX": str(self._aux),
        }

    def _write_fault_flags(self) -> None:
        """The shims read the faults they show (df: full_disk) from flag files."""
        if self._aux is None:
            return
        flag = self._aux / "full_disk"
        if self._faults.full_disk:
            flag.touch()
        else:
            flag.unlink(missing_ok=True)


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


# --- a private adb server -------------------------------------------------------------------------
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


def _free_port() -> int:
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
    port = port or _free_port()
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
