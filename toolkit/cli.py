"""The `specprefetch` command line: one verb per pipeline stage, nothing else lives here.

    specprefetch info MODEL                 geometry and expert bytes of a MoE checkpoint
    specprefetch trace MODEL --data F       routing traces for adapter training and evaluation
    specprefetch train TRACES --out A       the prefetch adapter (and its reuse table) on the frozen model
    specprefetch eval TRACES --json R       recall@k / budget recall of every predictor, per horizon
    specprefetch store MODEL --out S        the expert store (fp16 / int8 / int4), 4 KiB-aligned
    specprefetch simulate TRACES            policies replayed on virtual-time flash (TPOT, TTFT) per pool
    specprefetch eviction-bounds TRACES     bytes read per token for every eviction rule, Belady included
    specprefetch calibrate MODEL            a device profile measured from this machine's reads
    specprefetch run MODEL|BUNDLE           one generation through the pool (--engine python|native, --device cuda)
    specprefetch bench MODEL                policies side by side, interleaved (--peer llama.cpp, --device cuda)
    specprefetch export MODEL --out B       a phone-ready bundle (ExecuTorch / QNN / AI Hub), parity-checked
    specprefetch inspect BUNDLE             validate a bundle and summarise it
    specprefetch runner build|bench BUNDLE  the native C++ runner: build (host, arm64, android), bench
    specprefetch device list|push|standin|bench   a phone over adb, or the loopback stand-in phone
    specprefetch tiny FAMILY --out DIR      a tiny random checkpoint of a family, for trying things
    specprefetch widen MODEL --moe-intermediate-size N --out DIR   wider experts, same function

MODEL may be `embedded` for the embedded default model or `phone` for the phone-class model.
"""
from __future__ import annotations

import errno
import functools
import json
import logging
import math
import os
import sys
import warnings
from pathlib import Path

import click

from toolkit import __version__
from toolkit.engines import fmt
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


def _inputs(*paths) -> list[Path]:
    """A command's inputs that exist, as paths (`embedded` / `phone`: the shipped model's directory):
    what its outputs must never be, nor lie inside."""
    from toolkit.models.loader import resolve_model_dir

    out: list[Path] = []
    for p in paths:
        if p is None:
            continue
        if isinstance(p, (list, tuple)):
            out += _inputs(*p)
            continue
        q = resolve_model_dir(p) if isinstance(p, str) else Path(p)
        if q.exists():
            out.append(q)
    return out


def claim(out, kind: str, overwrite: bool, inputs=(), option: str = "--json", siblings=None, beside=()):
    """Claim a report file before any work (toolkit.artifacts.claim_report): the rule for every
    --json, --events and profile --out; `kind` is the command that writes it."""
    from toolkit.artifacts import REPORT_SIBLINGS, claim_report

    return claim_report(out, kind=kind, overwrite=overwrite, inputs=_inputs(*inputs), option=option,
                        siblings=REPORT_SIBLINGS if siblings is None else siblings, beside=beside)


def wrote(*claims) -> str:
    """`wrote A, B, C`: the files the claims wrote (a FIFO or /dev/null: the JSON alone)."""
    return "wrote " + ", ".join(str(f) for c in claims if c is not None for f in c.files())


def scheduler_limits(fn):
    """The scheduler's flash-saturation limits, shared by `simulate` and `run`."""
    fn = click.option("--step-budget-kib", type=click.IntRange(min=1), default=None,
                      help="prefetch bytes issued per step at most")(fn)
    return click.option("--min-confidence", type=click.FloatRange(0, 1), default=0.02, show_default=True,
                        help="when flash is saturated, drop queued prefetches below this predicted probability")(fn)


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


@click.group(cls=Cli, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="specprefetch")
def main() -> None:
    """Predict and prefetch Mixture-of-Experts experts from flash into a bounded DRAM pool."""
    from toolkit.errors import install_signal_handlers

    quiet_libraries()
    install_signal_handlers()  # SIGTERM and SIGHUP end a command as Ctrl-C does (same cleanup, same message)


@main.command()
@click.argument("model", default="embedded")
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of a summary")
@friendly_errors(interrupt="nothing was written")
def info(model: str, as_json: bool) -> None:
    """Family, layers, experts, top-k and expert bytes (fp16/int8/int4) of MODEL.

    MODEL is a Hugging Face checkpoint directory (config.json + safetensors) or `embedded`.
    A directory with config.json alone is accepted: sizes then come from the config.
    """
    from toolkit.models.info import info as model_info, render

    d = model_info(model)
    click.echo(json.dumps(d, indent=1) if as_json else render(d))


@main.command()
@click.argument("model", default="embedded")
@click.option("--data", "data", multiple=True, required=True, type=TextFile(),
              help=".txt or .jsonl file ({\"text\": ..., \"image\": ...} per line); repeatable")
@click.option("--out", required=True, type=OUT_DIR, help="trace directory to write")
@click.option("--prompt-tokens", type=click.IntRange(min=1), default=256, show_default=True, help="tokens per prompt")
@click.option("--decode-tokens", type=click.IntRange(min=0), default=32, show_default=True,
              help="greedy decode steps per prompt")
@click.option("--max-sequences", type=click.IntRange(min=1), default=None,
              help="stop after this many prompts [default: every prompt in --data]")
@click.option("--probs-top-m", type=click.IntRange(min=1), default=None,
              help="keep only the top-m router probabilities (default: all up to 256 experts, else 64)")
@click.option("--hidden-sample", type=click.FloatRange(0, 1), default=1.0, show_default=True,
              help="share of prefill tokens whose router input is stored (decode tokens: always)")
@click.option("--heldout-frac", type=click.FloatRange(0, 1, max_open=True), default=0.1, show_default=True,
              help="share of prompts held out")
@click.option("--seed", default=0, show_default=True)
@click.option("--shard-tokens", type=click.IntRange(min=1), default=16384, show_default=True, help="tokens per shard")
@click.option("--device", default="cpu", show_default=True,
              help="cpu, cuda, cuda:N, or auto (spread over all GPUs with accelerate)")
@click.option("--dtype", default="float32", show_default=True, help="float32, bfloat16 or float16")
@click.option("--batch", type=click.IntRange(min=1), default=None,
              help="prompts per forward pass [default: 1 on cpu, 16 on a GPU]")
@click.option("--overwrite", is_flag=True, help="replace an existing --out (only once the new trace is complete)")
@friendly_errors(interrupt=NOTHING_TO_OUT)
def trace(model, data, out, prompt_tokens, decode_tokens, max_sequences, probs_top_m,
          hidden_sample, heldout_frac, seed, shard_tokens, device, dtype, batch, overwrite) -> None:
    """Record routing traces of MODEL over text (and images) in prefill and greedy decode.

    Per token and MoE layer: selected experts and weights, the router's probability vector and
    its input hidden state. Interrupted runs resume when the same command is run again.
    """
    from toolkit.traces.capture import TraceSettings, run_trace
    from toolkit.traces.format import TraceReader

    s = TraceSettings(prompt_tokens=prompt_tokens, decode_tokens=decode_tokens,
                      max_sequences=max_sequences, probs_top_m=probs_top_m,
                      hidden_sample=hidden_sample, heldout_frac=heldout_frac, seed=seed,
                      shard_tokens=shard_tokens, device=device, dtype=dtype, batch=batch)
    path = run_trace(model, list(data), out, s, overwrite=overwrite)
    m = TraceReader(path).manifest
    t = m["tokens"]
    click.echo(f"wrote {path}: {len(m['shards'])} shards; train {t['train']['total']} tokens "
               f"({t['train']['decode']} decode), held-out {t['heldout']['total']} tokens "
               f"({t['heldout']['decode']} decode)")


