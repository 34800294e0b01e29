"""The ``streampack`` console command: ``demo``, ``inspect``, ``pack``, ``bench``.

Each subcommand lives in its own module with ``add_arguments(parser)`` and ``run(args) -> int``;
``main.py`` only wires them (importing only the module of the command asked for) and turns user
errors into one line on stderr (exit code 2).
"""
