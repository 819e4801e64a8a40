"""The device flow of `make demo` on a stand-in phone: `device standin`, `device list`, `device push`
and `device bench`, each the real command against the real adb client and a private adb server.

    python -m toolkit.device.demo BUNDLE --json OUT [--abi x86_64|arm64-v8a] [--overwrite]

A private adb server on a free port (its own key, no USB or mDNS scanning: a phone plugged in is
left alone) and a stand-in SM8750 phone on loopback (`specprefetch device standin`, started as its
own process) are started, the phone is connected, and the three commands run as a user types them,
each printed first. Both are stopped at the end, also on an error or Ctrl-C. With `--abi x86_64`
(the default) the stand-in gets this machine's runner build; `arm64-v8a` pushes the arm64 build,
which runs under qemu-aarch64 (slower, the phone's own binary).
"""
from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

from toolkit.device.standin import adb_server, free_port
from toolkit.errors import SpecPrefetchError

PROMPT = "The kernel's memory allocator"
POLICIES = "on-demand+lru,previous-token+lru,adapter+prediction"
READY = "stand-in SM8750 phone ready"


def _cli() -> list[str]:
    return [sys.executable, "-m", "toolkit.cli"]


def _run(args: list[str], env: dict[str, str]) -> None:
    click.echo("$ specprefetch " + shlex.join(args), err=True)
    r = subprocess.run([*_cli(), *args], env=env, stdin=subprocess.DEVNULL, check=False)
    if r.returncode != 0:
        raise SpecPrefetchError(f"specprefetch {args[0]} {args[1]} failed (exit {r.returncode}); its message is above")


def _wait_ready(proc: subprocess.Popen, log: Path, timeout_s: float) -> str:
    """The stand-in's ready line in its output file `log` (it names the serial to connect); an error
    if it exits first or stays silent for `timeout_s` (the caller stops it). Its output goes to a file,
    never a pipe nobody drains, so it can never block writing."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        exited = proc.poll() is not None   # before reading: a line written just before it exited is seen
        text = log.read_text(errors="replace") if log.exists() else ""
        for line in text.splitlines():
            if line.startswith(READY):
                click.echo(line.rstrip(), err=True)
                return line
        if exited:
            break
        time.sleep(0.1)
    raise SpecPrefetchError(f"the stand-in phone did not start within {timeout_s:.0f} s (exit {proc.poll()})")


def _stop(proc: subprocess.Popen) -> None:
    """Ctrl-C to the stand-in, then kill if it does not stop."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def demo(bundle: Path, json_out: Path, *, abi: str = "x86_64", pool_mib: float = 4.0, max_new_tokens: int = 16,
         repeats: int = 1, overwrite: bool = False) -> None:
    from toolkit.artifacts import claim_report

    # the report's place checked before anything starts (`device bench` claims it again when it writes)
    claim_report(json_out, kind="device bench", overwrite=overwrite, inputs=(bundle,))
    with adb_server() as server, tempfile.TemporaryDirectory(prefix="spx-phone-") as root:
        # every adb call of the commands below reaches the private server, never the user's
        env = {k: v for k, v in os.environ.items()
               if k not in ("ANDROID_SERIAL", "ADB_SERVER_SOCKET", "ANDROID_ADB_SERVER_ADDRESS")}
        env["ANDROID_ADB_SERVER_PORT"] = str(server.port)
        port = free_port()
        click.echo(f"$ specprefetch device standin --port {port} --abi {abi} &", err=True)
        log = Path(root) / "standin.log"
        with open(log, "wb") as out:
            phone = subprocess.Popen([*_cli(), "device", "standin", "--port", str(port), "--abi", abi,
                                      "--root", str(Path(root) / "phone")],
                                     env=env, stdin=subprocess.DEVNULL, stdout=out)
        serial = f"127.0.0.1:{port}"
        try:
            _wait_ready(phone, log, 60.0)
            click.echo(f"$ adb connect {serial}", err=True)
            server.connect(serial)
            _run(["device", "list"], env)
            _run(["device", "push", str(bundle), "--serial", serial], env)
            _run(["device", "bench", str(bundle), "--serial", serial, "--policies", POLICIES,
                  "--pool-mib", f"{pool_mib:g}", "--prompt", PROMPT, "--max-new-tokens", str(max_new_tokens),
                  "--repeats", str(repeats), "--cooldown-timeout", "5", "--json", str(json_out),
                  *(["--overwrite"] if overwrite else [])], env)
        finally:
            _stop(phone)   # first: a failing disconnect below must not leave the stand-in running
            with contextlib.suppress(SpecPrefetchError):
                server.adb("disconnect", serial, check=False)


@click.command()
@click.argument("bundle", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--json", "json_out", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="the device bench report (Markdown and PNG beside it)")
@click.option("--abi", default="x86_64", show_default=True, type=click.Choice(["x86_64", "arm64-v8a"]),
              help="the ABI the stand-in reports (arm64-v8a: the arm64 runner under qemu-aarch64)")
@click.option("--pool-mib", type=click.FloatRange(min=0, min_open=True), default=4.0, show_default=True)
@click.option("--max-new-tokens", type=click.IntRange(min=2), default=16, show_default=True)
@click.option("--repeats", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--overwrite", is_flag=True, help="replace an earlier report of `device bench`")
def main(bundle, json_out, abi, pool_mib, max_new_tokens, repeats, overwrite) -> None:
    """The device flow on a stand-in phone (docs/device.md)."""
    try:
        demo(bundle, json_out, abi=abi, pool_mib=pool_mib, max_new_tokens=max_new_tokens, repeats=repeats,
             overwrite=overwrite)
    except SpecPrefetchError as e:
        raise click.ClickException(str(e)) from None


if __name__ == "__main__":
    main()