def _ints(text: str, option: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise SpecPrefetchError(f"{option} {text!r}: expected comma-separated integers") from None


@main.command()
@click.argument("traces", type=click.Path(path_type=Path))
@click.option("--out", required=True, type=OUT_DIR, help="adapter directory to write")
@click.option("--model", default=None, help="model directory (default: the one the trace records)")
@click.option("--rank", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--horizons", default="1,2", show_default=True, help="MoE layers ahead, 1..4")
@click.option("--cross-token/--no-cross-token", default=True, show_default=True,
              help="let the last layers predict the next token's first layers")
@click.option("--horizon-weights", default=None,
              help="loss weight per horizon, e.g. '1:2,2:1' (default 2 for h=1, 1 otherwise)")
@click.option("--topk-weight", type=FiniteFloat(0.0, inclusive=True), default=0.0, show_default=True,
              help="weight of the top-k ranking term")
@click.option("--steps", type=click.IntRange(min=1), default=3000, show_default=True)
@click.option("--batch-size", type=click.IntRange(min=1), default=512, show_default=True)
@click.option("--lr", type=FiniteFloat(), default=3e-3, show_default=True)
@click.option("--val-every", type=click.IntRange(min=1), default=100, show_default=True,
              help="validate every this many steps")
@click.option("--patience", type=click.IntRange(min=1), default=6, show_default=True,
              help="validations without improvement before stopping")
@click.option("--seed", default=0, show_default=True)
@click.option("--device", default="cpu", show_default=True, help="cpu or cuda")
@click.option("--max-memory-mb", type=click.IntRange(min=1), default=512, show_default=True,
              help="trace shards held in memory at once")
@click.option("--overwrite", is_flag=True,
              help="replace an existing adapter at --out (only once the new one is complete)")
@friendly_errors(interrupt=NOTHING_TO_OUT)
def train(traces, out, model, rank, horizons, cross_token, horizon_weights, topk_weight, steps,
          batch_size, lr, val_every, patience, seed, device, max_memory_mb, overwrite) -> None:
    """Train the prefetch adapter on TRACES (a `trace` directory): a rank-r correction of each
    future layer's router, KL to the real routing, backbone frozen."""
    from adapters.train import TrainConfig, train_adapter

    hw = None
    if horizon_weights:
        try:
            hw = {int(a): float(b) for a, b in (x.split(":") for x in horizon_weights.split(","))}
        except ValueError:
            raise SpecPrefetchError(f"--horizon-weights {horizon_weights!r}: expected H:W,H:W") from None
    cfg = TrainConfig(rank=rank, horizons=_ints(horizons, "--horizons"), cross_token=cross_token,
                      horizon_weights=hw, topk_weight=topk_weight, steps=steps, batch_size=batch_size,
                      lr=lr, val_every=val_every, patience=patience, seed=seed, device=device,
                      max_memory_mb=max_memory_mb)
    try:
        r = train_adapter(traces, out, cfg, model=model, overwrite=overwrite)
    except ValueError as e:
        raise SpecPrefetchError(f"train: {e}") from None
    v = r["validation"]
    click.echo(f"wrote {out}: {r['params']:,} parameters ({100 * r['share_of_model']:.2f}% of the model), "
               f"best step {r['training']['best_step']}")
    for h in v["adapter"]["recall_at_k"]:
        click.echo(f"  validation recall@k h={h}: next-gate {fmt(v['next_gate']['recall_at_k'].get(h), '.3f')} -> "
                   f"adapter {fmt(v['adapter']['recall_at_k'][h], '.3f')}")


@main.command(name="eval")
@click.argument("traces", type=click.Path(path_type=Path))
@click.option("--adapter", type=click.Path(path_type=Path), default=None, help="adapter directory")
@click.option("--predictors", default=None,
              help="comma-separated: next-gate,fate,frequency,previous-token,adapter,draft,oracle "
                   "(default: all; adapter only with --adapter)")
@click.option("--model", default=None, help="model directory (default: the one the trace records)")
@click.option("--horizons", default=None, help="default: the adapter's, else 1,2")
@click.option("--budget", type=click.IntRange(min=1), default=None, help="candidate budget M (default 2k)")
@click.option("--draft-bits", type=click.IntRange(2, 8), default=4, show_default=True,
              help="bits of the draft's routed experts")
@click.option("--json", "json_out", required=True, type=OUT_FILE,
              help="JSON report; the Markdown table and PNG plot go beside it")
@click.option("--overwrite", is_flag=True, help=OVERWRITE_REPORT)
@friendly_errors(interrupt=NOT_WRITTEN)
def eval_cmd(traces, adapter, predictors, model, horizons, budget, draft_bits, json_out, overwrite) -> None:
    """Recall@k, recall/precision within a budget, per-layer curves for each predictor on the
    held-out decode tokens of TRACES."""
    c = claim(json_out, "eval", overwrite, inputs=(traces, adapter, model))
    from toolkit.predictors.evaluate import ALL, evaluate, markdown, write_reports

    names = [p.strip() for p in predictors.split(",")] if predictors else [
        p for p in ALL if p != "adapter" or adapter is not None]
    r = evaluate(traces, predictors=names, adapter=adapter, model=model,
                 horizons=_ints(horizons, "--horizons") if horizons else None, budget=budget,
                 draft_bits=draft_bits)
    write_reports(r, json_out)
    click.echo(markdown(r))
    click.echo(wrote(c))


@main.command()
@click.argument("model", default="embedded")
@click.option("--out", required=True, type=OUT_FILE, help="expert store file to write")
@click.option("--dtype", default="fp16", show_default=True, type=click.Choice(["fp16", "int8", "int4"]))
@click.option("--overwrite", is_flag=True,
              help="replace an existing expert store at --out (only once the new one is complete)")
@friendly_errors(interrupt=NOTHING_TO_OUT)
def store(model, out, dtype, overwrite) -> None:
    """Write MODEL's routed experts into one 4 KiB-aligned expert store file (docs/expert-store.md)."""
    from toolkit.models.loader import inspect_model_dir
    from toolkit.runtime.expert_store import ExpertStore, build_store

    path = build_store(inspect_model_dir(model), out, dtype, overwrite=overwrite)
    st = ExpertStore(path)
    click.echo(f"wrote {path}: {len(st.entries)} experts of {st.blob_size:,} B ({dtype}), "
               f"{path.stat().st_size / 2**20:.1f} MiB")


@main.command()
@click.argument("traces", type=click.Path(path_type=Path))
@click.option("--policies", "--predictor", "policies",
              default="on-demand+lru,previous-token+lru,next-gate+prediction,adapter+prediction,oracle+belady",
              show_default=True,
              help="comma-separated PREDICTOR+EVICTION (eviction: lru, lfu, prediction, belady, reuse)")
@click.option("--adapter", type=click.Path(path_type=Path), default=None)
@click.option("--profile", default="snapdragon-8-elite", show_default=True,
              help="snapdragon-8-elite, snapdragon-8-elite-npu (prefill on the NPU), this-machine (after "
                   "calibrate), or a profile JSON file")
@click.option("--pool-mib", type=POOL_MIB_LIST, default="8", show_default=True, help="pool budget; comma list to sweep")
@click.option("--window", "windows", type=IntList(1), default="2", show_default=True,
              help=WINDOW_HELP + "; a comma list sweeps")
@click.option("--queue-depth", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--dtype", default="fp16", show_default=True, type=click.Choice(["fp16", "int8", "int4"]))
@click.option("--geometry", default=None, help="config.json directory whose sizes to use (routing stays the trace's)")
@click.option("--split", default="heldout", show_default=True, type=click.Choice(["heldout", "train"]))
@click.option("--max-sequences", type=click.IntRange(min=1), default=None)
@click.option("--prompt-tokens", type=click.IntRange(min=0), default=0, show_default=True,
              help="also project TTFT for a prompt of this many positions (the split's prompts laid end to end; "
                   "needs a profile with a prefill rate); 0: decode only")
@scheduler_limits
@click.option("--json", "json_out", required=True, type=OUT_FILE,
              help="JSON report; the Markdown table and PNG plot go beside it")
@click.option("--overwrite", is_flag=True, help=OVERWRITE_REPORT)
@friendly_errors(interrupt=NOT_WRITTEN)
def simulate(traces, policies, adapter, profile, pool_mib, windows, queue_depth, dtype, geometry, split,
             max_sequences, prompt_tokens, min_confidence, step_budget_kib, json_out, overwrite) -> None:
    """Replay TRACES through the pool and scheduler against a device profile: TPOT, stall, hit
    rate, MiB read and wasted prefetch per policy; sweeps give a table and plots."""
    from toolkit.runtime.profiles import profile_dir

    c = claim(json_out, "simulate", overwrite,
              inputs=(traces, adapter, geometry, Path(profile), profile_dir() / f"{profile}.json"))
    from toolkit.runtime.policy import parse_policies
    from toolkit.runtime.profiles import load_profile
    from toolkit.simulate.report import markdown, sweep, write_sweep

    r = sweep(traces, policies=parse_policies(policies), profile=load_profile(profile), pools=pool_mib,
              windows=windows, queue_depth=queue_depth, dtype=dtype, geometry=geometry, adapter=adapter,
              split=split, max_sequences=max_sequences, min_confidence=min_confidence,
              step_budget_kib=step_budget_kib, prompt_tokens=prompt_tokens)
    write_sweep(r, json_out)
    click.echo(markdown(r))
    click.echo(wrote(c))


@main.command("eviction-bounds")
@click.argument("traces", type=click.Path(path_type=Path))
@click.option("--pool-frac", "pool_fracs", type=FloatList(FiniteFloat(high=1.0)), default="0.13,0.27",
              show_default=True,
              help="pools as shares of all experts (comma list)")
@click.option("--max-sequences", type=click.IntRange(min=1), default=None, help="held-out sequences to replay")
@click.option("--json", "json_out", required=True, type=OUT_FILE,
              help="JSON report; the Markdown table and PNG plot go beside it")
@click.option("--overwrite", is_flag=True, help=OVERWRITE_REPORT)
@friendly_errors(interrupt=NOT_WRITTEN)
def eviction_bounds_cmd(traces, pool_fracs, max_sequences, json_out, overwrite) -> None:
    """Reads per decode token on TRACES' routing for LRU, the reuse eviction and Belady's rule knowing
    the future only so far (the current token, the next token, everything): how much of the oracle's
    eviction a causal engine can reach (docs/runtime.md)."""
    c = claim(json_out, "eviction-bounds", overwrite, inputs=(traces,))
    from toolkit.reporting import write_report
    from toolkit.simulate.bounds import eviction_bounds, markdown, plot

    r = eviction_bounds(traces, pool_fracs, max_sequences=max_sequences, progress=lambda m: click.echo(m, err=True))
    write_report(r, json_out, markdown, plot)
    click.echo(markdown(r))
    click.echo(wrote(c))


@main.command()
@click.argument("model", default="embedded")
@click.option("--store", "store_path", type=click.Path(path_type=Path), default=None,
              help="expert store (default: built once into ~/.cache/specprefetch/stores)")
@click.option("--reads", type=click.IntRange(min=1), default=200, show_default=True, help="reads per measured point")
@click.option("--out", type=OUT_FILE, default=None,
              help="profile JSON [default: the profile cache, where `this-machine` is found; replaced there]")
@click.option("--overwrite", is_flag=True, help="replace an existing device profile at --out (nothing else)")
@friendly_errors(interrupt="the profile was not written")
def calibrate(model, store_path, reads, out, overwrite) -> None:
    """Measure this machine (O_DIRECT expert reads by queue depth, runtime compute per layer and
    expert) into the `this-machine` device profile."""
    import tempfile

    from toolkit.reporting import write_json_report
    from toolkit.simulate.calibrate import calibrate as run_calibrate

    if out is None:  # the cache: each calibration replaces the last
        prof, path = run_calibrate(model, store=store_path, reads=reads)
    else:
        claim(out, "profile", overwrite, inputs=(model, store_path), option="--out", siblings=())
        with tempfile.TemporaryDirectory() as tmp:  # measured first; --out written by the claim's rule
            prof, _ = run_calibrate(model, store=store_path, reads=reads, out=Path(tmp) / "profile.json")
        path = write_json_report(out, prof.to_json())
    click.echo(json.dumps(prof.to_json(), indent=1))
    click.echo(f"wrote {path}")


@main.command()
@click.argument("model", default="embedded")
@click.option("--policy", default="adapter+prediction", show_default=True,
              help="PREDICTOR+EVICTION: on-demand, next-gate, fate, previous-token, frequency, adapter, draft "
                   "or oracle; lru, lfu, prediction, belady or reuse")
@click.option("--adapter", type=click.Path(path_type=Path), default=None,
              help="prefetch adapter (model directories; a bundle carries its own heads)")
@click.option("--frequency-trace", type=click.Path(path_type=Path), default=None,
              help="trace whose expert counts drive the frequency policy")
@click.option("--pool-mib", type=POOL_MIB_OR_AUTO, default=None,
              help="pool budget in MiB [default: a bundle's own default, else 8]; auto (--engine native): sized "
                   "from the available memory, shrunk when it runs low")
@click.option("--pool-reserve-mib", type=POOL_AUTO_MIB, default=None,
              help="--pool-mib auto: memory left free [default: 512, or a quarter of the available memory when "
                   "that is under 2 GiB]")
@click.option("--pool-low-watermark-mib", type=POOL_AUTO_MIB, default=None,
              help="--pool-mib auto: the pool shrinks when the available memory falls under this [default: half "
                   "the reserve]")
@click.option("--window", type=click.IntRange(min=1), default=2, show_default=True,
              help=WINDOW_HELP + " (a bundle: the one it was exported with, unless given)")
@click.option("--queue-depth", type=click.IntRange(min=1), default=4, show_default=True,
              help="prefetch reads in flight at most (a bundle: its exported setting, unless given)")
@click.option("--store", "store_path", type=click.Path(path_type=Path), default=None,
              help="an existing expert store (model directories; default: built once into the cache)")
@click.option("--dtype", default=None, type=click.Choice(["fp16", "int8", "int4"]),
              help="precision of the store built for a model directory [default: fp16]; with --store or a bundle "
                   "it must be that store's")
@click.option("--device", default="cpu", show_default=True, callback=lambda c, p, v: _device(v, p),
              help="cpu, or cuda / cuda:N: the GPU tier (experts in pinned host memory, the pool in GPU memory; "
                   "docs/gpu-tier.md)")
@click.option("--flash-profile", default=None, help="pace real reads to this device profile (emulated)")
@click.option("--draft-k", type=click.IntRange(min=1), default=8, show_default=True,
              help="--device cuda with the draft policy: tokens the draft proposes per round (`bench --device cuda` "
                   "picks it by profiling)")
@click.option("--prompt", "prompts", type=Text(), multiple=True, required=True,
              help="repeatable; one JSON `runs` entry each")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--max-seq", type=click.IntRange(min=2), default=512, show_default=True,
              help="KV cache length of a model directory's graphs")
@click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True,
              help="compute threads: torch's, and ExecuTorch's thread pool for a bundle's graphs (the rest "
                   "serve I/O)")
@click.option("--io", "io_mode", default="process", show_default=True, type=click.Choice(["process", "threads"]),
              help="reads in a forked reader process, or in threads of this process")
@click.option("--prefill-chunk", default=None, metavar="N|off",
              help="feed the prompt in chunks of up to N positions through a bundle's prefill methods, or off "
                   "(one position at a time) [default: the bundle's largest chunk]")
@click.option("--check/--no-check", default=None,
              help="compare the tokens with the unmodified model's own generate (loads all its weights) "
                   "[default: on for the shipped models, embedded and phone, only]")
@click.option("--events", "events_out", type=OUT_FILE, default=None,
              help="write every scheduler and pool decision here (docs/runtime.md)")
@scheduler_limits
@click.option("--engine", default="python", show_default=True, type=click.Choice(["python", "native"]),
              help="the Python reference runner, or the native C++ runner (ExecuTorch bundles; docs/runner.md)")
@click.option("--abi", default="host", show_default=True, type=click.Choice(["host", "arm64"]),
              help="--engine native: this machine's build, or the arm64 build (under qemu-aarch64 on x86-64)")
@click.option("--json", "json_out", required=True, type=OUT_FILE,
              help='{"specprefetch_report": "run", "policy": ..., "runs": [one per --prompt], "peak_rss_bytes": ...} '
                   '(docs/runtime.md)')
@click.option("--overwrite", is_flag=True,
              help="replace an existing --json report and --events log if this command wrote them; nothing else "
                   "is ever replaced")
@friendly_errors(interrupt=NOT_WRITTEN)
def run(model, policy, adapter, frequency_trace, pool_mib, pool_reserve_mib, pool_low_watermark_mib, window,
        queue_depth, store_path, dtype, device, flash_profile, draft_k, prompts, max_new_tokens, max_seq, threads,
        io_mode, prefill_chunk, check, events_out, min_confidence, step_budget_kib, engine, abi, json_out,
        overwrite) -> None:
    """Run MODEL (a model directory, `embedded`, or a bundle) with its experts streamed from the
    expert store through a bounded pool (real O_DIRECT reads); prints each prompt's generated text
    and figures; with --check, compare the tokens with the unmodified model."""
    inputs = (model, adapter, frequency_trace, store_path, Path(flash_profile) if flash_profile else None)
    chunk = None
    if prefill_chunk is not None:
        v = prefill_chunk.strip().lower()
        if v != "off" and not (v.isdigit() and int(v) >= 1):
            raise SpecPrefetchError(f"--prefill-chunk {prefill_chunk}: a chunk size (a positive integer) or off")
        chunk = 0 if v == "off" else int(v)
    if pool_mib == "auto" and (engine != "native" or device != "cpu"):
        raise SpecPrefetchError("--pool-mib auto: only with --engine native (the Python reference runner's pool "
                                "has a fixed size; give --pool-mib F)")
    if pool_mib != "auto" and (pool_reserve_mib is not None or pool_low_watermark_mib is not None):
        raise SpecPrefetchError(f"--{'pool-reserve-mib' if pool_reserve_mib is not None else 'pool-low-watermark-mib'}"
                                ": only with --pool-mib auto")
    c = claim(json_out, "run", overwrite, inputs=inputs, siblings=())
    if events_out:
        claim(events_out, "events", overwrite, inputs=inputs, option="--events", siblings=(), beside=(c,))
    if device != "cpu":
        ctx = click.get_current_context()
        ignored = [o for o in ("queue_depth", "step_budget_kib", "threads", "io_mode", "max_seq", "prefill_chunk")
                   if ctx.get_parameter_source(o) != click.core.ParameterSource.DEFAULT]
        if ignored:
            raise SpecPrefetchError(f"--device {device}: " + ", ".join(
                "--" + {"io_mode": "io"}.get(o, o).replace("_", "-") for o in ignored)
                + " do not apply to the GPU tier")
        if engine != "python" or abi != "host" or flash_profile or frequency_trace or events_out:
            raise SpecPrefetchError(f"--device {device}: the GPU tier takes a model directory with --store, --adapter, "
                                    "--policy and --pool-mib (drop --engine, --abi, --flash-profile, "
                                    "--frequency-trace, --events)")
        from toolkit.engines import gpu_engine, run as run_engine

        eng = gpu_engine(model, device=device, policy=policy, adapter=adapter, store_path=store_path, dtype=dtype,
                         pool_mib=pool_mib, window=window, min_confidence=min_confidence, draft_k=draft_k)
        run_engine(eng, list(prompts), max_new_tokens, check=check, json_out=json_out, events_out=None)
        return
    if ctx_default(click.get_current_context(), "draft_k") is False:
        raise SpecPrefetchError("--draft-k: only with --device cuda (the CPU engines' draft predicts, "
                                "it does not decode)")
    # a bundle runs with the scheduler settings it was exported with, in both engines, for the options
    # not given here (export.manifest.scheduler_defaults; the native runner reads them itself)
    ctx = click.get_current_context()
    not_given = tuple(k for k in ("window", "queue_depth", "min_confidence", "step_budget_kib") if ctx_default(ctx, k))
    if engine == "native":
        window, queue_depth, min_confidence = (None if k in not_given else v for k, v in (
            ("window", window), ("queue_depth", queue_depth), ("min_confidence", min_confidence)))
        if adapter or store_path or frequency_trace or flash_profile:
            raise SpecPrefetchError("--engine native runs a bundle as exported: drop --adapter, --store, "
                                    "--frequency-trace and --flash-profile")
        from toolkit.engines import native_engine, run as run_engine

        eng = native_engine(Path(model), abi=abi, policy=policy, pool_mib=pool_mib, window=window,
                            queue_depth=queue_depth, min_confidence=min_confidence, step_budget_kib=step_budget_kib,
                            threads=threads, prefill_chunk=chunk, pool_auto=(
                                ("--pool-reserve-mib", pool_reserve_mib),
                                ("--pool-low-watermark-mib", pool_low_watermark_mib)))
        run_engine(eng, list(prompts), max_new_tokens, check=check, json_out=json_out, events_out=events_out)
        return
    if abi != "host":
        raise SpecPrefetchError("--abi: only with --engine native")
    from export.manifest import read_manifest
    from export.session import is_bundle, open_session
    from toolkit.engines import python_engine, run as run_engine
    from toolkit.runtime.policy import Policy
    from toolkit.runtime.profiles import load_profile
    from toolkit.runtime.runner import RunConfig

    from toolkit.bench import torch_threads

    torch_threads(threads)
    if is_bundle(model):
        head = read_manifest(model)[1]
        if isinstance(head, dict) and head.get("target") == "executorch":
            from export.executorch_target import set_threads

            with quiet_native_stderr():  # ExecuTorch's thread pool probes the CPU and logs it to fd 2
                have = set_threads(threads, strict=False)
            if have != threads:  # only before the first program loads
                click.echo(f"note: ExecuTorch's thread pool stays at its size in this process (programs already "
                           f"loaded), not --threads {threads}", err=True)
    pol = Policy.parse(policy)
    cfg = RunConfig(policy=pol, pool_mib=pool_mib or 8.0, window=window, queue_depth=queue_depth,
                    flash_profile=load_profile(flash_profile, "--flash-profile") if flash_profile else None,
                    io=io_mode, min_confidence=min_confidence, step_budget_kib=step_budget_kib, prefill_chunk=chunk)
    s = open_session(model, cfg, adapter=adapter, store=store_path, dtype=dtype, frequency_trace=frequency_trace,
                     max_seq=max_seq, pool_default=pool_mib is None, scheduler_default=(*not_given, "floor"))
    s.runner.progress = True  # a prefill progress bar on stderr for long prompts
    run_engine(python_engine(s, pol.name, flash_profile), list(prompts), max_new_tokens, check=check,
               json_out=json_out, events_out=events_out)


def _device(value: str, param) -> str:
    """cpu, cuda or cuda:N (a one-line usage error otherwise)."""
    import re

    if not re.fullmatch(r"cpu|cuda(:\d+)?", value or ""):
        raise click.BadParameter(f"{value!r}: expected cpu, cuda or cuda:N", param=param)
    return value


def ctx_default(ctx, name: str) -> bool:
    """Whether option `name` kept its default (was not given)."""
    return ctx.get_parameter_source(name) == click.core.ParameterSource.DEFAULT


@main.group()
def runner() -> None:
    """The native C++ runner (docs/runner.md)."""


@runner.command(name="build")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--abi", default="host", show_default=True, type=click.Choice(["host", "arm64", "android"]),
              help="this machine; arm64 Linux (cross-built, starts from adb shell); Android with the NDK")
