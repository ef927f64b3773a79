"""`python -m nsa_flex.plot`: runs `nsa_flex.apps.plot`."""

import runpy

runpy.run_module("nsa_flex.apps.plot", run_name="__main__", alter_sys=True)
