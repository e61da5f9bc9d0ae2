"""``python -m kiln.cli``: the same as the ``kiln`` console script."""
import sys

from kiln.cli.app import main

sys.exit(main())