@click.option("--out", type=OUT_DIR, default=None,
              help="output directory [default: the runner cache, ~/.cache/specprefetch/runners]")
@click.option("--force", is_flag=True, help="rebuild even if an up-to-date build is there")
@click.option("--tokenizer/--no-tokenizer", default=None,
              help="build the C++ tokenizer in (text in and out) or leave it out (token ids only) "
                   "[default: what the existing build has; a new build has it]")
@click.option("--overwrite", is_flag=True,
              help="replace a runner build of another configuration at --out (only a runner build)")
@friendly_errors(interrupt="a build in progress is kept in the build directory and the same command continues it")
def runner_build(bundle, abi, out, force, tokenizer, overwrite) -> None:
    """Generate the native runner's CMake project for BUNDLE and build it (CMake + Ninja)."""
    from android_runner.build import build, command, has_tokenizer

    d = build(bundle, abi, out, force=force, tokenizer=tokenizer, **({"overwrite": True} if overwrite else {}))
    click.echo(f"runner: {d / 'bin' / 'specprefetch-runner'} "
               f"({'text in and out' if has_tokenizer(d) else 'token ids only'})")
    if abi == "arm64":
        click.echo(f"on a phone: adb push {d} /data/local/tmp/specprefetch-runner, then run.sh BUNDLE ... there; "
                   f"here: {' '.join(command(d, abi))} BUNDLE ...")


