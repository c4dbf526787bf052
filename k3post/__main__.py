"""``python -m k3post ...``: the same command line as the ``k3post`` script (`k3post.cli.main`)."""

import sys

from k3post.cli import main

sys.exit(main())
