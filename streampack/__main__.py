"""``python -m streampack`` = the ``streampack`` console command."""

import sys

from streampack.cli.main import main

sys.exit(main())