@runner.command(name="bench")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--prompts", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--new-tokens", type=click.IntRange(min=MIN_TIMED_TOKENS), default=32, show_default=True,
              help=f"tokens per prompt, at least {MIN_TIMED_TOKENS}: the simulator needs two decode tokens to time")
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--pool-frac", "pool_fracs", type=FloatList(), default="0.13,0.27", show_default=True,
              help="pools as fractions of all experts")
@click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True,
              help="ExecuTorch's thread pool for the layer graphs, in both engines")
@click.option("--ablation", is_flag=True,
              help="also the eviction ablation: oracle+lru, oracle+prediction, the predictor+belady and "
                   "on-demand+belady in the same rounds (what prediction and what eviction cost)")
@click.option("--json", "json_out", required=True, type=OUT_FILE,
              help="JSON report; the Markdown table and PNG plot go beside it")
@click.option("--overwrite", is_flag=True, help=OVERWRITE_REPORT)
@friendly_errors(interrupt=NOT_WRITTEN)
def runner_bench(bundle, prompts, new_tokens, rounds, pool_fracs, threads, ablation, json_out, overwrite) -> None:
    """Measure the native runner: all experts resident (vs the Python runner and the memory floor),
    and streaming from a cold cache at a few pool sizes (interleaved rounds)."""
    c = claim(json_out, "runner bench", overwrite, inputs=(bundle,))
    from android_runner.bench import markdown, run as run_native_bench, write

    r = run_native_bench(bundle, prompts=prompts, new_tokens=new_tokens, rounds=rounds, pool_fracs=tuple(pool_fracs),
                         threads=threads, ablation=ablation, log=lambda s: click.echo(s, err=True))
    write(r, json_out)
    click.echo(markdown(r))
    click.echo(wrote(c))


