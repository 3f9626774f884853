"""``python -m verispec``: the same as the ``verispec`` command."""

import sys

from verispec.cli import main

if __name__ == "__main__":
    sys.exit(main())
