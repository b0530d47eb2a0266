"""The Typer application and the entry point.

Every mistake a user can make ends as one line on stderr that says what to fix, exit status 2, no
traceback: a :class:`QuantdynError` from the library, and every usage error of the command line
(unknown command or option, a bad or missing value).  ``quantdyn --version`` prints the installed
version; ``-h`` and ``--help`` work on every command; help text is plain (literal ``[...]``, real
types).  Ctrl-C ends with one line (exit 130) that says how to go on, true for the command that ran;
SIGTERM the same way (exit 143).

Plain help groups a command's options in sections: an option's ``rich_help_panel`` names its section (typer
itself shows panels only with rich markup, which is off), so ``quantdyn sweep -h`` lists the trajectory, the
quantizers and data, the engine, the output and the SLURM options apart.  An old spelling of an option keeps
working and prints one ``note:`` line on stderr that names the new spelling (:func:`deprecated`), once the
command has run.
"""
from __future__ import annotations

import errno
import json
import logging
import signal
import sys
import threading
from importlib import metadata
from typing import Sequence

import typer
from typer.core import TyperCommand

from quantdyn.errors import QuantdynError, Terminated, did_you_mean

try:  # typer >= 0.22 carries its own copy of click
    from typer._click import exceptions as click_exceptions
except ImportError:  # pragma: no cover - older typer on top of click
    from click import exceptions as click_exceptions

PROG = "quantdyn"

app = typer.Typer(
    add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain help: rich markup ate "[...]" in help texts and showed flags as <bool>
    context_settings={"help_option_names": ["-h", "--help"]},  # inherited by every subcommand
    help="How training dynamics decide post-training quantization robustness.",
)

# What Ctrl-C tells the user, per command (the first word after `quantdyn`); true for that command.
# Commands that resume by rerunning are listed; owners of new resumable commands add theirs.
RESUME_HINTS: dict[str, str] = {
    "sweep": "rerun the same command to resume (stored rows are kept)",
    "analyze": "rerun the same command to resume (stored rows are kept)",
    "cooldown": "rerun the same command to resume from the branches' last checkpoints",
    "grid": "rerun the same command to resume (finished runs are skipped, partial ones resumed)",
    "study": "rerun the same command to resume (every stage skips what is done)",
    "demo": "rerun the same command to resume (every stage skips what is done)",
}
_DEFAULT_HINT = "files already written are complete; rerun the command to start it again"


class SectionedCommand(TyperCommand):
    """A command whose plain help lists its options in sections named by their ``rich_help_panel`` (options
    without one under "Options"), in the order the sections first appear."""

    def format_options(self, ctx, formatter) -> None:
        args: list[tuple[str, str]] = []
        sections: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            if param.param_type_name == "argument":
                args.append(record)
            else:
                sections.setdefault(getattr(param, "rich_help_panel", None) or "Options", []).append(record)
        if args:
            with formatter.section("Arguments"):
                formatter.write_dl(args)
        for title, records in sections.items():
            with formatter.section(title):
                formatter.write_dl(records)


def command(name: str | None = None, *, parent: typer.Typer | None = None, **kwargs):
    """``app.command`` (or ``parent.command``) with sectioned plain help (:class:`SectionedCommand`)."""
    return (parent or app).command(name, cls=SectionedCommand, **kwargs)


_NOTES: list[str] = []


def deprecated(old: str, new: str) -> None:
    """An old spelling was used: one ``note:`` line on stderr, printed once the command has run (a command
    that fails prints its one error line only)."""
    line = f"note: {old} is deprecated; {new}"
    if line not in _NOTES:
        _NOTES.append(line)


def _print_notes() -> None:
    for line in _NOTES:
        typer.echo(line, err=True)
    _NOTES.clear()


def version() -> str:
    """The installed version of quantdyn (package metadata)."""
    try:
        return metadata.version("quantdyn")
    except metadata.PackageNotFoundError:  # a source tree that was never installed
        return "unknown (not installed; `pip install -e .`)"


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"{PROG} {version()}")
        raise typer.Exit()


@app.callback()
def _root(
    show_version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                      help="Print the version and exit."),
) -> None:
    """How training dynamics decide post-training quantization robustness."""


def plural(n: int, word: str) -> str:
    """'1 quantizer', '3 quantizers', '0 checkpoints'."""
    return f"{n} {word}{'' if n == 1 else 's'}"


def echo_json(obj) -> None:
    typer.echo(json.dumps(obj, default=str))


