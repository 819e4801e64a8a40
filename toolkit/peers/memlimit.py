"""Run a command under a memory limit that includes page cache, from a cold page cache, and measure
what it read from storage and how much memory it held.

This is how a peer that mmaps its model (llama.cpp) and our runner (O_DIRECT reads into a bounded
pool) are held to the same DRAM budget: a phone's small DRAM holds the process's anonymous memory
*and* whatever of the model file is in page cache, so the limit must charge both. A cgroup v1
memory controller does: page cache faulted in by the process is charged to
its cgroup, and reclaim at the limit evicts it, so an mmap reader whose working set exceeds the
limit re-reads from storage (thrashes) instead of keeping the whole file cached.

Measurements (all for the child *and its descendants*):

- ``read_bytes``: ``ru_inblock * 512`` of the command's wait4 rusage (see below for who calls
  wait4). That is the kernel's per-task I/O accounting (``read_bytes`` of /proc/<pid>/io),
  charged when a read bio is submitted on the task's behalf: page-cache fills from read(2), mmap
  page faults *with their readahead* (read_ahead_kb inflates it, as it inflates real I/O), and
  O_DIRECT reads alike; cache hits count nothing. The rusage of a reaped child includes every
  descendant it (transitively) waited for, so forked reader processes and threads are covered.
  Alternatives rejected:
  /proc/<pid>/io sampled misses the last interval and reaped descendants; memory.stat pgmajfault
  counts faults, not bytes, and misses O_DIRECT and read(2); the blkio v1 throttle counters stay 0
  on this kernel without throttle rules. Not covered: descendants orphaned (reparented to init)
  before exit. Reads of the binary and its shared libraries count too (the cache is cold).
- ``peak_rss_bytes``: ``ru_maxrss`` of the same rusage: the largest resident set of any *single*
  process of the tree (not a sum). For an mmap reader it includes the mapped file pages resident
  at the peak (RssFile), so it is not "anonymous memory" alone. Trap: exec keeps the pre-exec
  high-water mark, and a child forked (or vforked) from this Python process starts out mapping
  all of this process's pages, so a plain fork+exec reports at least *our* RSS (~170 MB under
  pytest with torch loaded). The command therefore runs under GNU ``/usr/bin/time`` (tiny,
  exec'd, ~1.5 MB), which forks the real command from its own small image and reports that
  command's wait4 rusage (``%M``, ``%I``); ``rusage_source`` says "GNU time". Without it, the
  plain wait4 figures are used ("wait4", RSS then only an upper bound).
- ``cgroup_max_usage_bytes``: memory.max_usage_in_bytes of the child cgroup: the peak of
  everything charged to the tree (anonymous memory + page cache + kernel memory), i.e. the figure
  the limit is enforced on. None when no cgroup was used.

Cold cache: as root ``sync; echo 3 > /proc/sys/vm/drop_caches`` (whole machine); otherwise
``posix_fadvise(POSIX_FADV_DONTNEED)`` on ``files`` (after fdatasync); ``LimitedRun.cache_drop``
says which.
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from toolkit.errors import SpecPrefetchError

_counter = itertools.count()


@dataclasses.dataclass
class LimitedRun:
    argv: list[str]
    returncode: int          # negative: killed by that signal (-9 also for the cgroup OOM killer)
    stdout: str
    stderr: str
    wall_s: float            # from just before the fork to the child's reaping
    peak_rss_bytes: int      # ru_maxrss: largest single process of the tree
    read_bytes: int          # ru_inblock * 512: bytes read from storage by the tree
    cgroup_max_usage_bytes: int | None  # peak charged to the cgroup (anon + page cache + kernel)
    limit_bytes: int | None
    cache_drop: str          # "drop_caches", "fadvise(N files)", "none (warm)" or "none (...)"
    oom_kills: int | None = None   # the cgroup OOM killer's kills (memory.oom_control oom_kill)
    timed_out: bool = False
    cgroup: str | None = None      # the cgroup directory used (removed afterwards)
    rusage_source: str = "wait4"   # "GNU time" (the command's own rusage) or "wait4" (see above)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


def memory_cgroup_dir() -> Path | None:
    """The current process's cgroup v1 memory directory, or None without a v1 memory hierarchy."""
    try:
        cg_lines = Path("/proc/self/cgroup").read_text().splitlines()
        mountinfo = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    rel = None
    for line in cg_lines:
        parts = line.split(":", 2)
        if len(parts) == 3 and "memory" in parts[1].split(","):
            rel = parts[2]
    if rel is None:
        return None
    for line in mountinfo:
        left, _, right = line.partition(" - ")
        fields, rfields = left.split(), right.split()
        if len(rfields) >= 3 and rfields[0] == "cgroup" and "memory" in rfields[2].split(","):
            root, mnt = fields[3], fields[4]
            sub = os.path.relpath(rel, root) if root != "/" else rel.lstrip("/")
            path = Path(mnt) / sub if sub not in ("", ".") else Path(mnt)
            return path if path.is_dir() else None
    return None


