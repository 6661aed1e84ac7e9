"""``python -m meshgate.gateway.cli``: the ``meshgate`` command."""

import sys

from meshgate.gateway.cli.commands import main

sys.exit(main())
