"""``python -m ql3``: the ``ql3`` command line."""

import sys

from ql3.adapters.cli.main import main

sys.exit(main())
