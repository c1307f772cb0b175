"""``python -m loraserve ...`` is the ``loraserve`` command."""

import sys

from loraserve.cli import main

sys.exit(main())
