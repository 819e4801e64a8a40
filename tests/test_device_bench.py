"""`specprefetch device bench` (toolkit/device/phone.py's bench, its lock and its checks, through
toolkit/device/adb.py): one bench at a time on a phone (a lock there, each bench's runs in its own
directory), everything the runner would refuse checked here before any push, an interrupted bench's
exit code and what it keeps.

Through the real adb client, a private adb server and the stand-in phone (tests/test_device.py's
fixtures); the benches that run use the session's x86_64 runner build (conftest.native_host)."""
from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import test_device
from test_device import POLICIES, PROMPT, server  # noqa: F401 - fixtures
from toolkit.device.phone import LOCK, ROOT, _stale, bench, bundle_hash, lock_phone
from toolkit.device.adb import Adb
from toolkit.errors import SpecPrefetchError

phones = test_device.phones  # the fixture, re-exported (the tests below take it as a parameter)

pytestmark = pytest.mark.skipif(shutil.which("adb") is None, reason="adb is not installed")


def _bench(bundle, p, out, policies=("on-demand+lru",), **kw):
    args = dict(serial=p.serial, policies=list(policies), pool_mib=2.0, prompts=[PROMPT], max_new_tokens=3,
                repeats=1, json_out=out, cooldown_timeout_s=2, log=lambda s: None)
    return bench(bundle, **{**args, **kw})


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def _write_lock(phone, *, pid: int, host: str, age_s: int = 0, stale_after_s: int = 1500) -> Path:
    """A lock as another bench leaves it on the phone (the layout docs/device.md describes)."""
    d = phone.host_path(LOCK)
    d.mkdir(parents=True)
    now = int(time.time()) - age_s
    (d / "token").write_text("0123456789abcdef\n")
    (d / "owner").write_text(json.dumps({"pid": pid, "host": host, "what": "other bench",
                                         "stale_after_s": stale_after_s}) + "\n")
    (d / "started").write_text(f"{now}\n")
    (d / "heartbeat").write_text(f"{now}\n")
    return d


