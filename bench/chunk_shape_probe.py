"""Probe (session 35): does a prefill chunk of a token count not seen before cost extra?"""

import sys
import time

import torch

from bench.prefill import _random_setup
from splitflash.services.verify.sampling import Sampling


class A:
    shape, device, contexts = "smollm2-135m", "cuda", [120_000]


engine, prompts = _random_setup(A)
prompt = prompts(120_000)
engine.prefill_chunk = 8192
run = engine.start_prefill("p", prompt, Sampling(), (), 2)
for _ in range(6):
    run.advance(8192)
torch.cuda.synchronize()


def timed(n):
    t0 = time.perf_counter()
    run.advance(n)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


for n in (3000, 3000, 3001, 3001, 3072, 3072, 2048, 2048, 1000, 1000):
    print(f"{n} tokens after {run.cached}: {timed(n):.1f} ms", flush=True)
if "--profile" in sys.argv:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        timed(1234)
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))
