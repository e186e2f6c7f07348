"""`python -m k3.eval ARGS`: lm-eval's command line with the "k3" model registered (see k3.eval.lm_eval.main)."""

import sys

from .lm_eval import main

sys.exit(main())
