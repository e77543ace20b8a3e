"""`python -m pagedkv.engine.core`: the engine-core process (see `pagedkv.engine.core.process`)."""

import sys

from pagedkv.engine.core.process import main

if __name__ == "__main__":
    sys.exit(main())
