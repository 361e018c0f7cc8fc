"""`python -m hyspec_jax.serve` = `hyspec serve`."""

import sys

from hyspec_jax.serve.server import main

sys.exit(main())
