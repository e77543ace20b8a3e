"""`python -m pagedkv.server [MODEL] [options]`: the same as `pagedkv serve`."""

import sys

from pagedkv.server.cli import main

if __name__ == "__main__":
    sys.exit(main())
