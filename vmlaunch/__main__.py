"""`python -m vmlaunch` is the `vmlaunch` command."""

import sys

from vmlaunch.cli import main

sys.exit(main())
