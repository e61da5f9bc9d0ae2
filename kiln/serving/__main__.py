"""``python -m kiln.serving MODEL.kiln ...``: the same as ``kiln serve MODEL.kiln ...``."""
import sys

from kiln.serving.server import main

if __name__ == "__main__":
    sys.exit(main())
