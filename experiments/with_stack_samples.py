"""Run a Python script with every thread's stack appended to a file every N seconds (for a
process that is slow or stuck where no profiler is installed; sys._current_frames under the GIL,
safe while compile workers run, unlike faulthandler.dump_traceback_later):

    python experiments/with_stack_samples.py 20 stacks.txt experiments/bench_attention.py ARGS...
"""

import runpy
import sys
import threading
import time
import traceback


def sample(every: float, path: str) -> None:
    t0 = time.monotonic()
    while True:
        time.sleep(every)
        frames = sys._current_frames()
        with open(path, "a") as f:
            f.write(f"==== t={time.monotonic() - t0:.0f}s, {len(frames)} threads\n")
            for tid, fr in frames.items():
                if tid != threading.get_ident():
                    f.write("".join(traceback.format_stack(fr)[-14:]) + "----\n")


if __name__ == "__main__":
    every, path, script = float(sys.argv[1]), sys.argv[2], sys.argv[3]
    threading.Thread(target=sample, args=(every, path), daemon=True).start()
    sys.argv = sys.argv[3:]
    sys.path.insert(0, __import__("os").path.dirname(script))
    runpy.run_path(script, run_name="__main__")
