"""Passkey / multi-key needle evaluation of a checkpoint: ``python -m nsa_flex.eval`` (the code is in
nsa_flex/apps/eval/), under the name the README, NOTES.md and ablation_runs.sh use.

    python experiments/needle_eval.py --quick --out /tmp/needle_quick
"""

import runpy

if __name__ == "__main__":
    runpy.run_module("nsa_flex.eval", run_name="__main__", alter_sys=True)