class TestPhoneLock:
    """One bench at a time on a phone: a lock there (a stale one taken over), each bench's runs in its own
    directory."""

    def test_a_second_bench_on_a_busy_phone_is_refused(self, native_host, phones, tmp_path):
        """Bench A holds the phone (stopped at its warm-up); bench B on the same phone is refused in one
        line naming A, before it sends or runs anything; A then finishes with its own runs only."""
        bundle, _ = native_host
        p = phones()
        holding, go_on = threading.Event(), threading.Event()
        got: dict = {}

        def log_a(line: str) -> None:
            if line.startswith("warm-up"):
                holding.set()
                go_on.wait(120)

        def run_a() -> None:
            try:
                got["a"] = _bench(bundle, p, tmp_path / "a.json", POLICIES.split(","), log=log_a)
            except BaseException as e:  # noqa: BLE001 - reported below
                got["a_error"] = e
            holding.set()

        t = threading.Thread(target=run_a)
        t.start()
        try:
            assert holding.wait(300) and "a_error" not in got, got.get("a_error")
            assert p.host_path(LOCK).is_dir()
            with pytest.raises(SpecPrefetchError, match=rf"device {p.serial} is busy: another `device bench` \(process "
                                                        rf"{os.getpid()} on .*holds {LOCK}"):
                _bench(bundle, p, tmp_path / "b.json")
        finally:
            go_on.set()
            t.join(300)
        assert not (tmp_path / "b.json").exists()
        a = got["a"]
        assert a["status"] == "complete" and a["failures"] == [] and len(a["runs"]) == 2
        runs = p.host_path(a["remote_runs"])
        assert runs.parent.name == "runs" and len(list(runs.glob("*.json"))) == 3  # 2 runs and the warm-up
        assert not p.host_path(LOCK).exists()  # released

    def test_a_stale_lock_is_taken_over_and_a_bench_keeps_to_its_own_directory(self, native_host, phones, tmp_path):
        """A lock left by a process of this host that is gone is taken over. The bench writes only in its
        own runs/<invocation>/: a result another bench left on the phone is not touched (nor read)."""
        bundle, _ = native_host
        p = phones()
        _write_lock(p, pid=_dead_pid(), host=socket.gethostname())
        base = p.host_path(f"{ROOT}/{bundle_hash(bundle)}")
        foreign = base / "out" / "on-demand_lru-0-0.json"  # where every bench used to write this run
        foreign.parent.mkdir(parents=True)
        foreign.write_text('{"another": "bench"}\n')
        logged: list[str] = []
        rep = _bench(bundle, p, tmp_path / "r.json", log=logged.append)
        assert any("took over a stale bench lock" in ln and "is gone" in ln for ln in logged), logged
        assert rep["status"] == "complete" and len(rep["runs"]) == 1
        assert foreign.read_text() == '{"another": "bench"}\n'
        mine = p.host_path(rep["remote_runs"])
        assert sorted(x.name for x in mine.iterdir()) == ["on-demand_lru-0--1.json", "on-demand_lru-0-0.json",
                                                          "run.pid"]
        assert mine.parent == base / "runs" and not p.host_path(LOCK).exists()

    def test_a_live_lock_of_another_host_is_refused_and_a_silent_one_taken(self, phones):
        """Whose lock is stale: judged by the phone's clock. A lock of another host with a recent
        heartbeat is refused (it may be alive); one silent for longer than its owner allowed is taken."""
        p = phones()
        adb = Adb(p.serial)
        d = _write_lock(p, pid=4242, host="other-host.example", stale_after_s=600)
        with pytest.raises(SpecPrefetchError, match=r"busy: another `device bench` \(process 4242 on "
                                                    r"other-host.example, started \d+ s ago: other bench\)"):
            lock_phone(adb, stale_after_s=100, what="x", log=lambda s: None)
        assert (d / "token").read_text() == "0123456789abcdef\n"  # untouched
        (d / "heartbeat").write_text(f"{int(time.time()) - 601}\n")
        lock = lock_phone(adb, stale_after_s=100, what="mine", log=lambda s: None)
        assert (d / "token").read_text().strip() == lock.token and \
            json.loads((d / "owner").read_text())["what"] == "mine"
        lock.beat()
        lock.release()
        assert not d.exists()
        # the rules themselves, on the state read from the phone
        owner = {"pid": 1, "host": "h", "stale_after_s": 10}
        assert _stale({"owner": None, "now": 1000, "mtime": 990, "started": None, "heartbeat": None}) is None
        assert "no owner" in _stale({"owner": None, "now": 1000, "mtime": 800, "started": None, "heartbeat": None})
        assert _stale({"owner": owner, "now": 1000, "mtime": 0, "started": 0, "heartbeat": 995}) is None
        assert "no sign of life for 11 s" in _stale({"owner": owner, "now": 1000, "mtime": 0, "started": 0,
                                                     "heartbeat": 989})

    def test_a_lock_taken_over_under_a_bench_stops_it(self, native_host, phones, tmp_path):
        """If another bench took this bench's lock (judged stale), this one stops with a partial report
        instead of mixing its runs with the other's."""
        bundle, _ = native_host
        p = phones()

        def log(line: str) -> None:
            if line.startswith("warm-up"):
                (p.host_path(LOCK) / "token").write_text("someone-else\n")

        with pytest.raises(SpecPrefetchError, match=r"lock .* was removed or taken by another bench.*partial results"):
            _bench(bundle, p, tmp_path / "t.json", log=log)
        assert json.loads((tmp_path / "t.json").read_text())["status"] == "partial"
        assert (p.host_path(LOCK) / "token").read_text() == "someone-else\n"  # not ours to remove


class TestChecksBeforeThePush:
    """What the runner would refuse is refused before anything reaches the phone."""

    @pytest.mark.parametrize("case, match", [
        ({"pool_mib": 0.2}, r"--pool-mib 0.2: holds 1 expert slots of 120 KiB, but one layer needs 4"),
        ({"max_new_tokens": 60}, r"exceeds the bundle's KV cache of 64 positions .*at most --max-new-tokens \d+"),
        ({"prompts": [PROMPT, ""]}, r"--prompt \"\" \(prompt 2\): no tokens"),
        ({"threads": 300}, r"--threads 300: the runner takes 1..256"),
        ({"policies": ["adapter+lru"]}, r"predictor 'adapter' is not available in the native runner .*available: "
                                        r"on-demand, previous-token, oracle, next-gate, fate"),
        ({"policies": ["on-demand+fifo"]}, r"unknown eviction 'fifo'"),
        ({"json_out": "md-dir"}, r"phone.md is a directory"),
        ({"json_out": "in-bundle"}, r"is inside .*an input of this command"),
        ({"json_out": "unwritable"}, r"--json .*phone.json: cannot write in "),
    ])
    def test_what_the_runner_would_refuse_is_refused_before_the_push(self, embedded_bundles, phones, tmp_path, case,
                                                                      match):
        bundle = embedded_bundles["executorch"]
        p = phones()
        out = tmp_path / "phone.json"
        if case.get("json_out") == "md-dir":
            out.with_suffix(".md").mkdir()
            case = {"json_out": out}
        elif case.get("json_out") == "in-bundle":  # a copy: a regression must not damage the session's bundle
            shutil.copytree(bundle, tmp_path / "b")
            bundle = tmp_path / "b"
            case = {"json_out": bundle / "report.json"}
        elif case.get("json_out") == "unwritable":  # the error names --json, not a temporary file
            ro = Path("/proc/spx-no-such-dir") if os.geteuid() == 0 else tmp_path / "ro"
            if os.geteuid() != 0:
                ro.mkdir(mode=0o500)
            case = {"json_out": ro / "phone.json"}
        with pytest.raises(SpecPrefetchError, match=match):
            _bench(bundle, p, out, **case)
        assert not p.host_path(ROOT).exists()  # nothing sent, no lock taken
        assert not out.is_file() and not (bundle / "report.json").exists()

    def test_the_cli_default_policies_pass_the_checks(self, embedded_bundles, tmp_path):
        """`device bench` without --policies: the defaults pass the checks (all but the adapter, which a bundle
        has only when exported with one)."""
        from toolkit.cli import main
        from toolkit.device.phone import check_bench

        opt = next(o for o in main.commands["device"].commands["bench"].params if o.name == "policies")
        policies = opt.default.split(",")
        assert "previous-token+lru" in policies  # the phone engines' baseline beside the adapter
        # the shared bundle's graph heads are next-gate, not an adapter: the others must all pass
        policies = [q for q in policies if not q.startswith("adapter+")]
        check_bench(embedded_bundles["executorch"], policies=policies, pool_mib=4.0, prompts=["x"], max_new_tokens=4,
                    threads=1, json_out=tmp_path / "phone.json", peer=None)


