"""Ahead-of-time compile of every TLX kernel configuration to an sm_90 cubin, no GPU needed.

Runs in a Python with fbtriton (TLX) and without TRITON_INTERPRET. Each configuration is compiled
with the same signature and specialization a real launch produces: host TMA descriptors mangle
to `tensordesc<dtype[64, D]>`, pointers from torch's allocator and the token stride H*D are
16-divisible. `python -m kernels.tlx_aot` prints one line per configuration and exits nonzero if
any fails to compile.
"""

import os
import sys
import time
from dataclasses import dataclass

from . import attention_sublayer_tlx, mlp_sublayer_tlx
from .block_attention_tlx import HAS_TLX, SM90_MAX_SMEM, config_smem_bytes, tlx_config

if HAS_TLX:
    import triton
    from triton.backends.compiler import GPUTarget

    from .attention_sublayer_tlx import _tlx_attention_sublayer_bwd, _tlx_attention_sublayer_fwd
    from .mlp_sublayer_tlx import _tlx_mlp_sublayer_bwd, _tlx_mlp_sublayer_fwd
    from .block_attention_tlx import _tlx_block_attn_bwd, _tlx_block_attn_fwd
    from .sublayer_triton import tanh_gelu


# Tuning variants that `python -m benchmarks.sweep --backend tlx` times on the GPU: name -> (fwd
# knobs, bwd knobs), as block_attention(..., backend="tlx", launch={"fwd": fwd, "bwd": bwd}) takes
# them ({} = the production default; a knob value may be a {head_dim: value} dict). Each must compile
# here, so the sweep never finds out on the GPU that a variant doesn't build.
TUNING_VARIANTS: dict[str, tuple[dict, dict]] = {
    "default": ({}, {}),
    # The first H200 run's kernels: shallow rings, O stored from registers.
    "v1": (dict(NUM_STAGES={64: 4, 128: 2}, O_TMA_STORE=False), dict(NUM_STAGES=2)),
    "fwd_reg_store": (dict(O_TMA_STORE=False), {}),
    "fwd_half_ring": (dict(NUM_STAGES={64: 4, 128: 2}), {}),
    "fwd_1_consumer": (dict(NUM_CONSUMERS=1), {}),
    "fwd_1_consumer_reg_store": (dict(NUM_CONSUMERS=1, O_TMA_STORE=False), {}),
    "bwd_1_consumer": ({}, dict(NUM_CONSUMERS=1)),
    "bwd_2_stages": ({}, dict(NUM_STAGES=2)),
    # P^T and dS^T in tiles of their own: shallower bwd rings, one consumer at D=128 with rotary.
    "bwd_separate_t_tiles": ({}, dict(SHARED_T_TILE=False)),
}


@dataclass(frozen=True)
class AotConfig:
    direction: str  # "fwd" or "bwd"
    head_dim: int
    rotary: bool
    rotate_v: bool
    dtype: str = "bf16"  # triton type string: bf16 or fp16
    variant: str = "default"  # a TUNING_VARIANTS key

    @property
    def knobs(self) -> dict:
        fwd, bwd = TUNING_VARIANTS[self.variant]
        return fwd if self.direction == "fwd" else bwd

    @property
    def name(self) -> str:
        rot = ("rotary_v" if self.rotate_v else "rotary") if self.rotary else "plain"
        suffix = "" if self.variant == "default" else f"@{self.variant}"
        return f"{self.direction}_d{self.head_dim}_{rot}_{self.dtype}{suffix}"


@dataclass(frozen=True)
class MlpAotConfig:
    """A kernel of the fused MLP sublayer's TLX backend (kernels/mlp_sublayer_tlx.py) at one d_model."""

    direction: str  # "fwd" or "bwd" (the token-tile backward)
    d_model: int
    x_dtype: str = "fp32"  # x under autocast; the matmuls' dtype is `dtype`
    dtype: str = "bf16"
    approximate: str = "none"  # GELU's, F.gelu's argument

    @property
    def name(self) -> str:
        suffix = "" if self.approximate == "none" else f"_gelu_{self.approximate}"
        return f"mlp_{self.direction}_d{self.d_model}_x{self.x_dtype}_{self.dtype}{suffix}"

    @property
    def knobs(self) -> dict:
        if self.direction == "fwd":
            return mlp_sublayer_tlx.tlx_mlp_config(self.d_model)
        cfg = mlp_sublayer_tlx.tlx_mlp_config(self.d_model, (("TRITON_BACKWARD", False),), backward=True)
        cfg.pop("TRITON_BACKWARD")  # a host-side choice, not a kernel constexpr
        return cfg


