"""Where the host time of one block_attention call goes (run on a GPU):

    python3 benchmarks/host_profile.py [--backends tlx triton fa2] [--out host_profile.json]

On the first H200 sweep the TLX forward took 0.96 ms per eager call but 0.32 ms replayed from a
CUDA graph, so the eager number measured the host, not the kernel. For each backend this prints
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
import math
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_attention import replay_ms  # noqa: E402
from kernels import block_attention, check_backend  # noqa: E402

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
    """Host microseconds of each layer of one no-grad forward on the tiny batch, innermost first,
    and of the public function and the dispatcher with autograd recording."""
    from kernels.blocks import counted_block_table

    leaves, _, offsets = make_inputs(TINY, device, False)
    q, k, v = leaves
    tokens, heads, head_dim = q.shape
    table = counted_block_table(offsets, tokens)

    def device_context():
        with torch.cuda.device(q.device):
            pass

    stages = {"block_table": lambda: counted_block_table(offsets, tokens), "device_context": device_context}
    if backend == "tlx":
        from kernels import tlx_block_attention as m

        cfg = m.tlx_config(head_dim, False, False)
        out = torch.empty_like(q)

        def descriptors():
            return [m._tma_desc(x, head_dim) for x in (q, k, v, out)]

        descs = descriptors()
        grid = m._grid(q, table[0])

        def kernel_launch():
            m._tlx_block_attn_fwd[grid](*descs, None, None, out, *table, heads, heads * head_dim, 1 / math.sqrt(head_dim),
                                        HEAD_DIM=head_dim, ROTARY=False, ROTATE_V=False, num_warps=4, num_stages=1, **cfg)

        stages.update(
            check_inputs=lambda: m._check_inputs(q, k, v, offsets, None, None),
            unsupported_reason=lambda: m.tlx_unsupported_reason(q),
            tlx_config=lambda: m.tlx_config(head_dim, False, False),
            descriptors=descriptors,
            kernel_launch=kernel_launch,
            forward_impl=lambda: m._tlx_forward_impl(q, k, v, *table, None, None, False),
            custom_op=lambda: m._tlx_fwd_op(q, k, v, *table, None, None, False),
            public_function=lambda: m.block_attention_tlx(q, k, v, offsets),
        )
    elif backend == "triton":
        from kernels import triton_block_attention as m

        out = torch.empty_like(q)
        stages.update(
            launch_forward=lambda: m._launch_forward(q, k, v, *table, None, None, False, out),
            custom_op=lambda: m._forward_op(q, k, v, *table, None, None, False),
            public_function=lambda: m.block_attention_triton(q, k, v, offsets),
        )
    stages["dispatcher"] = lambda: block_attention(q, k, v, offsets, backend=backend, check_offsets=False)
    result = {name: host_us(fn) for name, fn in stages.items()}
    leaves = [x.requires_grad_() for x in leaves]
    if "public_function" in stages:
        result["public_function_grad"] = host_us(stages["public_function"])
    result["dispatcher_grad"] = host_us(lambda: block_attention(*leaves, offsets, backend=backend, check_offsets=False))
    return result


def profile_backend(backend, device, timer) -> dict:
    leaves, grad_out, offsets = make_inputs(TINY, device, True)

    def fwd():
        return block_attention(*leaves, offsets, backend=backend, check_offsets=False)

    def fwd_bwd():
        torch.autograd.grad(fwd(), leaves, grad_out)

    row = dict(fwd_host_us=host_us(fwd), fwd_bwd_host_us=host_us(fwd_bwd), host_stages_us=host_stages(backend, device))
    with torch.no_grad():
        row["fwd_no_grad_host_us"] = host_us(fwd)
    row["fwd_profile"] = top_functions(fwd)
    row["fwd_bwd_profile"] = top_functions(fwd_bwd, calls=150)

    leaves, grad_out, offsets = make_inputs(FULL, device, False)

    def full_fwd():
        return block_attention(*leaves, offsets, backend=backend, check_offsets=False)

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
    report = {"torch": torch.__version__, "triton": triton.__version__, "tiny": TINY, "full": FULL}
    for backend in args.backends:
        try:
            check_backend(backend, device)
            row = profile_backend(backend, device, timer)
        except Exception as exc:  # one backend's failure must not hide the others' numbers
            row = dict(error=f"{type(exc).__name__}: {exc}")
        report[backend] = row
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
