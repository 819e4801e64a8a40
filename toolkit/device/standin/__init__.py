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

The modules, bottom up (each imports only those before it): phone (the emulated phone's files,
props and Faults), transport (packets, connections, streams), shell (the shell: and exec: services,
the shims and the rewrite), sync (the sync: service), device (StandIn, serve, main) and, on its
own, adb_server (AdbServer, adb_server, free_port).
"""
from __future__ import annotations

from toolkit.device.standin.adb_server import AdbServer, adb_server, free_port
from toolkit.device.standin.device import StandIn, main, serve
from toolkit.device.standin.phone import Faults, default_props, populate

__all__ = ["AdbServer", "Faults", "StandIn", "adb_server", "default_props", "free_port", "main",
           "populate", "serve"]