@main.group()
def device() -> None:
    """A phone over adb: list devices, push a bundle and its runner, benchmark on it (docs/device.md)."""


@device.command(name="list")
@click.option("--json", "json_out", type=OUT_FILE, default=None, help="also write the list as JSON")
@click.option("--overwrite", is_flag=True, help="replace an existing --json list if this command wrote it")
@friendly_errors(interrupt="nothing was written")
def device_list(json_out, overwrite) -> None:
    """Every attached device: state, SoC, ABI, RAM, free space, CPU clusters, inlinecrypt."""
    if json_out:
        claim(json_out, "device list", overwrite, siblings=())
    from toolkit.device.phone import list_devices, states_table
    from toolkit.reporting import write_json_report

    rows = list_devices()
    click.echo(states_table(rows))
    if json_out:
        write_json_report(json_out, {"devices": rows})


@device.command(name="push")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--serial", default=None, help="the device (adb devices); needed when several are attached")
@friendly_errors(interrupt="the files already on the device stay there; the same command sends only what is "
                           "missing or different")
def device_push(bundle, serial) -> None:
    """Push BUNDLE and the runner built for the device to /data/local/tmp/specprefetch/<bundle hash>/
    (only files whose sha256 differs), then check every file there."""
    from toolkit.device.phone import push

    r = push(bundle, serial, log=lambda s: click.echo(s, err=True))
    click.echo(f"{r['serial']}: {r['remote']} ({r['sent']} of {r['files']} files sent, "
               f"{r['bytes_sent'] / 2**20:.1f} MiB; runner {r['runner_abi']})")


@device.command(name="standin")
@click.option("--port", type=click.IntRange(min=0, max=65535), default=15555, show_default=True,
              help="TCP port on 127.0.0.1 (0: any free one; outside 5555-5585, where adb looks for emulators)")
@click.option("--root", "root_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="the phone's files (/data/local/tmp, /sys, /proc views) [default: a temporary directory]")
@click.option("--root-user", is_flag=True, help="the shell runs as root (drop_caches, governors writable)")
@click.option("--abi", default="arm64-v8a", show_default=True, type=click.Choice(["arm64-v8a", "x86_64"]),
              help="the ABI it reports: arm64-v8a gets the arm64 runner (run under qemu-aarch64 here), "
                   "x86_64 this machine's build (fast)")
@click.option("--fault", "faults", multiple=True,
              help="disconnect-after=SECONDS[:SUBSTRING], full-disk, unauthorized, offline (repeatable)")
@friendly_errors(interrupt="the stand-in phone stopped")
def device_standin(port, root_dir, root_user, abi, faults) -> None:
    """A stand-in SM8750 phone on loopback that the real adb server reaches with `adb connect`:
    try the whole device flow without a phone (docs/device.md)."""
    from toolkit.device.standin import main as standin_main

    spec: dict[str, object] = {}
    for f in faults:
        name, _, value = f.partition("=")
        if name == "disconnect-after":
            secs, _, match = value.partition(":")
            try:
                spec["disconnect_after_s"] = float(secs)
            except ValueError:
                raise SpecPrefetchError(f"--fault {f}: expected disconnect-after=SECONDS[:SUBSTRING]") from None
            spec["disconnect_match"] = match
        elif name in ("full-disk", "unauthorized", "offline") and not value:
            spec[name.replace("-", "_")] = True
        else:
            raise SpecPrefetchError(f"--fault {f}: choose from disconnect-after=SECONDS[:SUBSTRING], full-disk, "
                                    "unauthorized, offline")
    standin_main(port, root_dir, spec, root_user, props={"ro.product.cpu.abi": abi})


@device.command(name="bench")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--serial", default=None, help="the device (adb devices); needed when several are attached")
@click.option("--policies", default="on-demand+lru,previous-token+lru,adapter+prediction", show_default=True,
              help="comma-separated PREDICTOR+EVICTION, run interleaved")
@click.option("--pool-mib", type=POOL_MIB, required=True)
@click.option("--prompt", "prompts", type=Text(), multiple=True, required=True, help="repeatable")
@click.option("--max-new-tokens", type=click.IntRange(min=2), default=32, show_default=True)
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True,
              help="ExecuTorch's thread pool on the phone")
