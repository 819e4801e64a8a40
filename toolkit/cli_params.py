"""The command line's parameter types, shared options and help texts (the verbs are in `toolkit.cli`).

Every type turns a bad value into a one-line usage error naming the option, before any work: a
number that is nan, inf or out of range, a list with a word in it, text that is not UTF-8, an output
path where a file stands in for a directory (or the reverse), an input text file with a stray byte.
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import click

from toolkit.errors import SpecPrefetchError

class FiniteFloat(click.ParamType):
    """A finite number above `low` (or at least `low` with `inclusive`); a one-line error for nan,
    inf, words or empty text."""
    name = "number"

    def __init__(self, low: float = 0.0, *, inclusive: bool = False, high: float | None = None,
                 unit: str = ""):
        self.low, self.inclusive, self.high, self.unit = low, inclusive, high, unit

    def convert(self, value, param, ctx):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            v = float(value)
        else:
            try:
                v = float(str(value).strip())
            except ValueError:
                self.fail(f"{value!r} is not a number", param, ctx)
        if not math.isfinite(v) or v < self.low or (v == self.low and not self.inclusive):
            self.fail(f"{value!r}: must be a finite number {'>=' if self.inclusive else 'above'} {self.low:g}",
                      param, ctx)
        if self.high is not None and v > self.high:
            self.fail(f"{value!r}: too large: at most {self.high:g}{self.unit}", param, ctx)
        return v


class FloatList(click.ParamType):
    """Comma-separated finite positive numbers, e.g. 4,8,16 (each checked as `item`)."""
    name = "list"

    def __init__(self, item: FiniteFloat | None = None):
        self.item = item or FiniteFloat()

    def convert(self, value, param, ctx):
        if isinstance(value, list):
            return value
        items = [x for x in str(value).split(",") if x.strip()]
        if not items:
            self.fail(f"{value!r}: expected comma-separated numbers", param, ctx)
        return [self.item.convert(x, param, ctx) for x in items]


class ImageSize(click.ParamType):
    """HEIGHTxWIDTH in pixels, e.g. 448x448 (returned as a (height, width) tuple)."""
    name = "HxW"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        parts = str(value).lower().split("x")
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts) or min(int(p) for p in parts) < 1:
            self.fail(f"{value!r}: expected HEIGHTxWIDTH in pixels, e.g. 448x448", param, ctx)
        h, w = (int(p) for p in parts)
        if max(h, w) > 8192:
            self.fail(f"{value!r}: too large: at most 8192 pixels a side", param, ctx)
        return h, w


class IntOrAuto(click.ParamType):
    """A whole number of at least `low`, or the word auto (returned as the string "auto"); with `off`,
    also the word off (returned as "off")."""

    def __init__(self, low: int = 1, off: bool = False):
        self.low, self.words = low, ("auto", "off") if off else ("auto",)
        self.name = "integer|" + "|".join(self.words)

    def convert(self, value, param, ctx):
        if isinstance(value, int) or value in self.words:
            return value
        try:
            n = int(str(value))
        except ValueError:
            self.fail(f"{value!r}: expected a whole number or {' or '.join(self.words)}", param, ctx)
        if n < self.low:
            self.fail(f"{n}: must be at least {self.low} (or {' or '.join(self.words)})", param, ctx)
        return n


class IntList(click.ParamType):
    """Comma-separated whole numbers of at least `low`, e.g. 1,2,4."""
    name = "list"

    def __init__(self, low: int = 1):
        self.low = low

    def convert(self, value, param, ctx):
        if isinstance(value, (list, tuple)):
            return list(value)
        items = [x.strip() for x in str(value).split(",") if x.strip()]
        try:
            out = [int(x) for x in items]
        except ValueError:
            out = []
        if not out or min(out) < self.low:
            self.fail(f"{value!r}: expected comma-separated whole numbers >= {self.low}", param, ctx)
        return out


class Text(click.ParamType):
    """Text that is valid UTF-8 (a prompt): bytes that are not are a one-line error, not a
    traceback deep in the tokenizer or the JSON writer."""
    name = "text"

    def convert(self, value, param, ctx):
        try:
            str(value).encode("utf-8")
        except UnicodeEncodeError:
            self.fail(f"{ascii(value)} is not valid UTF-8 text", param, ctx)
        return value


class OutPath(click.Path):
    """An output path: a file where a directory is meant or the reverse is a one-line error, and so
    is a file standing where one of its parent directories should be, before any work is done."""

    def convert(self, value, param, ctx):
        path = super().convert(value, param, ctx)
        for parent in Path(path).absolute().parents:
            if parent.exists():
                if not parent.is_dir():
                    self.fail(f"{parent} is a file, not a directory, so {value!s} cannot be written", param, ctx)
                break
        return path


class TextFile(click.Path):
    """An input text file (.txt / .jsonl): it must exist, be a file and be UTF-8, checked here in one
    streaming pass so that a stray byte is a one-line error naming the file and the offset."""

    def __init__(self):
        super().__init__(exists=True, dir_okay=False, path_type=Path)

    def convert(self, value, param, ctx):
        import codecs

        from toolkit.traces.data import open_input

        path = super().convert(value, param, ctx)
        dec, offset = codecs.getincrementaldecoder("utf-8")(), 0
        try:
            with open_input(path, "") as f:  # a regular file of bounded size: a FIFO or /dev/zero is refused unread
                while chunk := f.read(1 << 20):
                    try:
                        dec.decode(chunk)
                    except UnicodeDecodeError as e:
                        self.fail(f"{path}: not UTF-8 text (byte {offset + e.start}: {e.reason})", param, ctx)
                    offset += len(chunk)
                dec.decode(b"", final=True)
        except UnicodeDecodeError as e:
            self.fail(f"{path}: not UTF-8 text (it ends inside a character: {e.reason})", param, ctx)
        except SpecPrefetchError as e:
            self.fail(str(e), param, ctx)
        except OSError as e:
            self.fail(f"{path}: cannot read it ({e.strerror or e})", param, ctx)
        return path


# A pool in MiB: finite, above 0, and at most 1e9 MiB (about a PiB: its bytes fit a signed 64-bit
# integer with room to spare, and the native runner takes it; a pool past every expert's bytes simply
# holds them all, so no real pool is refused)
MAX_POOL_MIB = 1e9
POOL_MIB = FiniteFloat(high=MAX_POOL_MIB, unit=" MiB")
POOL_MIB_LIST = FloatList(POOL_MIB)


class PoolMibOrAuto(click.ParamType):
    """`run --pool-mib`: a budget in MiB, or `auto` (the native engine sizes its pool from the memory
    available to it and shrinks it when that runs low: docs/runner.md, "Pool size: auto")."""
    name = "MiB|auto"

    def convert(self, value, param, ctx):
        if isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        return POOL_MIB.convert(value, param, ctx)


POOL_MIB_OR_AUTO = PoolMibOrAuto()
POOL_AUTO_MIB = FiniteFloat(inclusive=True, high=MAX_POOL_MIB, unit=" MiB")
# Generated tokens a timed comparison with the simulator needs: the bench prompts are traced with
# one token fewer as decode tokens, and the simulator times sequences of two or more of them
MIN_TIMED_TOKENS = 3
OUT_FILE = OutPath(dir_okay=False, path_type=Path)  # an output file: a directory there is a one-line error
OUT_DIR = OutPath(file_okay=False, path_type=Path)  # an output directory: a file there is a one-line error
WINDOW_HELP = ("prefetch window: MoE layers planned ahead (one step is one MoE layer of one token; the window "
               "crosses into the next token), 1..the model's MoE layers")
NOT_WRITTEN = "{json_out} was not written"
NOTHING_TO_OUT = "nothing was written to {out}"
OVERWRITE_REPORT = ("replace an existing report at --json (and its .md/.png) if this command wrote it; "
                    "nothing else is ever replaced")


def budget_or_none(v):
    """--read-budget-kib's value as the engines take it: off is None (no budget); a number and auto as given."""
    return None if v == "off" else v


