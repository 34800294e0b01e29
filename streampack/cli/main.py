"""``streampack`` entry point: argparse subcommands, and errors as one line on stderr.

A user error prints ``streampack: error: <message>`` and exits with code 2 (``--debug`` shows the traceback); anything
else is a bug and keeps its traceback. ``--version``, ``--help`` and a usage error import no subcommand module, and a
subcommand imports only its own (torch made ``--version`` take 4.7 s).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Collection, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class Command:
    """A subcommand as the top-level parser lists it, without importing its module."""

    module: str
    """Module with ``add_arguments(parser)`` and ``run(args) -> int``; its docstring's first paragraph is the
    subcommand's ``--help`` description."""
    help: str


COMMANDS: dict[str, Command] = {
    "demo": Command(module="streampack.cli.demo", help="pack a synthetic long-tail corpus and show the result"),
    "inspect": Command(module="streampack.cli.inspect_cmd",
                       help="length statistics and projected packing fill of a dataset"),
    "pack": Command(module="streampack.cli.pack_cmd", help="pack a dataset offline into packed shards + manifest.json"),
    "index": Command(module="streampack.cli.index_cmd",
                     help="write the manifest and sample index of every shard ahead of training"),
    "bench": Command(module="streampack.cli.bench_cmd", help="run the benchmarks and write a markdown report"),
}
# Exceptions that mean "the input is wrong", not "streampack is broken".
_USER_ERRORS = (ValueError, TypeError, OSError, KeyError)


def build_parser(commands: Collection[str] | None = None) -> argparse.ArgumentParser:
    """The parser, with the arguments of ``commands`` (every subcommand when None); the others
    are listed by name and help only, so their modules are not imported."""
    from streampack import __version__

    parser = argparse.ArgumentParser(
        prog="streampack",
        description="Stream sharded data into packed THD batches (cu_seqlens) for LLM training.",
        epilog="Run `streampack demo` to see packing on a synthetic long-tail corpus (no download).",
    )
    parser.add_argument("--version", action="version", version=f"streampack {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, command in COMMANDS.items():
        p = sub.add_parser(name, help=command.help)
        if commands is None or name in commands:
            from streampack.cli._data import describe

            module = importlib.import_module(command.module)
            p.description = describe(module.__doc__)
            module.add_arguments(p)
        # SUPPRESS: a subcommand's default must not overwrite a --debug given before it
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show tracebacks instead of one-line errors")
    return parser


def chosen_command(argv: Sequence[str]) -> str | None:
    """The subcommand ``argv`` names: its first word that is not an option (top-level options
    take no value), or None."""
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = chosen_command(argv)
    parser = build_parser([command] if command is not None else [])
    args = parser.parse_args(argv)  # argparse itself exits 2 on a usage error
    debug = bool(getattr(args, "debug", False))
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        print("streampack: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `streampack inspect ... | head`: the reader left; not an error
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 141
    except _USER_ERRORS as e:
        if debug:
            raise
        message = str(e) or type(e).__name__
        if isinstance(e, KeyError):
            message = f"missing field {e}"
        print(f"streampack: error: {message.splitlines()[0] if message else message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