def mlp_aot_configs() -> list[MlpAotConfig]:
    dtypes = (("fp32", "bf16"), ("bf16", "bf16"), ("fp16", "fp16"))
    # The tanh GELU changes only the epilogue's arithmetic (one inline PTX instruction): every d_model under
    # autocast's dtypes, not every dtype again.
    return [MlpAotConfig(direction, d, x_dtype, dtype) for direction in ("fwd", "bwd")
            for d in mlp_sublayer_tlx.SUPPORTED_D_MODELS for x_dtype, dtype in dtypes] + [
        MlpAotConfig(direction, d, approximate="tanh") for direction in ("fwd", "bwd")
        for d in mlp_sublayer_tlx.SUPPORTED_D_MODELS]


def ast_source(fn, signature: dict, constexprs: dict, divisible) -> "ASTSource":
    """What a launch of `fn` compiles: `signature` (argument -> Triton type) completed by `constexprs`'
    names, checked against fn's arguments and put in their order, with the arguments named in `divisible`
    16-divisible, as a launch specializes pointers from torch's allocator (16-byte aligned) and such
    strides. For any Triton kernel, TLX or not."""
    from triton.compiler import ASTSource

    signature = dict(signature)
    for name in constexprs:
        signature.setdefault(name, "constexpr")
    assert set(signature) == set(fn.arg_names), (
        f"signature out of date with {fn.__name__}: {sorted(set(fn.arg_names) ^ set(signature))}")
    signature = {name: signature[name] for name in fn.arg_names}
    attrs = {(fn.arg_names.index(name), ): [["tt.divisibility", 16]] for name in divisible}
    return ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)


def _mlp_source(cfg: MlpAotConfig):
    D, chunk, dt = cfg.d_model, mlp_sublayer_tlx.BLOCK_H, cfg.dtype
    constexprs = dict(D=D, TANH_GELU=tanh_gelu(cfg.approximate), **cfg.knobs)
    weights = dict(desc_w1=f"tensordesc<{dt}[{chunk}, {D}]>", desc_w2=f"tensordesc<{dt}[{D}, {chunk}]>")
    chunk_desc = f"tensordesc<{dt}[64, {chunk}]>"
    if cfg.direction == "fwd":
        fn = _tlx_mlp_sublayer_fwd
        signature = dict(**weights, desc_hidden=chunk_desc, x_ptr=f"*{cfg.x_dtype}", norm_weight_ptr="*fp32",
                         norm_bias_ptr="*fp32", b1_ptr=f"*{dt}", b2_ptr=f"*{dt}", y_ptr=f"*{cfg.x_dtype}",
                         mean_ptr="*fp32", rstd_ptr="*fp32", T="i32", H="i32", eps="fp32")
    else:
        fn = _tlx_mlp_sublayer_bwd
        signature = dict(**weights, desc_hidden=chunk_desc, desc_grad_hidden=chunk_desc, desc_activation=chunk_desc,
                         grad_y_ptr=f"*{cfg.x_dtype}", x_ptr=f"*{cfg.x_dtype}", norm_weight_ptr="*fp32",
                         norm_bias_ptr="*fp32", mean_ptr="*fp32", rstd_ptr="*fp32", grad_normed_ptr="*fp32",
                         normed_ptr=f"*{dt}", db1_parts_ptr="*fp32", T="i32", H="i32", grad_y_stride="i32")
    # Pointers from torch's allocator are 16-byte aligned; H (and a contiguous dY's stride) are multiples of 64.
    divisible = [n for n in signature if n.endswith("_ptr")] + [n for n in ("H", "grad_y_stride") if n in signature]
    return ast_source(fn, signature, constexprs, divisible)


@dataclass(frozen=True)
class AttentionSublayerAotConfig:
    """A kernel of the attention sublayer's TLX "blocks" plan (kernels/attention_sublayer_tlx.py) at one shape."""

    direction: str  # "fwd" or "bwd"
    d_model: int
    head_dim: int
    rotary: bool
    rotate_v: bool = False
    x_dtype: str = "fp32"  # x under autocast; the matmuls' dtype is `dtype`
    dtype: str = "bf16"

    @property
    def name(self) -> str:
        rot = ("rotary_v" if self.rotate_v else "rotary") if self.rotary else "plain"
        x_dtype = f"_x{self.x_dtype}" if self.direction == "fwd" else ""  # the backward never reads x
        return (f"attention_sublayer_{self.direction}_d{self.d_model}_h{self.head_dim}_{rot}{x_dtype}_"
                f"{self.dtype}")

    @property
    def knobs(self) -> dict:
        return attention_sublayer_tlx.tlx_attention_sublayer_config(self.d_model, self.head_dim,
                                                                    backward=self.direction == "bwd")


