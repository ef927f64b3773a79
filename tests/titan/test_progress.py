"""The step line's "step: 12/50" and ETA (nsa_flex.titan.metrics.progress / _StepProgress)."""

import logging

from nsa_flex.titan.metrics import _StepProgress, progress


def test_progress_field_and_eta():
    assert progress(1, 50, None, 100.0) == ("1/50", "")  # first logged step: no rate yet
    # 10 steps in 20 s since step 2: 2 s per step, 38 steps left
    assert progress(12, 50, (2, 80.0), 100.0) == ("12/50", "eta 1m16s")
    assert progress(12, 5000, (2, 80.0), 100.0) == ("12/5000", "eta 2h46m")  # 9976 s
    assert progress(50, 50, (2, 80.0), 100.0) == ("50/50", "eta 0s")


def test_step_line_rewritten_once():
    f = _StepProgress("12/50", "eta 1m16s")
    rec = logging.LogRecord("x", logging.INFO, "", 0, "\x1b[31mstep: 12  \x1b[32mloss:  2.5", None, None)
    f.filter(rec)
    assert rec.msg == "\x1b[31mstep: 12/50  eta 1m16s  \x1b[32mloss:  2.5"
    rec2 = logging.LogRecord("x", logging.INFO, "", 0, "step: 13  loss: 1", None, None)
    f.filter(rec2)
    assert rec2.msg == "step: 13  loss: 1"
