"""The stand-in phone against the real adb client and server (a private server, never port 5037)."""
from __future__ import annotations

import hashlib
import os
import platform
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from test_device import cli, one_line_error  # `specprefetch device ...` in a subprocess; its one-line error
from toolkit.device.standin import AdbServer, Faults, StandIn, adb_server
from toolkit.errors import SpecPrefetchError

PhoneFactory = Callable[..., StandIn]

pytestmark = pytest.mark.skipif(shutil.which("adb") is None, reason="adb is not installed (apt-get install adb)")


def _client_version() -> tuple[int, ...]:
    out = subprocess.run(["adb", "version"], check=False, capture_output=True, text=True).stdout
    m = re.search(r"Version (\d+)\.(\d+)\.(\d+)", out)
    return tuple(int(g) for g in m.groups()) if m else (0,)


@pytest.fixture(scope="module")
def server() -> Iterator[AdbServer]:
    with adb_server() as s:
        yield s


@pytest.fixture
def phone_factory(server: AdbServer, tmp_path: Path) -> Iterator[PhoneFactory]:
    """Start stand-ins (each in its own root under tmp_path); disconnect and stop them afterwards."""
    started: list[StandIn] = []

    def make(connect_state: str | None = "device", **kwargs: Any) -> StandIn:
        phone = StandIn(root=tmp_path / f"phone{len(started)}", **kwargs)
        phone.start()
        started.append(phone)
        if connect_state is not None:
            server.connect(phone.serial, state=connect_state)
        return phone

    yield make
    for phone in started:
        server.adb("disconnect", phone.serial, check=False)
        phone.stop()


@pytest.fixture
def phone(phone_factory: PhoneFactory) -> StandIn:
    return phone_factory()


def sh(server: AdbServer, phone: StandIn, command: str, check: bool = True,
       **kw: Any) -> subprocess.CompletedProcess[str]:
    return server.adb("-s", phone.serial, "shell", command, check=check, **kw)


def test_adb_lists_the_standin_as_a_device(server: AdbServer, phone: StandIn) -> None:
    listing = server.adb("devices", "-l").stdout
    line = next(ln for ln in listing.splitlines() if ln.startswith(phone.serial + " "))
    assert line.split()[1] == "device"
    assert "product:sun" in line and "model:SM8750_stand_in" in line and "device:sun" in line
    assert server.adb("-s", phone.serial, "get-state").stdout.strip() == "device"
    assert server.adb("-s", phone.serial, "get-serialno").stdout.strip() == phone.serial
    # the features the banner advertises are exactly the ones implemented
    assert server.adb("-s", phone.serial, "features").stdout.split() == [
        "shell_v2", "stat_v2", "ls_v2", "fixed_push_mkdir"]


def test_getprop_reports_an_sm8750(server: AdbServer, phone: StandIn) -> None:
    assert sh(server, phone, "getprop ro.soc.model").stdout == "SM8750\n"
    assert sh(server, phone, "getprop ro.no.such.prop fallback").stdout == "fallback\n"
    everything = sh(server, phone, "getprop").stdout
    assert "[ro.board.platform]: [sun]" in everything
    assert "[ro.product.cpu.abi]: [arm64-v8a]" in everything
    assert "[ro.build.version.sdk]: [35]" in everything


def test_shell_exit_code_and_stderr_stay_separate(server: AdbServer, phone: StandIn) -> None:
    r = sh(server, phone, "echo out; echo err >&2; exit 3", check=False)
    assert (r.returncode, r.stdout, r.stderr) == (3, "out\n", "err\n")
    assert sh(server, phone, "kill -9 $$", check=False).returncode == 137  # 128 + SIGKILL, as adbd reports
    # exec-out: raw, stderr merged into stdout as adbd does without the shell protocol
    r = server.adb("-s", phone.serial, "exec-out", "echo a; echo b >&2")
    assert r.stdout == "a\nb\n"
    # stdin reaches the command, and a script piped in with no command sees device paths
    assert server.adb("-s", phone.serial, "shell", "cat", input="to stdin\n").stdout == "to stdin\n"
    phone.host_path("/data/local/tmp/x").write_text("on the device\n")
    r = server.adb("-s", phone.serial, "shell", input="cat /data/local/tmp/x\nexit 4\n", check=False)
    assert (r.returncode, r.stdout) == (4, "on the device\n")
    assert server.adb("-s", phone.serial, "reboot", check=False).stderr.strip() == "error: closed"


