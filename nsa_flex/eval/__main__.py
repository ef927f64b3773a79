"""``python -m nsa_flex.eval ...``: the needle evaluation CLI (nsa_flex.eval.needle)."""

import sys

from .needle import EvalError, main

try:
    main()
except EvalError as e:
    print(f"needle_eval: error: {e}", file=sys.stderr)
    sys.exit(2)
