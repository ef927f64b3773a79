"""Does a SIGUSR1 faulthandler registration survive what a torchtitan GPU run starts after it?

The [ops] SIGUSR1 dump (nsa_flex/titan/ops.py) worked on CPU under torchrun but wrote nothing in
an H100 run. This registers faulthandler on SIGUSR1 into a pipe as Ops.start does, then after each
stage of a training process's start (CUDA, an NCCL process group and an all-reduce, a compiled
function, a DataLoader with a worker) sends SIGUSR1 to itself and reports whether the dump
arrived, whether the process still catches SIGUSR1 (/proc SigCgt), which threads block it and the
Python-level handler; last, the wakeup-fd scheme nsa_flex.titan.ops uses (one byte = a dump).
Run under torchrun, one process:

    python -m torch.distributed.run --nproc_per_node=1 experiments/diag_sigusr1.py
"""

import faulthandler
import os
import select
import signal

import torch


def usr1_bit(path: str, field: str) -> bool:
    for line in open(path):
        if line.startswith(field + ":"):
            return bool(int(line.split()[1], 16) >> (signal.SIGUSR1 - 1) & 1)
    return False


def caught() -> bool:
    return usr1_bit("/proc/self/status", "SigCgt")


def blocking() -> str:
    """Threads that block SIGUSR1 (main thread marked), of all threads."""
    tids = os.listdir("/proc/self/task")
    blk = [t for t in tids if usr1_bit(f"/proc/self/task/{t}/status", "SigBlk")]
    main = "main blocks" if str(os.getpid()) in blk else "main open"
    return f"{len(blk)}/{len(tids)} threads block USR1 ({main})"


def check(stage: str, r: int) -> None:
    os.kill(os.getpid(), signal.SIGUSR1)
    got = b""
    while select.select([r], [], [], 0.5)[0]:
        got += os.read(r, 1 << 16)
    print(f"{stage:28s} dump {len(got):6d} bytes  SigCgt USR1={caught()}  {blocking()}  "
          f"python handler={signal.getsignal(signal.SIGUSR1)}", flush=True)


def main() -> None:
    r, w = os.pipe()
    os.set_blocking(w, False)
    faulthandler.register(signal.SIGUSR1, file=w, all_threads=True, chain=False)
    check("registered", r)
    torch.cuda.init()
    x = torch.randn(1024, 1024, device="cuda")
    check("cuda", r)
    torch.distributed.init_process_group("nccl")
    torch.distributed.all_reduce(x)
    torch.cuda.synchronize()
    check("nccl all_reduce", r)
    f = torch.compile(lambda t: (t.sin() @ t).relu().sum())
    f(x)
    check("torch.compile", r)
    dl = torch.utils.data.DataLoader(range(64), batch_size=8, num_workers=1)
    next(iter(dl))
    check("dataloader worker", r)
    faulthandler.register(signal.SIGUSR1, file=w, all_threads=True, chain=False)
    check("registered again", r)
    # what nsa_flex.titan.ops does instead: a Python-level handler + signal.set_wakeup_fd, whose
    # C handler writes the signal number into the pipe at once
    signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    signal.signal(signal.SIGUSR1, lambda *a: None)
    check("wakeup fd + python handler", r)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