def test_push_then_pull_round_trip(server: AdbServer, phone: StandIn, tmp_path: Path) -> None:
    blob = tmp_path / "blob.bin"
    blob.write_bytes(os.urandom(3 * 1024 * 1024 + 4097))  # several WRTEs and an odd tail
    digest = hashlib.sha256(blob.read_bytes()).hexdigest()
    out = server.adb("-s", phone.serial, "push", str(blob), "/data/local/tmp/blob.bin").stdout
    assert "1 file pushed" in out
    on_device = phone.host_path("/data/local/tmp/blob.bin")
    assert hashlib.sha256(on_device.read_bytes()).hexdigest() == digest
    assert on_device.stat().st_mode & 0o777 == 0o666  # adbd copies user bits to group and other

    back = tmp_path / "back.bin"
    server.adb("-s", phone.serial, "pull", "/data/local/tmp/blob.bin", str(back))
    assert hashlib.sha256(back.read_bytes()).hexdigest() == digest

    size = blob.stat().st_size
    assert sh(server, phone, "stat -c %s /data/local/tmp/blob.bin").stdout.strip() == str(size)
    assert re.search(rf"\s{size}\s.*blob\.bin$", sh(server, phone, "ls -l /data/local/tmp/blob.bin").stdout.strip())
    listing = server.adb("-s", phone.serial, "ls", "/data/local/tmp").stdout  # sync LIST
    assert re.search(rf"^[0-9a-f]{{8}} {size:08x} [0-9a-f]{{8}} blob\.bin$", listing, re.MULTILINE)
    # what a shell user of a real phone may not write, nor read when missing
    r = server.adb("-s", phone.serial, "push", str(blob), "/system/blob.bin", check=False)
    assert r.returncode != 0 and "Permission denied" in r.stdout + r.stderr
    r = server.adb("-s", phone.serial, "pull", "/data/local/tmp/absent", str(tmp_path / "x"), check=False)
    assert r.returncode != 0 and "No such file or directory" in r.stdout + r.stderr


def test_the_sm8750_view(server: AdbServer, phone: StandIn) -> None:
    cpu = "/sys/devices/system/cpu"
    assert sh(server, phone, f"cat {cpu}/cpu0/cpufreq/cpuinfo_max_freq {cpu}/cpu7/cpufreq/cpuinfo_max_freq"
              ).stdout.split() == ["3532800", "4320000"]
    assert sh(server, phone, f"cat {cpu}/cpu5/cpufreq/related_cpus {cpu}/cpu6/cpufreq/related_cpus"
              ).stdout.splitlines() == ["0 1 2 3 4 5", "6 7"]
    assert sh(server, phone, f"cat {cpu}/online").stdout == "0-7\n"
    rows = sh(server, phone, f"cat {cpu}/cpu6/cpufreq/stats/time_in_state").stdout.splitlines()
    assert rows[-1].split()[0] == "4320000" and all(len(r.split()) == 2 for r in rows)
    types = sh(server, phone, "cat /sys/class/thermal/thermal_zone*/type").stdout.split()
    assert {"cpu-0-0-0", "cpuss-0", "skin-msm-therm"} <= set(types)
    temps = [int(t) for t in sh(server, phone, "cat /sys/class/thermal/thermal_zone*/temp").stdout.split()]
    assert len(temps) == len(types) and all(20000 < t < 60000 for t in temps)  # millidegrees
    data = sh(server, phone, "mount | grep ' /data '").stdout
    assert " type f2fs " in data and "inlinecrypt" in data
    assert "inlinecrypt" in sh(server, phone, "grep ' /data ' /proc/mounts").stdout
    assert re.search(r"^MemAvailable:\s+\d+ kB$", sh(server, phone, "cat /proc/meminfo").stdout, re.MULTILINE)
    # not root: uid 2000, no su, no drop_caches
    assert sh(server, phone, "id -u").stdout == "2000\n"
    assert sh(server, phone, "su -c id", check=False).returncode == 127
    r = sh(server, phone, "echo 3 > /proc/sys/vm/drop_caches", check=False)
    assert r.returncode != 0 and "Permission denied" in r.stderr
    assert sh(server, phone, "taskset f0 echo pinned; nproc; uname -m").stdout.split() == ["pinned", "8", "aarch64"]
    df = sh(server, phone, "df /data").stdout.splitlines()
    assert df[1].split()[-1] == "/data" and int(df[1].split()[3]) > 0