class TestInterruptedBench:
    """An interrupted bench keeps its finished runs, releases the lock and exits 128 + the signal."""

    def test_an_interrupted_bench_keeps_its_runs_and_is_an_interrupt(self, native_host, phones, tmp_path):
        """An interrupt after the first run (SIGTERM turns into KeyboardInterrupt("SIGTERM") in the CLI):
        the report keeps that run (status partial), the lock is released, and the interrupt goes on
        (so the CLI exits 143, not 2), noting where the partial report is."""
        bundle, _ = native_host
        p = phones()

        def log(line: str) -> None:
            if line.startswith("  on-demand+lru prompt 0 #1"):
                raise KeyboardInterrupt("SIGTERM")

        out = tmp_path / "int.json"
        with pytest.raises(KeyboardInterrupt) as e:
            _bench(bundle, p, out, POLICIES.split(","), log=log)
        assert e.value.args == ("SIGTERM",)
        assert any(f"partial report (1 runs, status partial) was written to {out}" in n for n in e.value.__notes__)
        rep = json.loads(out.read_text())
        assert rep["status"] == "partial" and rep["reason"] == "interrupted (SIGTERM)" and len(rep["runs"]) == 1
        assert out.with_suffix(".md").is_file() and out.with_suffix(".png").is_file()
        assert not p.host_path(LOCK).exists()

    @pytest.mark.slow  # ~20 s: the CLI's start (torch, transformers) and a push
    def test_sigterm_to_device_bench_exits_143_with_the_partial_report(self, native_host, phones, tmp_path):
        """A real SIGTERM to the CLI while it waits in the cool-down gate (--max-temp-c 1 never passes
        on the stand-in, whose zones are at 30-43 °C)."""
        bundle, _ = native_host
        p = phones()
        out = tmp_path / "term.json"
        env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
        proc = subprocess.Popen(["specprefetch", "device", "bench", str(bundle), "--serial", p.serial, "--policies",
                                 "on-demand+lru", "--pool-mib", "2", "--prompt", PROMPT, "--max-new-tokens", "3",
                                 "--repeats", "1", "--max-temp-c", "1", "--cooldown-timeout", "300", "--json",
                                 str(out)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
        err, t0 = b"", time.monotonic()
        try:
            while b"warm-up on" not in err:
                assert time.monotonic() - t0 < 300 and proc.poll() is None, err.decode(errors="replace")
                if select.select([proc.stderr], [], [], 0.2)[0]:
                    err += os.read(proc.stderr.fileno(), 1 << 16)
            time.sleep(0.5)  # inside the gate's polling
            proc.send_signal(signal.SIGTERM)
            err += proc.communicate(timeout=120)[1]
        finally:
            if proc.poll() is None:
                proc.kill()
        text = err.decode(errors="replace")
        assert proc.returncode == 128 + signal.SIGTERM, text
        assert "Traceback" not in text and "error:" not in text, text
        last = [ln for ln in text.splitlines() if ln.strip()][-1]
        assert last == (f"interrupted: the partial report (0 runs, status partial) was written to {out} "
                        "(and its .md, .png)")
        rep = json.loads(out.read_text())
        assert rep["status"] == "partial" and rep["reason"] == "interrupted (SIGTERM)"
        assert not p.host_path(LOCK).exists()