def scheduler_limits(fn):
    """The scheduler's flash-saturation limits, shared by `simulate` and `run`."""
    fn = click.option("--read-budget-kib", type=IntOrAuto(off=True), default=None,
                      help="KiB the flash reads in one step's compute time: a prefetch that could not land by its "
                           "deadline behind the prefetches already asked for is dropped as late. run on the CPU: "
                           "auto by default (the flash's rate measured at start-up x each step's compute time, "
                           "measured as the run goes; docs/runtime.md); simulate: off by default, auto is the "
                           "profile's flash rate x its decode step; on the GPU tier (off by default) the KiB its "
                           "copies deliver per layer step")(fn)
    fn = click.option("--step-budget-kib", type=click.IntRange(min=1), default=None,
                      help="prefetch bytes issued per step at most")(fn)
    return click.option("--min-confidence", type=click.FloatRange(0, 1), default=0.02, show_default=True,
                        help="when flash is saturated, drop queued prefetches below this predicted probability")(fn)


REPORT_JSON_HELP = "JSON report; the Markdown table and PNG plot go beside it"


def json_report(fn):
    """--json R (required; R.md and R.png beside it) and --overwrite: the report options of every verb
    that writes a table and a plot (eval, simulate, eviction-bounds, the benches)."""
    fn = click.option("--overwrite", is_flag=True, help=OVERWRITE_REPORT)(fn)
    return click.option("--json", "json_out", required=True, type=OUT_FILE, help=REPORT_JSON_HELP)(fn)


def bench_runs(new_tokens_help: str | None = None):
    """--prompts, --new-tokens and --rounds: the size of a run of `bench cpu`, `bench gpu` and `bench llama.cpp`."""
    def deco(fn):
        fn = click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True,
                          help="interleaved rounds after a warm-up")(fn)
        fn = click.option("--new-tokens", type=click.IntRange(min=2), default=48, show_default=True,
                          help=new_tokens_help or "tokens per prompt")(fn)
        return click.option("--prompts", type=click.IntRange(min=1), default=4, show_default=True,
                            help="prompts: held-out documents of the embedded corpus")(fn)
    return deco


def device_name(value: str, param) -> str:
    """cpu, cuda or cuda:N (a one-line usage error otherwise): a `--device` callback."""
    if not re.fullmatch(r"cpu|cuda(:\d+)?", value or ""):
        raise click.BadParameter(f"{value!r}: expected cpu, cuda or cuda:N", param=param)
    return value


def cuda_device(value: str, param) -> str:
    """cuda or cuda:N (a one-line usage error otherwise): `bench gpu --device`."""
    if not re.fullmatch(r"cuda(:\d+)?", value or ""):
        raise click.BadParameter(f"{value!r}: expected cuda or cuda:N", param=param)
    return value


def ctx_default(ctx, name: str) -> bool:
    """Whether option `name` kept its default (was not given)."""
    return ctx.get_parameter_source(name) == click.core.ParameterSource.DEFAULT


def int_tuple(text: str, option: str) -> tuple[int, ...]:
    """Comma-separated integers given as text (--horizons, --draft-k), or a one-line error."""
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise SpecPrefetchError(f"{option} {text!r}: expected comma-separated integers") from None
