"""Every command answers --help; the CLI entry point is installed."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from toolkit.cli import main

COMMANDS = sorted(main.commands)


def test_commands_present():
    assert {"info", "trace", "tiny"} <= set(COMMANDS)


@pytest.mark.parametrize("cmd", COMMANDS)
def test_help(cmd):
    r = CliRunner().invoke(main, [cmd, "--help"])
    assert r.exit_code == 0 and "Usage:" in r.output


def test_console_script():
    exe = Path(sys.executable).parent / "specprefetch"  # beside the venv's python
    assert exe.exists(), f"{exe} missing (pip install -e . installs it)"
    r = subprocess.run([exe, "--version"], capture_output=True, text=True)
    assert r.returncode == 0 and "specprefetch" in r.stdout


def test_tiny_command(tmp_path):
    r = CliRunner().invoke(main, ["tiny", "olmoe", "--out", str(tmp_path / "m")])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "m" / "model.safetensors").exists()
    r = CliRunner().invoke(main, ["tiny", "llama", "--out", str(tmp_path / "x")])
    assert r.exit_code == 2 and "no tiny config for 'llama'" in r.output
