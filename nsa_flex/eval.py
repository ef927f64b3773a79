"""`python -m nsa_flex.eval`: an alias that runs the evaluation app, `nsa_flex.apps.eval`."""

if __name__ == "__main__":
    import runpy

    runpy.run_module("nsa_flex.apps.eval", run_name="__main__", alter_sys=True)
