"""Where the host time of one block_attention call goes (run on a GPU):

    python3 benchmarks/host_profile.py [--backends tlx triton fa2] [--out host_profile.json]

An eager TLX forward takes longer than one replayed from a CUDA graph on the H200 (the eager / graph
row of benchmarks/results/attention_eager_graph_h200.md): the difference is host time, not the kernel. For each backend this prints
- host_us: wall time per call on a tiny batch (device work negligible), forward and fwd+bwd;
- the top functions by own time under cProfile over those calls;
- at a full-size shape, the eager and CUDA-graph forward medians (do_bench), whose gap is host time;
- host_stages_us: each layer of one forward call timed alone (custom-op wrappers hide their
  callees from cProfile, so its own-time column cannot say which layer costs what).
"""

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_attention import replay_ms  # noqa: E402
from kernels import block_attention, block_table, check_backend, get_backend  # noqa: E402

TINY = (4, 256, 4, 64)  # (B, S, H, D): a few microseconds of device work
FULL = (2048, 256, 4, 64)


def make_inputs(shape, device, requires_grad):
    batch, seq_len, heads, head_dim = shape
    tokens = batch * seq_len
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v, grad_out = (torch.randn(tokens, heads, head_dim, device=device, dtype=torch.bfloat16, generator=gen)
                         for _ in range(4))
    offsets = torch.arange(0, tokens + 1, seq_len, device=device, dtype=torch.int32)
    leaves = [x.requires_grad_(requires_grad) for x in (q, k, v)]
    return leaves, grad_out, offsets


def host_us(fn, calls=300) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


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


def host_stages(backend, device) -> dict:
    """Host microseconds of each layer of one forward on the tiny batch, through public names only:
    the block table, the backend's run (its custom op and launcher), the dispatcher given the
    prebuilt table, and the dispatcher given offsets (which builds the table); with and without
    autograd recording."""
    leaves, _, offsets = make_inputs(TINY, device, False)
    q, k, v = leaves
    table = block_table(offsets, q.shape[0])
    run = get_backend(backend).run
    stages = {
        "block_table": lambda: block_table(offsets, q.shape[0]),
        "backend_run": lambda: run(q, k, v, table, None, None, False, ""),
        "dispatcher_table": lambda: block_attention(q, k, v, table, backend=backend),
        "dispatcher_offsets": lambda: block_attention(q, k, v, offsets, backend=backend, check_offsets=False),
    }
    result = {name: host_us(fn) for name, fn in stages.items()}
    leaves = [x.requires_grad_() for x in leaves]
    result["dispatcher_table_grad"] = host_us(lambda: block_attention(*leaves, table, backend=backend))
    return result


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", default=["tlx", "triton", "fa2"])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
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
