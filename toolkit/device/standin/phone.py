"""The stand-in's emulated phone: a fake Snapdragon 8 Elite (SM8750) on Android 15.

Its identity (product, model, device), the /sys and /proc files `populate` writes into the device
root (CPU clusters and their frequencies, thermal zones, mounts, meminfo, cpuinfo), the properties
`getprop` shows (`default_props`), the file modes of a user build (`_set_system_modes`) and the
faults the stand-in can show (`Faults`).
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from toolkit.errors import SpecPrefetchError

PRODUCT, MODEL, DEVICE = "sun", "SM8750 stand-in", "sun"

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
    """Faults the stand-in can show (see the package docstring for what each does)."""
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