def attention_sublayer_aot_configs() -> list[AttentionSublayerAotConfig]:
    """Each direction at every supported shape with rotary on q, k in the model's dtypes; the rotary
    variants and the other dtypes at the gpu config's shape (d_model 256, heads of 64)."""
    configs = []
    for direction in ("fwd", "bwd"):
        configs += [AttentionSublayerAotConfig(direction, d, h, True) for d, h in attention_sublayer_tlx.SUPPORTED_SHAPES]
        configs += [AttentionSublayerAotConfig(direction, 256, 64, False),
                    AttentionSublayerAotConfig(direction, 256, 64, True, True),
                    AttentionSublayerAotConfig(direction, 256, 64, True, False, "fp16", "fp16")]
    # The forward reads x (and writes y) in x's own dtype.
    return configs + [AttentionSublayerAotConfig("fwd", 256, 64, True, False, "bf16", "bf16")]


def _attention_sublayer_source(cfg: AttentionSublayerAotConfig):
    dt, x = cfg.dtype, cfg.x_dtype
    constexprs = dict(D=cfg.d_model, HEADS=cfg.d_model // cfg.head_dim, HEAD_DIM=cfg.head_dim, ROTARY=cfg.rotary,
                      ROTATE_V=cfg.rotate_v, **cfg.knobs)
    box = f"tensordesc<{dt}[{cfg.head_dim}, {cfg.d_model}]>"
    blocks = dict(block_start_ptr="*i32", block_len_ptr="*i32", num_blocks_ptr="*i64")
    if cfg.direction == "fwd":
        fn = _tlx_attention_sublayer_fwd
        signature = dict(desc_w_qkv=box, desc_w_out_t=box, x_ptr=f"*{x}", norm_weight_ptr=f"*{x}",
                         norm_bias_ptr=f"*{x}", b_qkv_ptr=f"*{dt}", b_out_ptr=f"*{dt}", **blocks, y_ptr=f"*{x}",
                         qkv_ptr=f"*{dt}", attn_ptr=f"*{dt}", mean_ptr="*fp32", rstd_ptr="*fp32", eps="fp32",
                         qk_scale="fp32")
    else:
        fn = _tlx_attention_sublayer_bwd
        signature = dict(desc_w_qkv=box, desc_w_out_t=box, grad_out_ptr=f"*{dt}", qkv_ptr=f"*{dt}", **blocks,
                         grad_qkv_ptr=f"*{dt}", grad_normed_ptr="*fp32", sm_scale="fp32", qk_scale="fp32")
    if cfg.rotary:
        signature.update(cos_ptr="*fp32", sin_ptr="*fp32")
    else:
        # A None argument is a constexpr at launch time.
        signature.update(cos_ptr="constexpr", sin_ptr="constexpr")
        constexprs.update(cos_ptr=None, sin_ptr=None)
    # Pointers from torch's allocator are 16-byte aligned.
    divisible = [n for n in signature if n.endswith("_ptr") and signature[n] != "constexpr"]
    return ast_source(fn, signature, constexprs, divisible)


def aot_configs(dtypes=("bf16", "fp16"), tuning_variants: bool = True) -> list:
    """Every production configuration, plus (tuning_variants) each tuning variant's kernels (bf16, the
    sweep's dtype, with and without rotary) that differ from a kernel already in the list."""
    configs = []
    for direction in ("fwd", "bwd"):
        for head_dim in (64, 128):
            for rotary, rotate_v in ((False, False), (True, False), (True, True)):
                for dtype in dtypes:
                    configs.append(AotConfig(direction, head_dim, rotary, rotate_v, dtype))
    seen = set()
    for variant in TUNING_VARIANTS if tuning_variants else ():
        for direction in ("fwd", "bwd"):
            for head_dim in (64, 128):
                for rotary in (False, True):
                    cfg = AotConfig(direction, head_dim, rotary, False, "bf16", variant)
                    key = (direction, head_dim, rotary, tuple(sorted(tuning_of(cfg).items())))
                    if key not in seen and variant != "default":
                        configs.append(cfg)
                    seen.add(key)
    return configs + mlp_aot_configs() + attention_sublayer_aot_configs()


def _source(cfg: AotConfig):
    D = cfg.head_dim
    tile = f"tensordesc<{cfg.dtype}[64, {D}]>"
    ptr = f"*{cfg.dtype}"
    tuning = tlx_config(D, cfg.rotary, backward=cfg.direction == "bwd", overrides=cfg.knobs)
    constexprs = dict(HEAD_DIM=D, ROTARY=cfg.rotary, ROTATE_V=cfg.rotate_v, **tuning)
    if cfg.direction == "fwd":
        fn = _tlx_block_attn_fwd
        tiles = ["desc_q", "desc_k", "desc_v", "desc_o"]
        outs = ["out_ptr"]
    else:
        fn = _tlx_block_attn_bwd
        tiles = ["desc_q", "desc_k", "desc_v", "desc_do"]
        outs = ["dq_ptr", "dk_ptr", "dv_ptr"]
    signature = {name: tile for name in tiles}
    if cfg.rotary:
        signature.update(desc_cos=f"tensordesc<fp32[64, {D // 2}]>", desc_sin=f"tensordesc<fp32[64, {D // 2}]>")
    else:
        # A None argument is a constexpr at launch time.
        signature.update(desc_cos="constexpr", desc_sin="constexpr")
        constexprs.update(desc_cos=None, desc_sin=None)
    for name in outs:
        signature[name] = ptr
    # num_blocks is the BlockTable's int64 scalar (kernels.blocks.block_table).
    signature.update(block_start_ptr="*i32", block_len_ptr="*i32", num_blocks_ptr="*i64", H="i32", stride_t="i32",
                     sm_scale="fp32")
    divisible = [*outs, "block_start_ptr", "block_len_ptr", "num_blocks_ptr", "stride_t"]
    return ast_source(fn, signature, constexprs, divisible)


