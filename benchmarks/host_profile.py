"""Where the host time of one block_attention call goes (run on a GPU):

    python3 benchmarks/host_profile.py [--backends tlx triton fa2] [--out host_profile.json]
    python3 benchmarks/host_profile.py --cpu [--backends tlx triton] [--out host_cpu.json]  # no GPU

An eager TLX forward takes longer than one replayed from a CUDA graph on the H200 (the eager / graph
row of benchmarks/results/attention_eager_graph_h200.md): the difference is host time, not the kernel. For each backend this prints
- host_us: wall time per call on a tiny batch (device work negligible), forward and fwd+bwd;
- the top functions by own time under cProfile over those calls;
- at a full-size shape, the eager and CUDA-graph forward medians (do_bench), whose gap is host time;
- host_stages_us: each layer of one forward call timed alone (custom-op wrappers hide their
  callees from cProfile, so its own-time column cannot say which layer costs what).

--cpu measures the same stages without a GPU: fp16 CPU tensors, the backend's Triton kernels
replaced by a stub that takes the launch's arguments and returns, so what is timed is the Python
path up to the launch (not Triton's own launch: its argument binding, the TMA descriptors' encoding,
the driver call). Besides microseconds (this machine's, noisy), each stage reports the Python
function calls one call makes, which no machine's speed changes. The triton backend runs under
TRITON_INTERPRET=1 (set here); tlx needs a Python with TLX (fbtriton) and is told it may run on
CPU. The block table is built by torch ops on CPU (by a Triton kernel on CUDA).
"""

import argparse
import contextlib
import cProfile
import io
import json
import os
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import replay_ms  # noqa: E402
from kernels import block_attention, block_table, check_backend, get_backend  # noqa: E402

TINY = (4, 256, 4, 64)  # (B, S, H, D): a few microseconds of device work
FULL = (2048, 256, 4, 64)


def make_inputs(shape, device, requires_grad, dtype=torch.bfloat16):
    batch, seq_len, heads, head_dim = shape
    tokens = batch * seq_len
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v, grad_out = (torch.randn(tokens, heads, head_dim, device=device, dtype=dtype, generator=gen)
                         for _ in range(4))
    offsets = torch.arange(0, tokens + 1, seq_len, device=device, dtype=torch.int32)
    leaves = [x.requires_grad_(requires_grad) for x in (q, k, v)]
    return leaves, grad_out, offsets


def synchronize() -> None:
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def host_us(fn, calls=300) -> float:
    for _ in range(20):
        fn()
    synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def python_calls(fn, calls=20) -> float:
    """Python function calls (not C builtins) per call of fn, after a warm-up call."""
    fn()
    count = 0

    def tally(frame, event, arg):
        nonlocal count
        count += event == "call"

    sys.setprofile(tally)
    try:
        for _ in range(calls):
            fn()
    finally:
        sys.setprofile(None)
    return count / calls


def top_functions(fn, calls=300, lines=22) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(lines)
    return text.getvalue()


def stage_calls(backend, device, dtype=torch.bfloat16) -> dict:
    """Each layer of one forward on the tiny batch, as a call, through public names only: the block
    table, the backend's run (its custom op and launcher), the dispatcher given the prebuilt table,
    and the dispatcher given offsets (which builds the table, or finds the one it built for the same
    offsets); with autograd recording, and fwd+bwd."""
    leaves, grad_out, offsets = make_inputs(TINY, device, False, dtype)
    q, k, v = leaves
    table = block_table(offsets, q.shape[0])
    run = get_backend(backend).run
    grad_leaves = [x.detach().requires_grad_() for x in leaves]
    return {
        "block_table": lambda: block_table(offsets, q.shape[0]),
        # A copy of offsets per call, so the table is built, not reused (the copy's time included).
        "block_table_new_offsets": lambda: block_table(offsets.clone(), q.shape[0]),
        "backend_run": lambda: run(q, k, v, table, None, None, False, ""),
        "dispatcher_table": lambda: block_attention(q, k, v, table, backend=backend),
        "dispatcher_offsets": lambda: block_attention(q, k, v, offsets, backend=backend, check_offsets=False),
        "dispatcher_table_grad": lambda: block_attention(*grad_leaves, table, backend=backend),
        "dispatcher_table_fwd_bwd": lambda: torch.autograd.grad(
            block_attention(*grad_leaves, table, backend=backend), grad_leaves, grad_out),
    }


def host_stages(backend, device) -> dict:
    """Host microseconds of each of stage_calls' layers."""
    return {name: host_us(fn) for name, fn in stage_calls(backend, device).items()}


