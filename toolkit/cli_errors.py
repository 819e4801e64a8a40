"""The command line's one-line errors: what a toolkit error, an OS error, a usage error or an
interrupt prints (one `error: ...` line, no traceback) and the exit code it ends with; and the
libraries' messages that are not the user's business, kept off the terminal.

Used by `toolkit.cli` (every verb is wrapped in `friendly_errors`, the command group is `Cli`).
"""
from __future__ import annotations

import errno
import functools
import logging
import os
import sys
import warnings

import click

from toolkit.errors import SpecPrefetchError

# What an OSError means, in a few words, for the one-line message naming its path.
OS_ERRORS = {
    errno.ENOSPC: "no space left on device (disk full)",
    errno.EDQUOT: "disk quota exceeded",
    errno.EFBIG: "file too large (over the file-size limit)",
    errno.EISDIR: "is a directory, a file is needed there",
    errno.ENOTDIR: "is not a directory (a file stands where a directory is needed)",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.ENOENT: "no such file or directory",
    errno.EEXIST: "already exists",
    errno.EROFS: "read-only file system",
    errno.ENAMETOOLONG: "file name too long",
    errno.ENOTEMPTY: "directory not empty",
    errno.EXDEV: "on another file system",
    errno.EMFILE: "too many open files",
    errno.EIO: "input/output error (a failing disk or a lost network mount)",
    errno.ELOOP: "too many levels of symbolic links",
}


def os_error_line(e: OSError) -> str:
    """One line for an OSError: the path(s) it names and what went wrong."""
    what = OS_ERRORS.get(e.errno) or (e.strerror or type(e).__name__).lower()
    paths = [str(p) for p in (e.filename, e.filename2) if p not in (None, "")]
    if not paths:
        return f"{what} ({e})" if str(e) and what not in str(e).lower() else what
    return f"{' -> '.join(paths)}: {what}"


def one_line(text: str) -> str:
    """Any message as one line (a library's multi-line text joined)."""
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())


def _exit_code(e: KeyboardInterrupt) -> int:
    """130 for Ctrl-C; 128 + N for a signal N that toolkit.errors turned into an interrupt."""
    import signal

    name = e.args[0] if e.args and isinstance(e.args[0], str) else ""
    try:
        return 128 + int(signal.Signals[name])
    except KeyError:
        return 130


def friendly_errors(fn=None, *, interrupt: str = "nothing was written"):
    """Turn toolkit errors, OS errors and Ctrl-C (or SIGTERM) into one clear line and a non-zero
    exit, no traceback.

    `interrupt` says what an interrupted command leaves when none of its writers said otherwise
    (they note what they kept or removed on the KeyboardInterrupt; toolkit.errors.interrupted_message);
    it may name the command's options, e.g. "{out} was not written"."""
    def deco(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except SpecPrefetchError as e:
                click.echo(f"error: {one_line(e)}", err=True)
                sys.exit(2)
            except KeyboardInterrupt as e:
                from toolkit.errors import interrupted_message

                try:
                    default = interrupt.format(**{k: v for k, v in kwargs.items() if v is not None})
                except (KeyError, IndexError):
                    default = "nothing was written"
                # on a line of its own: after the terminal's ^C echo or a progress bar left open
                click.echo("\n" + one_line(interrupted_message(e, default)), err=True)
                sys.exit(_exit_code(e))
            except OSError as e:
                if e.errno == errno.EPIPE:  # stdout closed early (| head): click's own handling
                    raise
                click.echo(f"error: {os_error_line(e)}", err=True)
                sys.exit(2)
            except UnicodeError as e:  # a backstop: input files are checked where they are named
                click.echo(f"error: text that is not valid UTF-8 ({one_line(e)})", err=True)
                sys.exit(2)
            finally:
                from toolkit.artifacts import release_report_claims

                release_report_claims()  # the command's claims on its report files end with it
        return wrapper
    return deco(fn) if fn is not None else deco


class OneLineUsage(click.ClickException):
    """A usage error (a bad option value, an unknown option, a missing argument) as one line."""
    exit_code = 2

    def __init__(self, e: click.UsageError):
        path = e.ctx.command_path if e.ctx is not None else "specprefetch"
        super().__init__(f"{one_line(e.format_message())} (see '{path} --help')")

    def show(self, file=None) -> None:
        click.echo(f"error: {self.format_message()}", err=True)


class Cli(click.Group):
    """The command group: usage errors of every command print as one `error: ...` line, exit 2."""

    def make_context(self, *args, **kwargs):
        try:
            return super().make_context(*args, **kwargs)
        except click.exceptions.NoArgsIsHelpError:
            raise
        except click.UsageError as e:
            raise OneLineUsage(e) from None

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except click.exceptions.NoArgsIsHelpError:
            raise
        except click.UsageError as e:
            raise OneLineUsage(e) from None


# Libraries' messages that are not the user's business: torchao's optional kernels it cannot load
# here, torch's pytree deprecation notes, ExecuTorch's thread pool probing, deprecation warnings.
QUIET_LOGGERS = ("torchao", "torch.utils._pytree", "torch._export", "torch.export", "torch.fx.experimental",
                 "executorch", "coremltools")
LIBRARIES = r"(torch|torchao|transformers|executorch|onnx|onnxruntime|onnxscript|accelerate|huggingface_hub|" \
            r"safetensors|tokenizers|coremltools|matplotlib|numpy|qai_hub)(\.|$)"


def quiet_libraries() -> None:
    """Silence what is not the user's business (a user's own -W / PYTHONWARNINGS still wins)."""
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    if sys.warnoptions:
        return
    for category in (DeprecationWarning, PendingDeprecationWarning, FutureWarning):
        warnings.filterwarnings("ignore", category=category)
    warnings.filterwarnings("ignore", category=UserWarning, module=LIBRARIES)


class quiet_native_stderr:
    """Send file descriptor 2 to /dev/null for a block (native libraries' own log lines, e.g.
    ExecuTorch's cpuinfo probing when its thread pool starts). Python's own errors still surface
    after the block: nothing is raised inside it that is not re-raised."""

    def __enter__(self):
        sys.stderr.flush()
        try:
            self.saved = os.dup(2)
            null = os.open(os.devnull, os.O_WRONLY)
        except OSError:
            self.saved = None
            return self
        os.dup2(null, 2)
        os.close(null)
        return self

    def __exit__(self, *exc):
        if self.saved is not None:
            os.dup2(self.saved, 2)
            os.close(self.saved)
        return False