# --------------------------------------------------------------------------- errors as one line


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    sys.exit(2)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _help_hint(ctx, args: Sequence[str] = ()) -> str:
    if ctx is not None and ctx.parent is not None:
        path = ctx.command_path
    else:  # errors raised while the root parses a subcommand's options carry no (or the root's) context
        path = " ".join([PROG, *_command_path_of(args)])
    return f"see `{path} -h`"


_WRITES = ("--out", "--store", "--dir")
OPTION_SYNONYMS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("out", "output", "outdir", "out-dir", "output-dir", "dest", "destination", "o", "save",
                     "write", "to", "target"), _WRITES),
    **dict.fromkeys(("store", "results", "result-store", "db", "database"), ("--store",)),
    **dict.fromkeys(("quantizer", "quantizers", "quant", "quants", "q", "quantization", "quantize", "label",
                     "labels", "scheme"), ("--quantizers", "--types")),
    **dict.fromkeys(("format", "formats", "fmt"), ("--export", "--quantizers", "--types")),
    **dict.fromkeys(("type", "candidates"), ("--types",)),
    **dict.fromkeys(("wbits", "w-bits", "nbits", "bit", "bitwidth", "precision"), ("--bits",)),
    **dict.fromkeys(("gpu", "cuda", "cpu", "devices"), ("--device",)),
    **dict.fromkeys(("ckpt", "checkpoints", "model", "path-to-checkpoint"), ("--checkpoint", "--run")),
    **dict.fromkeys(("dataset", "corpus", "text"), ("--calib-data", "--data", "--eval-data")),
    **dict.fromkeys(("silent",), ("--quiet",)),
    **dict.fromkeys(("v", "debug"), ("--verbose",)),
    **dict.fromkeys(("seed",), ("--seeds", "--seed")),
}
"""What users type for an option -> the options that mean it, best first (the did-you-mean of an unknown option
ranks by meaning before spelling: `sweep --output` -> --store, `quantize -q` -> --quantizers; errors.did_you_mean).
Keys are lower case without leading dashes."""

_TYPE_WORDS = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "text", "Path": "a path"}


def usage_message(e: Exception, args: Sequence[str] = ()) -> str:
    """One line for a click usage error, ending with where to read the help."""
    ctx = getattr(e, "ctx", None)
    hint = _help_hint(ctx, args)
    if isinstance(e, click_exceptions.NoSuchOption):
        opts = sorted(getattr(e, "possibilities", None) or []) or (
            sorted(o for p in ctx.command.params for o in getattr(p, "opts", []) if o.startswith("-")) if ctx else [])
        return f"no such option {e.option_name} for `{ctx.command_path if ctx else PROG}`" \
               f"{did_you_mean(e.option_name, _all_options(ctx) or opts, OPTION_SYNONYMS)}; {hint}"
    if isinstance(e, click_exceptions.BadParameter) and not isinstance(e, click_exceptions.MissingParameter):
        param = getattr(e, "param", None)
        cause = e.__cause__
        errors = getattr(cause, "errors", None)
        if param is not None and callable(errors):
            try:
                raw = errors()[0].get("input")
            except Exception:  # noqa: BLE001 - fall back to click's own words
                raw = None
            tp = getattr(getattr(param, "type_descriptor", None), "annotation", None)
            want = _TYPE_WORDS.get(getattr(tp, "__name__", ""), None)
            name = (getattr(param, "opts", None) or [param.name])[0]
            if raw is not None and want is not None:
                return f"invalid value for {name}: {raw!r} is not {want}; {hint}"
        return f"{_one_line(e.format_message()).rstrip('.')}; {hint}"
    msg = _one_line(e.format_message()).rstrip(".")
    if ctx is not None and msg.startswith("No such command"):
        name = msg.split("'")[1] if "'" in msg else ""
        commands = ctx.command.list_commands(ctx)
        return f"no such command '{name}'{did_you_mean(name, commands)}; commands: {', '.join(commands)}; {hint}"
    return f"{msg[:1].lower() + msg[1:]}; {hint}"


def _all_options(ctx) -> list[str]:
    """Every visible option name of the command that ``ctx`` runs (click's own possibilities are only the close
    spellings, which meaning must be able to overrule)."""
    if ctx is None:
        return []
    return sorted(o for p in ctx.command.params if not getattr(p, "hidden", False)
                  for o in getattr(p, "opts", []) if o.startswith("-"))