def profile_backend(backend, device, timer) -> dict:
    leaves, grad_out, offsets = make_inputs(TINY, device, True)
    table = block_table(offsets, leaves[0].shape[0])

    def fwd():
        return block_attention(*leaves, table, backend=backend)

    def fwd_bwd():
        torch.autograd.grad(fwd(), leaves, grad_out)

    row = dict(fwd_host_us=host_us(fwd), fwd_bwd_host_us=host_us(fwd_bwd), host_stages_us=host_stages(backend, device))
    with torch.no_grad():
        row["fwd_no_grad_host_us"] = host_us(fwd)
    row["fwd_profile"] = top_functions(fwd)
    row["fwd_bwd_profile"] = top_functions(fwd_bwd, calls=150)

    leaves, grad_out, offsets = make_inputs(FULL, device, False)
    table = block_table(offsets, leaves[0].shape[0])

    def full_fwd():
        return block_attention(*leaves, table, backend=backend)

    row["full_fwd_eager_ms"] = timer(full_fwd)
    row["full_fwd_graph_ms"] = replay_ms(full_fwd, timer)
    return row


class StubKernel:
    """Stands for a jitted kernel: `kernel[grid](*args, **kwargs)` takes the launch and returns."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@contextlib.contextmanager
def launch_stubs(backend: str):
    """The backend's Triton kernels as StubKernels, and for tlx what it asks of a GPU (the SM count,
    the device context, its availability) answered as on one, while inside."""
    import triton

    from kernels import dispatch

    module = sys.modules[dispatch.BACKEND_MODULES[backend]]
    jitted = (triton.runtime.JITFunction, triton.runtime.interpreter.InterpretedFunction)
    saved = {name: obj for name, obj in vars(module).items() if isinstance(obj, jitted)}
    cpu = torch.device("cpu")
    unavailable = dispatch._unavailable.get((backend, cpu))
    cuda_device = torch.cuda.device
    try:
        for name in saved:
            setattr(module, name, StubKernel())
        if backend == "tlx":
            saved["_num_sms"] = module._num_sms
            module._num_sms = lambda device: 132  # an H200's
            torch.cuda.device = lambda device: contextlib.nullcontext()
            dispatch._unavailable[(backend, cpu)] = None
        yield
    finally:
        for name, obj in saved.items():
            setattr(module, name, obj)
        torch.cuda.device = cuda_device
        dispatch._unavailable[(backend, cpu)] = unavailable


def cpu_main(backends: list[str], out: Path | None) -> int:
    """--cpu: host_us and python_calls of each stage_calls layer, launches stubbed."""
    from kernels import dispatch

    report = {"torch": torch.__version__, "tiny": TINY, "dtype": "float16", "backends": {}}
    for backend in backends:
        try:
            dispatch.get_backend(backend)  # imports its module
            if backend == "tlx" and not sys.modules[dispatch.BACKEND_MODULES[backend]].HAS_TLX:
                raise RuntimeError("TLX is not installed in this Python (run it with .venv-tlx/bin/python)")
            with launch_stubs(backend):
                stages = stage_calls(backend, torch.device("cpu"), torch.float16)
                row = {name: dict(host_us=host_us(fn, calls=200), python_calls=python_calls(fn))
                       for name, fn in stages.items()}
        except Exception as exc:  # one backend's failure must not hide the others' numbers
            row = dict(error=f"{type(exc).__name__}: {exc}")
        report["backends"][backend] = row
        print(f"== {backend} (CPU, kernel launches stubbed)", flush=True)
        for stage, numbers in row.items():
            if stage == "error":
                print(f"   error: {numbers}", flush=True)
                continue
            print(f"   {stage:26} {numbers['host_us']:8.1f} us {numbers['python_calls']:7.1f} Python calls", flush=True)
    if out:
        out.write_text(json.dumps(report, indent=1))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", default=None, help="default: tlx triton fa2 (--cpu: tlx triton)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--cpu", action="store_true", help="the Python path up to the launch on CPU, no GPU needed")
    args = parser.parse_args()
    if args.cpu:
        # Before the triton backend's module is imported: triton.jit reads it then.
        os.environ["TRITON_INTERPRET"] = "1"
        return cpu_main(args.backends or ["tlx", "triton"], args.out)
    args.backends = args.backends or ["tlx", "triton", "fa2"]
    import triton.testing

    device = torch.device("cuda")
    timer = lambda fn: float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))  # noqa: E731
    # Backends under their own key: a backend named "triton" would otherwise overwrite the version.
    report = {"torch": torch.__version__, "triton": triton.__version__, "tiny": TINY, "full": FULL, "backends": {}}
    for backend in args.backends:
        try:
            check_backend(backend, device)
            row = profile_backend(backend, device, timer)
        except Exception as exc:  # one backend's failure must not hide the others' numbers
            row = dict(error=f"{type(exc).__name__}: {exc}")
        report["backends"][backend] = row
        numbers = {k: round(v, 3) for k, v in row.items() if isinstance(v, float)}
        print(f"== {backend}: {numbers or row}", flush=True)
        for stage, us in row.get("host_stages_us", {}).items():
            print(f"   {stage:22} {us:8.1f} us", flush=True)
        print(row.get("fwd_profile", "")[:3500], flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
