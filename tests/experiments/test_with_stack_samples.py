"""experiments/with_stack_samples.py: runs a script as __main__ with its arguments and appends
every thread's stack to a file at the given interval."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_samples_the_running_script(tmp_path):
    script = tmp_path / "slow.py"
    script.write_text("import sys, time\n\ndef waiting_here():\n    time.sleep(2.6)\n\n"
                      "if __name__ == '__main__':\n    waiting_here()\n    print('args', sys.argv[1:])\n")
    stacks = tmp_path / "stacks.txt"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "with_stack_samples.py"),
                        "1", str(stacks), str(script), "--x", "1"], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    assert "args ['--x', '1']" in p.stdout
    text = stacks.read_text()
    assert text.count("==== t=") >= 2 and "waiting_here" in text
