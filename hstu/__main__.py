"""`python -m hstu`: the `hstu` console command, for environments without the installed script."""

import sys

from hstu.cli import main

sys.exit(main())
