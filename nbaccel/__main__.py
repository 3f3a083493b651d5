"""``python -m nbaccel``: the ``nbaccel`` command line, for when its script is not on ``PATH``."""

import sys

from nbaccel.cli.main import main

sys.exit(main())
