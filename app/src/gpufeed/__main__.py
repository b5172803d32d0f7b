"""``python -m gpufeed``: the `gpufeed` command."""

import sys

from gpufeed.cli import main

sys.exit(main())