@click.option("--fixed-performance", is_flag=True,
              help="also run every policy with the cpufreq governors at performance (root only)")
@click.option("--cooldown-timeout", type=FiniteFloat(), default=120.0, show_default=True,
              help="seconds to wait between runs for the thermal zones and MemAvailable to settle")
@click.option("--max-temp-c", type=FiniteFloat(), default=None,
              help="cool-down target for the hottest CPU zone [default: its temperature at start + 3]")
@click.option("--peer", type=click.Choice(["llama.cpp"]), default=None,
              help="also run llama.cpp's llama-bench on the same model (GGUF f16), interleaved")
@click.option("--run-timeout", type=FiniteFloat(), default=900.0, show_default=True,
              help="seconds one run may take on the device; past it the run is killed there and the bench stops")
@click.option("--json", "json_out", required=True, type=OUT_FILE,
              help="JSON report; the Markdown table and PNG plot go beside it")
@click.option("--overwrite", is_flag=True, help=OVERWRITE_REPORT)
@friendly_errors(interrupt=NOT_WRITTEN)
def device_bench(bundle, serial, policies, pool_mib, prompts, max_new_tokens, repeats, threads, fixed_performance,
                 cooldown_timeout, max_temp_c, peer, run_timeout, json_out, overwrite) -> None:
    """Benchmark policies on the phone: cold cache, pinned to the big cores, interleaved, with a
    cool-down between runs; pulls every run's JSON and writes a table, a PNG and the JSON."""
    c = claim(json_out, "device bench", overwrite, inputs=(bundle,))
    from toolkit.device.phone import bench, markdown
    from toolkit.runtime.policy import parse_policies

    names = [p.name for p in parse_policies(policies, "--policies")]
    r = bench(bundle, serial=serial, policies=names, pool_mib=pool_mib, prompts=list(prompts),
          max_new_tokens=max_new_tokens, repeats=repeats, json_out=json_out, fixed_performance=fixed_performance,
          threads=threads, cooldown_timeout_s=cooldown_timeout, max_temp_c=max_temp_c, peer=peer,
          run_timeout_s=run_timeout,
          log=lambda s: click.echo(s, err=True))
    click.echo(markdown(r))
    click.echo(wrote(c))


@main.command()
@click.argument("model", default="embedded")
@click.option("--adapter", type=click.Path(path_type=Path), default=None,
              help="prefetch adapter (model directories; needed by the adapter policies)")
@click.option("--policies", default="on-demand+lru,previous-token+lru,next-gate+prediction,adapter+prediction,"
                                    "adapter+lru,oracle+belady",
              show_default=True, help="comma-separated PREDICTOR+EVICTION")
@click.option("--pool-mib", type=POOL_MIB_LIST, default="4,8", show_default=True)
@click.option("--prompts", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--new-tokens", type=click.IntRange(min=2), default=48, show_default=True,
              help=f"tokens per prompt; at least {MIN_TIMED_TOKENS} unless --no-simulate (the simulator needs two "
                   "decode tokens to time)")
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--window", type=click.IntRange(min=1), default=2, show_default=True, help=WINDOW_HELP)
@click.option("--flash-profile", default=None, help="pace reads to a device profile (emulated flash)")
@click.option("--store", "store_path", type=click.Path(path_type=Path), default=None)
@click.option("--no-simulate", is_flag=True, help="skip the simulator comparison")
@click.option("--frequency-trace", type=click.Path(path_type=Path), default=None,
              help="trace whose counts drive the frequency policy, if benchmarked")
@click.option("--peer", type=click.Choice(["llama.cpp"]), default=None,
              help="instead: llama.cpp and the native runner side by side under memory limits (docs/benchmarks.md "
                   "section 8), on each --bundle")
@click.option("--bundle", "bundles", multiple=True, type=click.Path(path_type=Path),
              help="--peer: an ExecuTorch bundle whose source checkpoint is on this machine (repeatable)")
@click.option("--limits", default="1,0.75,0.5,0.25,none", show_default=True,
              help="--peer: memory limits as fractions of the model's f16 GGUF bytes; none: no limit")
@click.option("--prompt-tokens", default="64", show_default=True,
              help="tokens per bench prompt; --peer: comma-separated prompt lengths, e.g. 128,512")
@click.option("--threads", "peer_threads", default="1,2", show_default=True,
              help="--peer: compute threads of both engines, each a set of rows, e.g. 1,2")
@click.option("--no-readaround-off", is_flag=True, help="--peer: skip the llama.cpp read-around-off rows")
@click.option("--no-llama-bench", is_flag=True, help="--peer: skip llama-bench at no limit")
@click.option("--llama-repack", type=click.Choice(["auto", "on", "off"]), default="auto", show_default=True,
              help="--peer: llama.cpp's CPU weight repacking (auto: with no limit only; it doubles its memory)")
@click.option("--timeout", type=FiniteFloat(), default=600.0, show_default=True,
              help="--peer: seconds one run may take (a run past it is recorded as a timeout)")
@click.option("--device", default="cpu", show_default=True, callback=lambda c, p, v: _device(v, p),
              help="cuda / cuda:N: the GPU tier's bench (docs/gpu-tier.md): pools as --pool-fractions of the experts")
@click.option("--pool-fractions", type=FloatList(), default="0.1,0.25,0.5", show_default=True,
              help="--device cuda: pool sizes as fractions of all experts")
@click.option("--draft-k", default="2,4,6,8,12", show_default=True,
              help="--device cuda: the draft's K values the profiling pass tries")
@click.option("--decode", "decode", type=click.Choice(["graph", "static", "modules"]), default=None,
              help="--device cuda: the decode path (default graph where the family allows; docs/gpu-tier.md)")
@click.option("--report-mismatches", is_flag=True,
              help="--device cuda: write the figures even when some run's tokens differ from transformers' "
                   "(marked so; for diagnosis only)")
@click.option("--json", "json_out", required=True, type=OUT_FILE,
              help="JSON report; the Markdown table and PNG plot go beside it")
