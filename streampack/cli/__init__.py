"""The ``streampack`` console command: ``demo``, ``inspect``, ``pack``, ``bench``.

Each subcommand lives in its own module with ``add_parser(subparsers)`` and ``run(args) -> int``;
``main.py`` only wires them and turns user errors into one line on stderr (exit code 2).
"""
