"""The ``streampack`` console command: ``demo``, ``inspect``, ``index``, ``pack``, ``bench``, one module each with
``add_arguments(parser)`` and ``run(args) -> int``; ``main.py`` wires them, importing only the command asked for, and
turns user errors into one line on stderr (exit code 2)."""
