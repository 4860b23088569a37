"""What ``danlu.resumable`` costs a training loop, and how much work a preemption loses.

The model: an MLP 1024 -> 2048 -> 2048 -> 2048 -> 10 (about 10.5 M parameters) trained with AdamW on
a batch of 64 on one CPU thread: its state (weights and Adam's two moments, plus the RNGs) is about
126 MB, what a small transformer's is. Two measurements, in one run so the machine is the same:

* **overhead**: blocks of ``--block`` steps alternate between a plain ``for step in range(...)`` and
  ``state.steps()`` (an interval longer than the run, so no save inside): the median of the paired
  ratios is the loop's own cost, each pair seeing the same machine. Then ``--saves`` saves are timed
  (the median). The overhead at the default interval (:data:`danlu.resumable.DEFAULT_EVERY`, ``"5m"``) is
  ``ratio - 1 + save / 300 s``, printed with 1, 2 and 10 minutes beside it. Target (CheckFreq,
  FAST '21): at most 3.5%. The loop's own cost is also counted directly: microseconds a step of
  ``state.steps()`` costs beyond ``range`` in an empty loop, in one process and on a rank of two
  (gloo, where the ranks' agreement is an all-reduce about once a second).
* **lost work**: a child trains with ``every=--lost-every`` (default 40 steps) and is SIGKILLed at a
  random moment, then resumed: the steps done again (the last step it finished, minus the step it
  resumed from) must be at most one interval. The same with SIGTERM: none (it saves at the next step).

Run: ``.venv/bin/python benchmarks/checkpoint_overhead.py [--blocks 30] [--block 5]``; about 2 minutes on
two busy cores.
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = """
import sys, time, torch, danlu
sys.path.insert(0, {here!r})
from checkpoint_overhead import build, step_once
torch.set_num_threads(1)
model, opt, data = build()
state = danlu.resumable(model=model, optimizer=opt, every={every})
print("resumed", state.step, flush=True)
for step in state.steps(10**9):
    step_once(model, opt, data, step)
    print("done", step, flush=True)
"""


RANKS = """
import time, torch, torch.distributed as dist
from danlu.resumable import Resumable
dist.init_process_group("gloo")
n = 20000
state = Resumable(every="1h", directory={folder!r}, n=0)
loop = state.steps(10**9)
for _ in zip(range(1000), loop):  # warm up
    pass
t = time.perf_counter()
for _ in zip(range(n), loop):
    pass
ours = time.perf_counter() - t
t = time.perf_counter()
for _ in range(n):
    pass
plain = time.perf_counter() - t
if dist.get_rank() == 0:
    print(f"per step {{(ours - plain) / n * 1e6:.2f}} us", flush=True)
