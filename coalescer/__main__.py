"""``python -m coalescer``: the ``coalescer`` command, from a source tree or an environment
without the console script (the Procfile's processes, which install only the locked
dependencies)."""

import sys

from coalescer.cli import main

sys.exit(main())