def unavailable_reason() -> str | None:
    """Why a memory limit cannot be applied here, or None when it can."""
    d = memory_cgroup_dir()
    if d is None:
        return ("no cgroup v1 memory controller (needs /sys/fs/cgroup/memory mounted as cgroup v1; "
                "cgroup v2 and systemd-run are not supported)")
    if not (d / "memory.limit_in_bytes").exists():
        return f"{d} has no memory.limit_in_bytes (not a cgroup v1 memory directory)"
    if not os.access(d, os.W_OK):
        return f"cannot create a child cgroup in {d} (not writable: run as root or delegate it)"
    return None


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _make_cgroup(limit_bytes: int | None) -> Path:
    why = unavailable_reason()
    if why:
        raise SpecPrefetchError(f"cannot apply a memory limit: {why}")
    parent = memory_cgroup_dir()
    assert parent is not None
    cg = parent / f"specprefetch-{os.getpid()}-{next(_counter)}"
    try:
        cg.mkdir()
    except OSError as e:
        raise SpecPrefetchError(f"cannot apply a memory limit: mkdir {cg} failed ({e.strerror}); "
                                "needs a writable cgroup v1 memory hierarchy (root)") from e
    try:
        memsw = cg / "memory.memsw.limit_in_bytes"
        if limit_bytes is not None:
            # memsw must stay >= the memory limit at every step: raise it first, then set both
            if memsw.exists():
                _write(memsw, "-1")
            _write(cg / "memory.limit_in_bytes", str(int(limit_bytes)))
            if memsw.exists():
                _write(memsw, str(int(limit_bytes)))
    except OSError as e:
        _remove_cgroup(cg)
        raise SpecPrefetchError(f"cannot apply a memory limit of {limit_bytes} bytes in {cg}: "
                                f"{e.strerror}") from e
    return cg


def _remove_cgroup(cg: Path, wait_s: float = 10.0) -> None:
    """Kill whatever of the tree is left in the cgroup and remove it (retrying while it empties)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            pids = [int(p) for p in (cg / "cgroup.procs").read_text().split()]
        except OSError:
            pids = []
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            cg.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                raise SpecPrefetchError(f"could not remove the cgroup {cg} (still busy after "
                                        f"{wait_s:.0f} s); remove it with rmdir") from None
            time.sleep(0.05)


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _oom_kills(cg: Path) -> int | None:
    try:
        for line in (cg / "memory.oom_control").read_text().splitlines():
            k, _, v = line.partition(" ")
            if k == "oom_kill":
                return int(v)
    except (OSError, ValueError):
        pass
    return None


_GNU_TIME: list[str | None] = []


def gnu_time() -> str | None:
    """/usr/bin/time when it is GNU time (it reports the command's rusage with -f), else None."""
    if not _GNU_TIME:
        path = shutil.which("time", path="/usr/bin:/bin:/usr/local/bin")
        ok = False
        if path:
            try:
                r = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10,
                                   check=False)
                ok = "GNU" in r.stdout + r.stderr
            except (OSError, subprocess.SubprocessError):
                ok = False
        _GNU_TIME.append(path if ok else None)
    return _GNU_TIME[0]


def _parse_gnu_time(text: str) -> tuple[int, int, int | None] | None:
    """(maxrss KiB, inblock, returncode if killed by a signal) from `-f "%M %I"` output."""
    lines = text.strip().splitlines()
    if not lines:
        return None
    m = re.fullmatch(r"(\d+) (\d+)", lines[-1].strip())
    if not m:
        return None
    sig = re.search(r"Command terminated by signal (\d+)", text)
    return int(m.group(1)), int(m.group(2)), -int(sig.group(1)) if sig else None


def drop_page_cache(files: Sequence[Path | str] = ()) -> str:
    """Empty the page cache (as root, all of it), else drop `files`' pages. Returns how."""
    os.sync()
    try:
        _write(Path("/proc/sys/vm/drop_caches"), "3")
        return "drop_caches"
    except OSError:
        pass
    n = 0
    for f in files:
        try:
            fd = os.open(f, os.O_RDONLY)
        except OSError:
            continue
        try:
            try:
                os.fdatasync(fd)
            except OSError:
                pass
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            n += 1
        finally:
            os.close(fd)
    return f"fadvise({n} files)" if n else "none (no drop_caches permission and no files given)"


