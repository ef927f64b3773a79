"""``python -m nsa_flex.eval ...``: the needle evaluation CLI (nsa_flex.eval.needle). The arguments
are checked before torch is imported."""

import sys

from .args import parse_args
from .prompts import EvalError

try:
    parse_args()
    from .needle import main

    main()
except EvalError as e:
    print(f"needle_eval: error: {e}", file=sys.stderr)
    sys.exit(2)
