"""`python -m mmgrpo_jax.cli ...` = `mmgrpo ...` (a source tree that is not installed)."""

import sys

from mmgrpo_jax.cli import main

sys.exit(main())
