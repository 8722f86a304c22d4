"""CUDA-event timing helpers: a median of single calls, of calls queued
behind a busy GPU, and of candidates interleaved round by round. Below both
``cupy_act.testing`` (the benchmarks' helpers) and the torch adapter (the
convolution's ``"auto"`` times its candidates with them); needs torch."""

from __future__ import annotations

import random
import statistics

import torch

_cycles_per_ms: list[float] = []


def _queue_gpu(ms: float) -> None:
    """Keep the current stream busy for about ``ms`` (a spinning kernel,
    torch.cuda._sleep, calibrated once against CUDA events)."""
    if not _cycles_per_ms:
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(1_000_000)
        stop.record()
        stop.synchronize()
        _cycles_per_ms.append(1_000_000 / start.elapsed_time(stop))
    torch.cuda._sleep(int(ms * _cycles_per_ms[0]))


def median_ms(
    fn,
    iters: int = 20,
    warmup: int = 3,
    reps: int = 1,
    queued_ms: float = 0.0,
    settle_ms: float = 0.0,
) -> float:
    """Median CUDA-event time of ``fn()`` in ms, after ``warmup`` untimed calls.

    The time runs from the host's call to the GPU's end of the work, so a
    call's host cost counts where the GPU would wait for it. With ``reps`` >
    1 each timing covers that many back-to-back calls and is divided by it:
    the time per call of a launch-bound (small) op, host cost included,
    rather than the kernel alone. With ``queued_ms`` the GPU is kept busy
    that long before each timing starts, so the host's work is done while it
    waits (``queued_ms`` must exceed it): the GPU's time alone. With
    ``settle_ms`` the GPU works that long before each timing and the host
    waits for it, untimed: the state a single shot of a kernel that long
    leaves the host in (the host runs slower after a longer wait), for the
    floor of such a call.
    """
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if settle_ms:
            _queue_gpu(settle_ms)
            torch.cuda.current_stream().synchronize()
        if queued_ms:
            _queue_gpu(queued_ms)
        start.record()
        for _ in range(reps):
            fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / reps)
    return statistics.median(times)


def interleaved_median_ms(
    fns: dict, rounds: int = 9, warmup: int = 2, single_shot: bool = False
) -> dict:
    """{name: median CUDA-event ms} of each ``fns[name]()``, timed in turn round
    after round, so that a drift of the clocks or of the machine's load hits
    every candidate alike; each round in an order of its own (shuffled from
    a fixed seed: the same every call), so that no candidate always follows
    the same one (what ran just before can slow a call: clocks lowered by a
    heavy kernel, a cache left cold); ``warmup`` untimed calls of each first.

    Calls follow one another without waiting, so a call's time is its GPU
    time where the one before left the GPU busy, and includes its host's
    where it did not. ``single_shot`` times each call as ``median_ms`` does:
    right after an untimed call of its own (so that what ran before it is the
    same for every candidate) and a wait for the GPU, from the host's call to
    the GPU's end.
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    events: dict = {name: [] for name in fns}
    items = list(fns.items())
    for r in range(rounds):
        for name, fn in random.Random(r).sample(items, len(items)):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if single_shot:
                fn()
                torch.cuda.synchronize()
            start.record()
            fn()
            stop.record()
            if single_shot:
                stop.synchronize()
            events[name].append((start, stop))
    torch.cuda.synchronize()
    return {n: statistics.median(a.elapsed_time(b) for a, b in ev) for n, ev in events.items()}