def test_root_user(server: AdbServer, phone_factory: PhoneFactory) -> None:
    phone = phone_factory(root_user=True)
    assert sh(server, phone, "id -u; su -c 'id -u'").stdout.split() == ["0", "0"]
    sh(server, phone, "echo 3 > /proc/sys/vm/drop_caches")
    assert phone.host_path("/proc/sys/vm/drop_caches").read_text().strip() == "3"
    assert "already running as root" in server.adb("-s", phone.serial, "root").stdout


def test_arm64_binary_and_device_script(server: AdbServer, phone: StandIn, tmp_path: Path) -> None:
    native = platform.machine() in ("aarch64", "arm64")
    if shutil.which("aarch64-linux-gnu-gcc") is None and not native:
        pytest.skip("no aarch64-linux-gnu-gcc (apt-get install gcc-aarch64-linux-gnu)")
    if not native and shutil.which("qemu-aarch64") is None:
        pytest.skip("no qemu-aarch64 (apt-get install qemu-user)")
    src = tmp_path / "hello.c"
    src.write_text('#include <stdio.h>\nint main(int argc, char **argv) {\n'
                   '    printf("hello from arm64, argc=%d\\n", argc);\n    return 7;\n}\n')
    cc = "gcc" if native else "aarch64-linux-gnu-gcc"
    subprocess.run([cc, "-static", "-O1", "-o", str(tmp_path / "hello"), str(src)], check=True)
    server.adb("-s", phone.serial, "push", str(tmp_path / "hello"), "/data/local/tmp/hello")
    r = sh(server, phone, "cd /data/local/tmp && $SPX_EMULATOR ./hello a b", check=False)
    assert (r.returncode, r.stdout) == (7, "hello from arm64, argc=3\n")
    # a launcher with the phone's interpreter line starts, as run.sh does on a phone
    script = tmp_path / "run.sh"
    script.write_text('#!/system/bin/sh\nD=$(cd "$(dirname "$0")" && pwd)\nexec $SPX_EMULATOR "$D/hello" "$@"\n')
    script.chmod(0o755)
    server.adb("-s", phone.serial, "push", str(script), "/data/local/tmp/run.sh")
    r = sh(server, phone, "taskset f0 /data/local/tmp/run.sh x", check=False)
    assert (r.returncode, r.stdout) == (7, "hello from arm64, argc=2\n")


def test_full_disk(server: AdbServer, phone_factory: PhoneFactory, tmp_path: Path) -> None:
    phone = phone_factory(faults={"full_disk": True})
    blob = tmp_path / "blob.bin"
    blob.write_bytes(os.urandom(300_000))
    r = server.adb("-s", phone.serial, "push", str(blob), "/data/local/tmp/blob.bin", check=False)
    assert r.returncode != 0
    assert "remote write failed: No space left on device" in r.stdout + r.stderr  # adb 29 prints it on stdout
    assert not phone.host_path("/data/local/tmp/blob.bin").exists()
    df = sh(server, phone, "df /data").stdout.splitlines()[1].split()
    assert df[3] == "0" and df[4] == "100%"
    phone.set_faults(full_disk=False)  # at run time, on the same connection
    server.adb("-s", phone.serial, "push", str(blob), "/data/local/tmp/blob.bin")
    assert phone.host_path("/data/local/tmp/blob.bin").read_bytes() == blob.read_bytes()


def test_disconnect_mid_command(server: AdbServer, phone_factory: PhoneFactory) -> None:
    phone = phone_factory(faults=Faults(disconnect_after_s=0.5, disconnect_match="sleep 30"))
    assert sh(server, phone, "echo quick").stdout == "quick\n"  # does not match: no disconnect
    start = time.monotonic()
    r = sh(server, phone, "echo started; sleep 30; echo finished", check=False, timeout=20)
    assert time.monotonic() - start < 10
    assert r.stdout == "started\n"
    # newer adb clients exit 255 when the device vanishes; adb 29 (Debian's) exits 0 with no exit packet
    assert r.returncode == 255 or (r.returncode == 0 and _client_version() < (34,))
    assert phone.gone
    deadline = time.monotonic() + 3
    while server.devices().get(phone.serial) == "device" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.devices().get(phone.serial) in (None, "offline")
    r = sh(server, phone, "echo again", check=False)
    assert r.returncode != 0 and re.search(r"offline|not found", r.stderr)