@click.option("--overwrite", is_flag=True, help=OVERWRITE_REPORT)
@friendly_errors(interrupt=NOT_WRITTEN)
@click.pass_context
def bench(ctx, model, adapter, policies, pool_mib, prompts, new_tokens, rounds, window, flash_profile, store_path,
          no_simulate, frequency_trace, peer, bundles, limits, prompt_tokens, peer_threads, no_readaround_off,
          no_llama_bench, llama_repack, timeout, device, pool_fractions, draft_k, decode, report_mismatches, json_out,
          overwrite) -> None:
    """Measure the runner's policies side by side on MODEL (model directory, `embedded` or bundle):
    interleaved rounds, medians, token equality checked; the simulator beside them. With --peer
    llama.cpp: llama.cpp and the native runner on each --bundle under the same memory limits. With
    --device cuda: the GPU tier's policies, pools as fractions of the experts (docs/gpu-tier.md)."""
    given = lambda *names: [n for n in names if not ctx_default(ctx, n)]  # noqa: E731
    flags = lambda names: ", ".join("--" + n.replace("_", "-") for n in names)  # noqa: E731
    if device == "cpu" and given("pool_fractions", "draft_k", "decode", "report_mismatches"):
        raise SpecPrefetchError(f"{flags(given('pool_fractions', 'draft_k', 'decode', 'report_mismatches'))}: only "
                                "with --device cuda (the GPU "
                                "tier's bench); on the CPU the pools are --pool-mib")
    peer_only = ("limits", "timeout", "peer_threads", "no_readaround_off", "no_llama_bench", "llama_repack")
    if not peer and given(*peer_only):
        raise SpecPrefetchError(f"{flags(given(*peer_only))}: only with --peer llama.cpp".replace("--peer-threads",
                                                                                                  "--threads"))
    from toolkit.peers.sidebyside import parse_ints

    lengths = parse_ints(prompt_tokens, "--prompt-tokens")
    if not peer and len(lengths) != 1:
        raise SpecPrefetchError(f"--prompt-tokens {prompt_tokens!r}: one length (lists only with --peer llama.cpp)")
    if peer:  # checked before the claim and any work
        from toolkit.peers.sidebyside import parse_limits

        parse_limits(limits)
        parse_ints(peer_threads, "--threads")
    if device == "cpu" and not peer and not no_simulate and new_tokens < MIN_TIMED_TOKENS:
        raise SpecPrefetchError(f"--new-tokens {new_tokens}: the simulator comparison needs at least "
                                f"{MIN_TIMED_TOKENS} (two decode tokens to time); pass more, or --no-simulate")
    kind = "bench --device cuda" if device != "cpu" else "bench --peer llama.cpp" if peer else "bench"
    c = claim(json_out, kind, overwrite, inputs=(model, adapter, store_path, frequency_trace, list(bundles),
                                                  Path(flash_profile) if flash_profile else None))
    from toolkit.bench import markdown, run_bench, write
    from toolkit.runtime.policy import parse_policies

    if device != "cpu":
        from toolkit.runtime import gpu_bench

        if peer or bundles or flash_profile or frequency_trace:
            raise SpecPrefetchError(f"--device {device}: drop --peer, --bundle, --flash-profile and --frequency-trace")
        if any(not 0 < f <= 1 for f in pool_fractions):
            raise SpecPrefetchError(f"--pool-fractions: fractions in (0, 1], not {pool_fractions}")
        ignored = [o for o in ("pool_mib", "no_simulate")
                   if ctx.get_parameter_source(o) != click.core.ParameterSource.DEFAULT]
        if ignored:
            raise SpecPrefetchError(f"--device {device}: " + ", ".join("--" + o.replace("_", "-") for o in ignored)
                                    + " do not apply to the GPU tier's bench (pools are --pool-fractions)")
        ks = _ints(draft_k, "--draft-k")
        if not ks or min(ks) < 1:
            raise SpecPrefetchError(f"--draft-k {draft_k!r}: comma-separated draft lengths >= 1")
        if ctx.get_parameter_source("policies") == click.core.ParameterSource.DEFAULT:
            policies = "on-demand+lru,next-gate+prediction," + ("adapter+prediction," if adapter else "") \
                + "draft+prediction,oracle+belady"
        r = gpu_bench.run_gpu_bench(model, store=store_path, adapter=adapter, policies=parse_policies(policies),
                                    fractions=pool_fractions, prompts=prompts, new_tokens=new_tokens, repeats=rounds,
                                    ks=ks, device=device, window=window,
                                    prompt_tokens=lengths[0], decode=decode, strict=not report_mismatches,
                                    log=lambda m: click.echo(m, err=True))
        gpu_bench.write(r, json_out)
        click.echo(gpu_bench.markdown(r))
        click.echo(wrote(c))
        return
    if peer:
        _bench_peer(bundles, limits, prompts, lengths, new_tokens, rounds, timeout, json_out, c,
                    threads=parse_ints(peer_threads, "--threads"), readaround_off=not no_readaround_off,
                    llama_bench=not no_llama_bench, repack=llama_repack)
        return
    if bundles:
        raise SpecPrefetchError("--bundle: only with --peer llama.cpp (the bench of MODEL takes MODEL)")

    r = run_bench(model=model, adapter=adapter, policies=parse_policies(policies), pools=pool_mib, prompts=prompts,
                  prompt_tokens=lengths[0], new_tokens=new_tokens, rounds=rounds, flash_profile=flash_profile,
                  window=None if ctx_default(ctx, "window") else window, store=store_path, simulate=not no_simulate,
                  frequency_trace=frequency_trace)
    write(r, json_out)
    click.echo(markdown(r))
    click.echo(wrote(c))


def _bench_peer(bundles, limits, prompts, lengths, new_tokens, rounds, timeout, json_out, c, *, threads,
                readaround_off, llama_bench, repack) -> None:
    from toolkit.peers import sidebyside

    if not bundles:
        raise SpecPrefetchError("--peer llama.cpp: give at least one --bundle (an ExecuTorch bundle)")
    r = sidebyside.run([Path(b) for b in bundles], limits=sidebyside.parse_limits(limits), prompts=prompts,
                       prompt_tokens=lengths, new_tokens=new_tokens, rounds=rounds, threads=threads, timeout_s=timeout,
                       readaround_off=readaround_off, llama_bench=llama_bench, repack=repack,
                       log=lambda s: click.echo(s, err=True))
    sidebyside.write(r, json_out)
    click.echo(sidebyside.markdown(r))
    click.echo(wrote(c))
    if r.get("status") == "partial":
        raise SpecPrefetchError(f"{r['reason']}: partial results ({len(r['rows'])} rows) in {json_out}")


def _tolerances(items: tuple[str, ...]) -> dict[str, float]:
    out = {}
    for it in items:
        key, sep, val = it.partition("=")
        try:
            out[key.strip()] = float(val)
        except ValueError:
            sep = ""
        if not sep:
            raise SpecPrefetchError(f"--tolerance {it!r}: expected KEY=NUMBER, e.g. max_abs_logit_diff=0.5")
    return out


@main.command(name="export")
@click.argument("model", default="embedded")
@click.option("--adapter", type=click.Path(path_type=Path), default=None,
              help="prefetch adapter directory (default: next-gate prediction heads)")
@click.option("--target", type=click.Choice(["executorch", "qnn", "qai-hub"]), default="executorch", show_default=True)
@click.option("--soc", default="SM8750", show_default=True, help="Snapdragon SoC for qnn / qai-hub (SM8750 = 8 Elite)")
@click.option("--quant", default=None,
              help="dense graphs: executorch fp32|8da8w|8da4w|w8|w4 (default fp32); "
                   "qnn / qai-hub fp16|a16w8|a8w8 (default fp16)")
@click.option("--experts", "experts_dtype", type=click.Choice(["fp16", "int8", "int4"]), default="fp16",
              show_default=True, help="expert store precision")
@click.option("--max-seq", type=click.IntRange(min=2), default=256, show_default=True,
              help="KV cache length (prompt + generated tokens)")
@click.option("--pool-mib", type=POOL_MIB, default=None, help="default DRAM pool budget (default: 1/4 of the experts)")
@click.option("--window", type=click.IntRange(1, 4), default=2, show_default=True,
              help="the bundle's default " + WINDOW_HELP.replace("1..the model's MoE layers", "1..4"))
