"""`python -m tools COMMAND`: the development tools (tools/cli.py)."""

import sys

from tools.cli import main

sys.exit(main())