def run_limited(argv: Sequence[str | os.PathLike], *, limit_bytes: int | None,
                files: Sequence[Path | str] = (), cwd: Path | str | None = None,
                env: Mapping[str, str] | None = None, timeout: float | None = None,
                cold: bool = True, use_cgroup: bool | None = None) -> LimitedRun:
    """Run `argv` from a cold page cache, in a cgroup v1 memory child limited to `limit_bytes`
    (memory + page cache, and memsw where present; None: no limit), and measure it.

    The child joins the cgroup between fork and exec, so everything it and its descendants allocate
    or fault in is charged. `use_cgroup` (default: when a limit is given or a cgroup is available)
    with limit_bytes=None still gives `cgroup_max_usage_bytes`. Raises SpecPrefetchError when a limit
    is asked for and cannot be applied. On timeout the process group is killed and the result has
    timed_out=True. The cgroup is removed afterwards in every case.
    """
    argv = [os.fspath(a) for a in argv]
    if not argv or not (shutil.which(argv[0]) or os.path.isfile(argv[0])):
        raise SpecPrefetchError(f"cannot run {argv[0] if argv else '(empty command)'}: not found")
    if use_cgroup is None:
        use_cgroup = limit_bytes is not None or unavailable_reason() is None
    if limit_bytes is not None and not use_cgroup:
        raise SpecPrefetchError("a memory limit needs a cgroup (use_cgroup=False was given)")
    cache_drop = drop_page_cache(files) if cold else "none (warm)"
    timer_path = gnu_time()  # before the cgroup: nothing between its creation and the try that removes it
    cg = _make_cgroup(limit_bytes) if use_cgroup else None
    procs_path = os.fsencode(cg / "cgroup.procs") if cg else None

    def join_cgroup() -> None:  # runs in the child between fork and exec: os calls only
        if procs_path is not None:
            fd = os.open(procs_path, os.O_WRONLY)
            try:
                os.write(fd, str(os.getpid()).encode())
            finally:
                os.close(fd)

    timed_out = threading.Event()
    lock = threading.Lock()  # the timer kills only a process not yet waited for
    exited = [False]
    try:
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, \
                tempfile.NamedTemporaryFile("r", suffix=".rusage") as rus:
            full = [timer_path, "-o", rus.name, "-f", "%M %I", *argv] if timer_path else argv
            t0 = time.perf_counter()
            try:
                proc = subprocess.Popen(full, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                        cwd=cwd, env=None if env is None else dict(env),
                                        preexec_fn=join_cgroup,  # noqa: PLW1509 (os calls only)
                                        start_new_session=True)
            except subprocess.SubprocessError as e:
                raise SpecPrefetchError(f"could not move {argv[0]} into the cgroup {cg}: {e}") from e
            except OSError as e:
                raise SpecPrefetchError(f"could not start {argv[0]}: {e.strerror}") from e

            def kill() -> None:
                with lock:
                    if exited[0]:  # it ended first: its process group id may be free, or reused
                        return
                    timed_out.set()
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass

            timer = threading.Timer(timeout, kill) if timeout is not None else None
            if timer:
                timer.daemon = True
                timer.start()
            try:
                while True:  # wait for the exit without reaping, so the pid stays ours until the timer is off
                    try:
                        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
                        break
                    except InterruptedError:
                        continue
                with lock:
                    exited[0] = True
                while True:
                    try:
                        _, status, ru = os.wait4(proc.pid, 0)
                        break
                    except InterruptedError:
                        continue
            finally:
                if timer:
                    timer.cancel()
            wall = time.perf_counter() - t0
            proc.returncode = os.waitstatus_to_exitcode(status)
            out.seek(0)
            err.seek(0)
            stdout = out.read().decode("utf-8", "replace")
            stderr = err.read().decode("utf-8", "replace")
            maxrss_kib, inblock, source = ru.ru_maxrss, ru.ru_inblock, "wait4"
            returncode = proc.returncode
            timed = _parse_gnu_time(rus.read()) if timer_path else None
            if timed:
                maxrss_kib, inblock, source = timed[0], timed[1], "GNU time"
                if timed[2] is not None:
                    returncode = timed[2]
        max_usage = _read_int(cg / "memory.max_usage_in_bytes") if cg else None
        oom = _oom_kills(cg) if cg else None
    finally:
        if cg is not None:
            _remove_cgroup(cg)
    return LimitedRun(argv=argv, returncode=returncode, stdout=stdout, stderr=stderr,
                      wall_s=wall, peak_rss_bytes=maxrss_kib * 1024, read_bytes=inblock * 512,
                      cgroup_max_usage_bytes=max_usage, limit_bytes=limit_bytes,
                      cache_drop=cache_drop, oom_kills=oom, timed_out=timed_out.is_set(),
                      cgroup=str(cg) if cg else None, rusage_source=source)