loop.close()
dist.destroy_process_group()
"""


def per_step(folder: Path) -> tuple[float, float]:
    """Microseconds a step of ``state.steps()`` costs beyond ``range``: one process, and a rank of two (gloo)."""
    import socket

    from danlu.resumable import Resumable

    state = Resumable(every="1h", directory=folder / "one", n=0)
    loop, n = state.steps(10**9), 200_000
    start = time.perf_counter()
    for _ in zip(range(n), loop, strict=False):
        pass
    ours = time.perf_counter() - start
    start = time.perf_counter()
    for _ in zip(range(n), range(n), strict=True):
        pass
    one = (ours - (time.perf_counter() - start)) / n * 1e6
    loop.close()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    script = folder / "ranks.py"
    script.write_text(RANKS.format(folder=str(folder / "ranks")))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(port),
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    found = [line for line in out.stdout.splitlines() if line.startswith("per step")]
    return one, float(found[0].split()[2]) if found else float("nan")


def build():
    import torch  # deferred: the parent only starts children until it measures

    torch.manual_seed(0)
    sizes = [1024, 2048, 2048, 2048, 10]
    layers = []
    for a, b in zip(sizes, sizes[1:], strict=False):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers[:-1])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = (torch.randn(512, 1024), torch.randint(0, 10, (512,)))
    return model, opt, data


def step_once(model, opt, data, step):
    import torch  # deferred: as above

    x, y = data
    i = (step * 64) % 512
    loss = torch.nn.functional.cross_entropy(model(x[i : i + 64]), y[i : i + 64])
    opt.zero_grad()
    loss.backward()
    opt.step()


def state_bytes(model, opt) -> int:
    from danlu.resumable_ranks import _bytes

    return _bytes(model.state_dict()) + _bytes(opt.state_dict())


def overhead(blocks: int, block: int, saves: int, folder: Path) -> tuple[float, float, list[float]]:
    """(median of the paired ratios resumable block / plain block, step seconds, seconds of each save).

    Blocks of ``block`` steps alternate: plain ``range``, then the same number pulled from one long
    ``state.steps()`` (an interval longer than the run: no save inside). Pairs close in time see the same
    machine, so the ratio of each pair cancels what else the machine does; the median of the pairs is taken.
    """
    from danlu.resumable import Resumable

    model, opt, data = build()
    step_once(model, opt, data, 0)  # Adam's state exists, as in a real run's later saves
    state = Resumable(every="1h", directory=folder, model=model, optimizer=opt)
    loop = state.steps(10**9)
    ratios, plain_times, n = [], [], 0
    for i in range(blocks):
        timed = {}
        for kind in ("plain", "resumable") if i % 2 == 0 else ("resumable", "plain"):  # neither always first
            start = time.perf_counter()
            if kind == "plain":
                for _ in range(block):
                    step_once(model, opt, data, n)
                    n += 1
            else:
                for step in itertools.islice(loop, block):
                    step_once(model, opt, data, step)
            timed[kind] = time.perf_counter() - start
        ratios.append(timed["resumable"] / timed["plain"])
        plain_times.append(timed["plain"] / block)
    loop.close()
    took = []
    for _ in range(saves):
        start = time.perf_counter()
        state.save()
        took.append(time.perf_counter() - start)
        state.step += 1
    return statistics.median(ratios), statistics.median(plain_times), took


def lost_work(every_steps: int, sig: int, folder: Path) -> tuple[int, int, int]:
    """(last step done before the signal, step resumed from, steps done again)."""
    here = str(Path(__file__).resolve().parent)
    code = CHILD.format(here=here, every=every_steps)
    from danlu import env as names

    env = {**os.environ, names.CHECKPOINT_DIR: str(folder), "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    done, deadline = -1, None
    for line in child.stdout:
        if line.startswith("resumed"):
            deadline = time.monotonic() + random.uniform(8, 16)
        elif line.startswith("done"):
            done = int(line.split()[1])
        if deadline and time.monotonic() > deadline:
            child.send_signal(sig)
            deadline = None
    child.wait()
    resumed = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    first = resumed.stdout.readline()
    resumed.kill()
    resumed.wait()
    at = int(first.split()[1])
    return done, at, done + 1 - at


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=30)
    parser.add_argument("--block", type=int, default=5)
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--lost-every", type=int, default=40)
    args = parser.parse_args()
    import torch  # deferred: as above

    from danlu.resumable import DEFAULT_EVERY, parse_every

    torch.set_num_threads(1)
    model, opt, data = build()
    step_once(model, opt, data, 0)
    print(f"state: {state_bytes(model, opt) / 1e6:.0f} MB (model and AdamW)")
    with tempfile.TemporaryDirectory() as tmp:
        ratio, step, saves = overhead(args.blocks, args.block, args.saves, Path(tmp) / "overhead")
        save = statistics.median(saves)
        interval = parse_every(DEFAULT_EVERY)[1]
        print(
            f"step {step * 1000:.1f} ms; a save {save:.2f} s "
            f"(median of {len(saves)}: {', '.join(f'{s:.2f}' for s in saves)})"
        )
        print(
            f"the loop's bookkeeping: resumable/plain = {ratio:.4f} "
            f"(median of {args.blocks} pairs of {args.block} steps)"
        )
        one, ranked = per_step(Path(tmp))
        print(f"per step of state.steps() beyond range(): {one:.2f} us; a rank of two (gloo): {ranked:.2f} us")
        at_default = max(0.0, ratio - 1) + save / interval
        print(f"every={DEFAULT_EVERY} (default): overhead {at_default * 100:.2f}% (target <= 3.5%)")
        for every in ("1m", "2m", "10m"):
            print(f"  every={every}: {(max(0.0, ratio - 1) + save / parse_every(every)[1]) * 100:.2f}%")
        ok = at_default <= 0.035
        print(f"lost work, every={args.lost_every} steps ({args.lost_every * step:.1f} s of steps):")
        for name, sig in (("SIGKILL", signal.SIGKILL), ("SIGTERM", signal.SIGTERM)):
            done, at, again = lost_work(args.lost_every, sig, Path(tmp) / name)
            limit = args.lost_every if sig == signal.SIGKILL else 0
            ok = ok and 0 <= again <= limit
            print(f"  {name}: last step done {done}, resumed from step {at}: {again} steps done again (<= {limit})")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
