"""The CLI through click's CliRunner, and the one-line error checks the CLI test files share."""
from __future__ import annotations

from click.testing import CliRunner

from toolkit.cli import main


def cli(*args) -> tuple[int, str]:
    """(exit code, output) of a command; a traceback fails the test."""
    r = CliRunner().invoke(main, [str(a) for a in args])
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise AssertionError(f"traceback: {r.exception!r}\n{r.output}")
    return r.exit_code, r.output


def cli_plain(*args) -> tuple[int, str]:
    """(exit code, output) of a command, whatever ended it (the caller checks the code)."""
    r = CliRunner().invoke(main, [str(a) for a in args])
    return r.exit_code, r.output


def one_error(code: int, output: str, *names: str) -> str:
    """Exit 2 with one `error:` line naming every one of `names`, and no traceback."""
    errors = [ln for ln in output.splitlines() if ln.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in output, output
    for n in names:
        assert n in errors[0], errors[0]
    return errors[0]


def refused(args, *fragments, run=cli) -> str:
    """The command exits 2 with one `error: ...` line holding every fragment, and no traceback."""
    code, out = run(*args)
    lines = [ln for ln in out.replace("\r", "\n").splitlines() if ln.startswith("error: ")]
    assert code == 2, out
    assert len(lines) == 1 and "Traceback" not in out, out
    for f in fragments:
        assert str(f) in lines[0], (f, lines[0])
    return lines[0]
