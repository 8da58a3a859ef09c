"""``python -m tfdp.run``: the same as the ``tfdp-run`` console script (tfdp/launcher/cli.py)."""

import sys

from tfdp.launcher.cli import main

if __name__ == "__main__":
    sys.exit(main())