def test_unauthorized(server: AdbServer, phone_factory: PhoneFactory) -> None:
    phone = phone_factory(connect_state=None, faults={"unauthorized": True})
    out = server.adb("connect", phone.serial, check=False).stdout
    assert "failed to authenticate" in out
    assert server.devices()[phone.serial] == "unauthorized"
    r = sh(server, phone, "echo hi", check=False)
    assert r.returncode != 0 and "unauthorized" in r.stderr


def test_rewrite_rule_and_fault_checks(tmp_path: Path) -> None:
    phone = StandIn(root=tmp_path / "r")
    root = str(phone.root)
    assert phone.rewrite("cat /proc/meminfo /data/x") == f"cat {root}/proc/meminfo {root}/data/x"
    assert phone.rewrite("--json=/data/local/tmp/r.json") == f"--json={root}/data/local/tmp/r.json"
    assert phone.rewrite("ls /tmp/x/data /database $D/data") == "ls /tmp/x/data /database $D/data"
    assert phone.rewrite("mount | grep ' /data '") == "mount | grep ' /data '"
    assert phone.rewrite("/system/bin/sh -c 'cat /proc/self/mounts'") == f"sh -c 'cat {root}/proc/mounts'"
    with pytest.raises(SpecPrefetchError, match="unknown stand-in fault 'bogus'"):
        StandIn(root=tmp_path / "r", faults={"bogus": True})
    with pytest.raises(SpecPrefetchError, match="disconnect_after_s"):
        StandIn(root=tmp_path / "r", faults={"disconnect_after_s": -1})
    with pytest.raises(SpecPrefetchError, match="no spaces"):
        StandIn(root=tmp_path / "with space")


@pytest.mark.parametrize("port", ["5555", "5585"])
def test_the_standin_refuses_the_emulator_ports(port):
    try:
        r = cli("standin", "--port", port, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"device standin --port {port} started instead of refusing the port")
    one_line_error(r, f"--port {port}: adb looks for emulators on 5555-5585")
    assert r.returncode == 2 and "ready" not in r.stdout


def test_demo_gives_up_on_a_silent_stand_in_and_stops_it(tmp_path):
    """`make demo`'s device flow (toolkit/device/demo.py): a stand-in that never writes its ready line is
    an error after the timeout (not a hang), one that does is found in its output file, and both are
    stopped."""
    import sys

    from toolkit.device.demo import _stop, _wait_ready

    # the children take Ctrl-C as a stand-in does (a pytest-xdist worker passes SIGINT on ignored)
    sigint = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
    log = tmp_path / "silent.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", sigint + "import time; time.sleep(60)"], stdout=out)
    t0 = time.monotonic()
    with pytest.raises(SpecPrefetchError, match="did not start within 1 s"):
        _wait_ready(proc, log, 1.0)
    assert time.monotonic() - t0 < 10
    _stop(proc)
    assert proc.poll() is not None
    log = tmp_path / "ok.log"
    with open(log, "wb") as out:   # the ready line after other output, as a later line
        ok = subprocess.Popen([sys.executable, "-c", sigint + "print('starting'); print('stand-in SM8750 phone ready: "
                               "adb connect x', flush=True); import time; time.sleep(60)"], stdout=out)
    assert _wait_ready(ok, log, 30.0).startswith("stand-in SM8750 phone ready")
    _stop(ok)
    assert ok.poll() is not None
    log = tmp_path / "dies.log"
    with open(log, "wb") as out:   # one that exits first: an error at once, not after the timeout
        dead = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"], stdout=out)
    t0 = time.monotonic()
    with pytest.raises(SpecPrefetchError, match="exit 3"):
        _wait_ready(dead, log, 30.0)
    assert time.monotonic() - t0 < 10


def test_demo_refuses_its_report_inside_the_bundle_before_starting(tmp_path):
    from toolkit.device.demo import demo

    b = tmp_path / "bundle"
    b.mkdir()
    with pytest.raises(SpecPrefetchError, match="input"):
        demo(b, b / "r.json")
