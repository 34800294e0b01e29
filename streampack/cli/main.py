"""``streampack`` entry point: argparse subcommands, and errors as one line on stderr.

A user error (bad flag value, missing file, bad data, a capacity the packed files were not made
for) prints ``streampack: error: <message>`` and exits with code 2, like argparse's own usage
errors; ``--debug`` shows the traceback instead. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from streampack.cli import bench_cmd, demo, index_cmd, inspect_cmd, pack_cmd

_COMMANDS = (demo, inspect_cmd, pack_cmd, index_cmd, bench_cmd)
# Exceptions that mean "the input is wrong", not "streampack is broken".
_USER_ERRORS = (ValueError, TypeError, OSError, KeyError)


def build_parser() -> argparse.ArgumentParser:
    from streampack import __version__

    parser = argparse.ArgumentParser(
        prog="streampack",
        description="Stream sharded data into packed THD batches (cu_seqlens) for LLM training.",
        epilog="Run `streampack demo` to see packing on a synthetic long-tail corpus (no download).",
    )
    parser.add_argument("--version", action="version", version=f"streampack {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in _COMMANDS:
        p = module.add_parser(sub)
        # SUPPRESS: a subcommand's default must not overwrite a --debug given before it
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show tracebacks instead of one-line errors")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
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