def _command_of(args: Sequence[str]) -> str:
    """The subcommand a command line names (first word that is not an option)."""
    return next((a for a in args if not a.startswith("-")), "")


def _command_path_of(args: Sequence[str]) -> list[str]:
    """The (sub)command names at the start of a command line, e.g. ['average', 'lawa']."""
    group = typer.main.get_command(app)
    path: list[str] = []
    for a in args:
        sub = getattr(group, "commands", {}).get(a)
        if a.startswith("-") or sub is None:
            break
        path.append(a)
        group = sub
    return path


def interrupt_message(args: Sequence[str]) -> str:
    """The one line printed on Ctrl-C for this command line."""
    command = _command_of(args)
    if command == "train":
        hint = ("rerun the same command to resume from the last checkpoint" if "--resume" in args
                else "continue with `quantdyn train --resume RUN_DIR` if a checkpoint was written, "
                     "else rerun the same command")
    else:
        hint = RESUME_HINTS.get(command, _DEFAULT_HINT)
    return f"interrupted; {hint}"


# Import-time log lines of libraries that quantdyn does not use, dropped from a command's stderr (the rest of what
# these loggers say still prints). transformers imports torchao whenever it is installed (transformers/quantizers/
# auto.py, on the first model load; the test extra installs it for the format tests), and torchao then logs that
# its CUDA kernels and Triton are missing and registers enums with torch's pytree, which logs a deprecation per
# enum. Filtered here, where the command line configures logging, rather than by keeping torchao out of the
# environment: a user's environment may have it whatever quantdyn's extras are.
IMPORT_NOISE: dict[str, tuple[str, ...]] = {
    "torchao": ("Failed to load ",),  # torchao/__init__.py: its _C*.so kernels, built for CUDA
    "torchao.kernel.intmm": ("Warning: Detected no triton",),
    "torch.utils._pytree": ("is an Enum subclass and is now natively supported",),
}


def _not_import_noise(record: logging.LogRecord) -> bool:
    return not any(p in str(record.msg) for p in IMPORT_NOISE.get(record.name, ()))


def quiet_import_noise() -> None:
    """Drop :data:`IMPORT_NOISE` from the loggers that write it (once per process; before they exist is fine)."""
    for name in IMPORT_NOISE:
        logger = logging.getLogger(name)
        if _not_import_noise not in logger.filters:
            logger.addFilter(_not_import_noise)


def main(argv: Sequence[str] | None = None) -> None:
    """The console script: run the command line ``argv`` (default ``sys.argv[1:]``) and exit.

    Exit status: 0 done, 2 a user or usage error (one line on stderr), 130 interrupted (Ctrl-C), 143
    terminated (SIGTERM: cleaned up like Ctrl-C)."""
    args = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    quiet_import_noise()
    root = typer.main.get_command(app)
    previous = _on_sigterm_raise()
    _NOTES.clear()
    try:
        with root.make_context(PROG, args) as ctx:
            root.invoke(ctx)
        _print_notes()
    except QuantdynError as e:
        _fail(_one_line(e))
    except click_exceptions.NoArgsIsHelpError as e:
        e.show()  # the help text; asked for by giving no arguments
        sys.exit(2)
    except click_exceptions.UsageError as e:
        _fail(usage_message(e, args))
    except typer.Exit as e:  # --help, --version, typer.Exit(code)
        if not e.exit_code:
            _print_notes()
        sys.exit(e.exit_code)
    except typer.Abort:  # end of input at a prompt
        _fail("aborted (no input)")
    except KeyboardInterrupt as e:
        typer.echo(interrupt_message(args), err=True)
        sys.exit(getattr(e, "exit_code", 130))
    except click_exceptions.ClickException as e:
        _fail(_one_line(e.format_message()))
    except OSError as e:
        if e.errno == errno.EPIPE:  # `quantdyn results | head`: the reader went away
            sys.stderr.close()
            sys.exit(1)
        if e.errno in (errno.ENOSPC, errno.EFBIG, getattr(errno, "EDQUOT", errno.ENOSPC)):
            _fail(f"disk full writing '{e.filename or '?'}' ({e.strerror}); free space and rerun")
        if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            _fail(f"cannot write or read '{e.filename or '?'}' ({e.strerror}); check the path and its permissions")
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _raise_terminated(signum, frame) -> None:
    raise Terminated()


def _on_sigterm_raise():
    """While a command runs, SIGTERM raises :class:`Terminated`; returns the handler to restore (None where
    handlers cannot be set: not the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, _raise_terminated)