def compile_config(cfg: AotConfig):
    """Returns triton's CompiledKernel (asm: ttir, ttgir, llir, ptx, cubin) for sm_90."""
    if not HAS_TLX:
        raise RuntimeError("TLX is not installed (needs fbtriton==3.7.4)")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("unset TRITON_INTERPRET: the interpreter cannot compile TLX kernels")
    source = {MlpAotConfig: _mlp_source, AttentionSublayerAotConfig: _attention_sublayer_source}.get(
        type(cfg), _source)(cfg)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=1))


def tuning_of(cfg: AotConfig) -> dict:
    """The constexpr knobs a launch of this configuration uses, and their SMEM estimate."""
    if isinstance(cfg, AttentionSublayerAotConfig):
        tuning = cfg.knobs
        return dict(tuning, smem_estimate=attention_sublayer_tlx.smem_bytes(
            cfg.d_model, cfg.head_dim, tuning["NUM_STAGES"], tuning["NUM_CONSUMERS"], cfg.direction == "bwd"))
    if isinstance(cfg, MlpAotConfig):
        tuning = cfg.knobs
        return dict(tuning, smem_estimate=mlp_sublayer_tlx.smem_bytes(
            cfg.d_model, tuning["NUM_STAGES"], tuning["NUM_CONSUMERS"], backward=cfg.direction == "bwd"))
    tuning = tlx_config(cfg.head_dim, cfg.rotary, backward=cfg.direction == "bwd", overrides=cfg.knobs)
    return dict(tuning, smem_estimate=config_smem_bytes(cfg.head_dim, cfg.rotary, cfg.direction == "bwd", tuning))


def compile_all(configs=None) -> dict:
    """{config name: {"ptx": str, "cubin": bytes, "shared": int, "tuning": dict, "error": str | None}}."""
    results = {}
    for cfg in configs or aot_configs():
        try:
            tuning = tuning_of(cfg)
            compiled = compile_config(cfg)
            results[cfg.name] = dict(ptx=compiled.asm["ptx"], cubin=compiled.asm["cubin"],
                                     shared=compiled.metadata.shared, tuning=tuning, error=None)
        except Exception as exc:  # report every configuration, not just the first failure
            results[cfg.name] = dict(ptx="", cubin=b"", shared=0, tuning={}, error=f"{type(exc).__name__}: {exc}")
    return results


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="substring filter on config names")
    parser.add_argument("--dump", default="", help="directory to write <name>.ptx/.cubin into")
    args = parser.parse_args(argv)
    failed = 0
    for cfg in aot_configs():
        if args.only not in cfg.name:
            continue
        t0 = time.perf_counter()
        res = compile_all([cfg])[cfg.name]
        dt = time.perf_counter() - t0
        if res["error"]:
            failed += 1
            print(f"{cfg.name}: FAIL ({dt:.1f}s) {res['error'].splitlines()[0] if res['error'] else ''}", flush=True)
            print(res["error"], file=sys.stderr)
            continue
        ptx = res["ptx"]
        over = res["shared"] > SM90_MAX_SMEM
        failed += over
        print(f"{cfg.name}: {'FAIL smem over 227KiB' if over else 'ok'} ({dt:.1f}s) cubin={len(res['cubin'])}B "
              f"smem={res['shared']}B (estimate {res['tuning']['smem_estimate']}B) {res['tuning']} wgmma={ptx.count('wgmma.mma_async')} "
              f"tma={ptx.count('cp.async.bulk.tensor')} tma_store={ptx.count('cp.async.bulk.tensor.2d.global.shared')} setmaxnreg={ptx.count('setmaxnreg')}", flush=True)
        if args.dump:
            os.makedirs(args.dump, exist_ok=True)
            with open(os.path.join(args.dump, cfg.name + ".ptx"), "w") as f:
                f.write(ptx)
            with open(os.path.join(args.dump, cfg.name + ".cubin"), "wb") as f:
                f.write(res["cubin"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