@click.option("--calibration", type=TextFile(), default=None,
              help="calibration / parity prompts (.jsonl or .txt; default: the embedded held-out text)")
@click.option("--parity-prompts", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--prompt-tokens", type=click.IntRange(min=2), default=12, show_default=True, help="parity prompt length")
@click.option("--decode-tokens", type=click.IntRange(min=1), default=8, show_default=True,
              help="greedy tokens per parity prompt")
@click.option("--tolerance", multiple=True, help="override a parity bound, KEY=VALUE (repeatable)")
@click.option("--qnn-path", type=click.Choice(["ort", "executorch"]), default="ort", show_default=True,
              help="qnn: onnxruntime-qnn, or ExecuTorch's Qualcomm backend (needs QAIRT at QNN_SDK_ROOT)")
@click.option("--hub-device", default="Snapdragon 8 Elite QRD", show_default=True, help="qai-hub device")
@click.option("--hub-timeout", type=FiniteFloat(), default=15.0, show_default=True,
              help="qai-hub: seconds before giving up on the service")
@click.option("--hub-profile/--no-hub-profile", default=True, show_default=True,
              help="qai-hub: also profile every graph on the device")
@click.option("--out", required=True, type=OUT_DIR, help="bundle directory to write")
@click.option("--overwrite", is_flag=True,
              help="replace an existing bundle at --out (only once the new one is complete)")
@friendly_errors(interrupt=NOTHING_TO_OUT)
def export_cmd(model, adapter, target, soc, quant, experts_dtype, max_seq, pool_mib, window, calibration,
               parity_prompts, prompt_tokens, decode_tokens, tolerance, qnn_path, hub_device, hub_timeout, hub_profile,
               out, overwrite) -> None:
    """Export MODEL as a phone-ready bundle: dense step graphs for the target, the expert store,
    the adapter, and a parity report. The bundle is refused if parity is past tolerance."""
    from export.bundle import ExportConfig, export_bundle

    cfg = ExportConfig(target=target, quant=quant, experts=experts_dtype, soc=soc, max_seq=max_seq,
                       pool_mib=pool_mib, window=window, calibration=calibration, parity_prompts=parity_prompts,
                       prompt_tokens=prompt_tokens, decode_tokens=decode_tokens,
                       tolerance=_tolerances(tolerance), qnn_path=qnn_path, hub_device=hub_device,
                       hub_timeout_s=hub_timeout, hub_profile=hub_profile)
    m = export_bundle(model, out, cfg, adapter=adapter, overwrite=overwrite)
    click.echo((out / "parity.md").read_text())
    total = sum(f["size"] for f in m["files"].values())
    click.echo(f"wrote {out}: {m['target']} ({m['quantization']['dense']}), {len(m['files'])} files, "
               f"{total / 2**20:.1f} MiB, in {m['timings_s']['total_s']:.0f} s")


@main.command(name="inspect")
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of a summary")
@friendly_errors(interrupt="nothing was written")
def inspect_cmd(bundle: Path, as_json: bool) -> None:
    """Validate a bundle (manifest, hashes, versions, graph signatures) and summarise it."""
    from export.bundle import inspect_bundle

    s = inspect_bundle(bundle)
    if as_json:
        click.echo(json.dumps(s, indent=1))
        return
    p = s["parity"] or {}
    click.echo(f"{s['path']}: valid {s['target']} bundle" + (f" for {s['soc']}" if s["soc"] else ""))
    click.echo(f"  model      {s['family']} (config {s['config_hash']}), KV cache {s['max_seq']} tokens")
    q = s["quantization"]
    click.echo(f"  precision  dense {q['dense']}, experts {q['experts']}, expert graph {q['expert_graph']}")
    click.echo(f"  prefetch   {s['predictor']} heads, default pool {s['pool_mib']} MiB")
    num = lambda key, spec: fmt(p[key], spec) if isinstance(p.get(key), (int, float)) else "n/a"  # noqa: E731
    click.echo(f"  parity     {'passed' if p.get('passed') else 'NOT passed'}: max |logit diff| "
               f"{num('max_abs_logit_diff', '.3g')}, top-k agreement {num('topk_agreement', '.4f')}, "
               f"next-token agreement {num('next_token_agreement', '.4f')}")
    click.echo(f"  files      {s['files']} files, {s['bytes'] / 2**20:.2f} MiB: "
               + ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in sorted(s["sizes"].items())))
    click.echo(f"  graphs     {len(s['graphs'])} checked: " + ", ".join(sorted(s["graphs"])))
    for n in s["notes"]:
        click.echo(f"  note       {n}")


@main.command()
@click.argument("family")
@click.option("--out", required=True, type=OUT_DIR, help="model directory to write")
@click.option("--seed", default=0, show_default=True)
@click.option("--set", "sets", multiple=True,
              help="KEY=VALUE: a config attribute (VALUE as JSON, e.g. hidden_size=768, mlp_only_layers=[]); "
                   "repeatable, for a larger random model")
@click.option("--overwrite", is_flag=True, help="replace a model directory at --out (once the new one is complete)")
@friendly_errors(interrupt=NOTHING_TO_OUT)
def tiny(family: str, out: Path, seed: int, sets: tuple[str, ...], overwrite: bool) -> None:
    """Write a tiny random checkpoint of FAMILY (qwen3_moe, qwen3_vl_moe, deepseek_v2,
    deepseek_v3, mixtral, olmoe, gpt_oss) to --out."""
    from toolkit.models.tiny import build_tiny

    overrides = {}
    for item in sets:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise SpecPrefetchError(f"--set {item!r}: expected KEY=VALUE")
        try:
            overrides[key] = json.loads(value)
        except ValueError:
            raise SpecPrefetchError(f"--set {item!r}: VALUE must be JSON (a number, true/false, a list)") from None
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Writing model shards" of a few MiB is not the user's business
    click.echo(f"wrote {build_tiny(family, out, seed=seed, overrides=overrides, overwrite=overwrite)}")


@main.command()
@click.argument("model", default="embedded")
@click.option("--moe-intermediate-size", "width", required=True, type=click.IntRange(min=1),
              help="the routed experts' new width (units of the intermediate axis); larger than today's")
@click.option("--out", required=True, type=OUT_DIR, help="model directory to write")
@click.option("--seed", default=0, show_default=True, help="seed of the added units' gate/up rows")
@click.option("--overwrite", is_flag=True,
              help="replace a checkpoint widen wrote at --out (only once the new one is complete)")
@friendly_errors(interrupt=NOTHING_TO_OUT)
def widen(model, width, out, seed, overwrite) -> None:
    """Write MODEL with routed experts --moe-intermediate-size wide that compute exactly what
    MODEL's compute (added units: ordinary gate/up rows, zero down-projection columns), for
    studying larger experts on the same routing (docs/widen.md). Streams shard by shard.

    MODEL is a checkpoint directory, `embedded` or `phone`; every supported family's experts are gated MLPs."""
    from toolkit.models.widen import widen_checkpoint

    s = widen_checkpoint(model, out, width, overwrite=overwrite, seed=seed, progress=True)
    fp16 = s["bytes_per_expert_fp16"]
    click.echo(f"wrote {s['out']}: {s['family']} experts {s['moe_intermediate_size']['from']} -> "
               f"{s['moe_intermediate_size']['to']} wide ({s['experts']} routed experts, {fp16['from']:,} -> "
               f"{fp16['to']:,} B each in fp16), {len(s['shards'])} shard(s), {s['bytes'] / 2**20:,.1f} MiB; "
               f"widened from {s['source']} (config hash {s['config_hash']['source']})")


if __name__ == "__main__":
    main()
