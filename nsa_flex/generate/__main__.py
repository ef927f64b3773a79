"""`python -m nsa_flex.generate`: runs `nsa_flex.apps.generate`."""

import runpy

runpy.run_module("nsa_flex.apps.generate", run_name="__main__", alter_sys=True)
