"""`python -m bench [--quick]`: see bench/harness.py."""

import sys

from bench.harness import main

sys.exit(main())
