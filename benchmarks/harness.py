"""What the benchmarks here share: a timer per device (triton's do_bench on CUDA, a wall-clock median on
CPU), CUDA-graph replay, the copy-bandwidth ceiling, memory release between rows, one-line skip
reasons, and the device and software versions a report names."""

import gc
import importlib.metadata
import importlib.util
import os
import platform
import statistics
import time
from typing import Callable

import torch


# -------------------------------------------------------------------------------------- skip reasons


class SkipRow(Exception):
    """This implementation cannot run these inputs; the message says why."""


def describe(error: BaseException, warned: list | tuple = ()) -> str:
    """One line for a skip reason: the error's first line, plus any warnings that explain it (SDPA)."""
    lines = str(error).strip().splitlines()
    first = lines[0] if lines else ""
    text = first if isinstance(error, SkipRow) else f"{type(error).__name__}: {first}"
    # SDPA says only "No available kernel"; the reasons each backend declined come as warnings.
    notes = dict.fromkeys(str(w.message).strip().splitlines()[0] for w in warned if str(w.message).strip())
    if notes and "No available kernel" in first:
        text += " [warnings: " + " | ".join(notes) + "]"
    return text[:600]


# -------------------------------------------------------------------------------------------- timing


def cpu_median_ms(fn: Callable, warmup_ms: float, rep_ms: float) -> float:
    """Median wall time of fn on CPU, where do_bench's device events don't exist."""
    for budget_ms in (warmup_ms, rep_ms):  # the first round only warms up
        times = []
        while len(times) < 3 or sum(times) < budget_ms:
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def make_timer(device: torch.device, warmup_ms: int, rep_ms: int) -> Callable[[Callable], float]:
    if device.type == "cuda":
        import triton.testing

        return lambda fn: float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    return lambda fn: cpu_median_ms(fn, warmup_ms, rep_ms)


def replay_ms(fn: Callable, timer: Callable) -> float:
    """timer's median of fn replayed from a CUDA graph: device time without the host's work. The
    graph (and its memory pool) is released on return."""
    side = torch.cuda.Stream()  # capture wants one run first, off the capturing stream
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return timer(graph.replay)


def measure_copy_bw_tbps(device: torch.device, nbytes: int, timer: Callable) -> float:
    """Device-to-device copy bandwidth, (bytes read + bytes written) / time, in TB/s."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3) / 1e12


def free_memory(device: torch.device, after_error: bool = False) -> None:
    if after_error:  # a traceback's frames may hold tensors in reference cycles; a full gc costs ~0.3 s
        gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------- what ran it


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()})"


def versions() -> dict:
    found = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import triton

        found["triton"] = triton.__version__  # fbtriton installs as the `triton` module too
    except ImportError:
        found["triton"] = None
    try:
        found["tlx"] = importlib.util.find_spec("triton.language.extra.tlx") is not None
    except ImportError:
        found["tlx"] = False
    for dist in ("fbtriton", "triton-utlx", "flash-attn"):
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    # Triton's switches change what is timed (fbtriton's C launch path, the interpreter): a result names them.
    found["triton_environment"] = {name: value for name, value in sorted(os.environ.items()) if name.startswith("TRITON_")}
    return found
