"""Registers and spills of the paged attention kernel per tile config, compiled for a GPU without one.

Triton compiles the kernel ahead of time for a target (sm_90 by default) and ptxas reports each
config's registers and spill bytes per thread: a screen for configs before a device call (spills
in the key loop cost the kernel a large share of its time), not a measurement of speed. The PTX's
count of wgmma (Hopper's asynchronous matmul) and cp.async (the loads the software pipeline made
asynchronous) instructions says whether a change kept the key loop pipelined.

The compile is the one the JIT makes at run time: the pointer and integer arguments it finds
divisible by 16 at the seed shapes carry that divisibility (`tt.divisibility`, as Triton
specialises them). Without it (before session 22) every K/V load stayed a synchronous ld.global,
nothing was pipelined, and ptxas reported ~2 KB of spills a thread at 128 x 64 tiles where the
kernel that runs spills 152 bytes: the figures of sessions 14-15 are of that other compile.

    pip install --target <dir> triton        (any machine; no GPU needed)
    PYTHONPATH=<dir> python3 -m hstu.scripts.kernel_regs --configs 128,64,8,2 64,64,8,2

Uses Triton's own ptxas (the newest one it bundles, for the newest PTX it emits).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
from pathlib import Path

_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")
# Arguments the JIT specialises as divisible by 16 at the seed shapes (aligned pointers; strides,
# offsets and the head dim, multiples of the head dim); max_pages, num_users, forced_splits and
# grid_programs are never specialised (do_not_specialize), num_heads and num_sms are not multiples.
_DIVISIBLE = (
    "Q", "K", "V", "KV", "PT", "KV_LENS", "Q_OFF", "Q_POS", "OUT", "PART", "stride_qt", "stride_qh", "stride_kt",
    "stride_kh", "stride_vt", "stride_vh", "stride_ot", "stride_oh", "layer_offset", "page_stride", "kv_stride",
    "token_stride", "head_dim", "layer_row0",
)


def ptxas_path() -> Path:
    """The newest ptxas Triton bundles (ptxas-blackwell reads the PTX versions Triton >= 3.7 emits)."""
    import triton

    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    for name in ("ptxas-blackwell", "ptxas"):
        if (bin_dir / name).exists():
            return bin_dir / name
    raise FileNotFoundError(f"no ptxas under {bin_dir}")


def ptxas_report(ptx_text: str, arch: int = 90) -> dict:
    """Registers and spill bytes per thread that ptxas reports for one kernel's PTX (sm_<arch>a)."""
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "k.ptx"
        ptx.write_text(ptx_text)
        report = subprocess.run(
            [str(ptxas_path()), f"-arch=sm_{arch}a", "-v", str(ptx), "-o", str(Path(tmp) / "k.cubin")],
            capture_output=True, text=True, check=True,
        ).stderr
    spills, regs = _SPILL.search(report), _REGS.search(report)
    return {
        "registers": int(regs.group(1)) if regs else None,
        "spill_store_bytes": int(spills.group(1)) if spills else 0,
        "spill_load_bytes": int(spills.group(2)) if spills else 0,
    }


def compile_ahead(fn, pointers: dict[str, str], constants: dict, divisible: tuple[str, ...], options: dict,
                  arch: int = 90, source=None):
    """`fn` compiled for sm_<arch> as the JIT would compile it: `constants` as constexprs, the
    `pointers` typed as given, every other argument i32, and the arguments in `divisible` carrying
    the divisibility by 16 the JIT finds at the seed shapes. source: the AST source class (Triton's
    by default; Gluon's for a gluon.jit function)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {name: "constexpr" if name in constants else pointers.get(name, "i32") for name in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if name in divisible}
    return triton.compile((source or ASTSource)(fn=fn, signature=signature, constexprs=constants, attrs=attrs),
                          target=GPUTarget("cuda", arch, 32), options=options)


def kernel_report(kernel, arch: int = 90) -> dict:
    """A compiled kernel's shared memory, ptxas registers and spills, and its PTX's counts of wgmma,
    cp.async (loads the software pipeline made asynchronous) and TMA copies."""
    ptx_text = kernel.asm["ptx"]
    return {
        "shared_bytes": kernel.metadata.shared,
        **ptxas_report(ptx_text, arch),
        "wgmma": ptx_text.count("wgmma.mma_async"),
        "cp_async": len(re.findall(r"cp\.async\.(?:ca|cg)", ptx_text)),
        "tma": ptx_text.count("cp.async.bulk.tensor"),
    }


def compile_config(block_m: int, block_n: int, num_warps: int, num_stages: int, *, head_dim: int = 256,
                   dtype: str = "bf16", silu: str = "tanh", arch: int = 90, tma: bool = False) -> dict:
    """The kernel for one tile config at `head_dim`: shared memory bytes, registers and spill bytes."""
    import triton

    from hstu.ops import triton_attention as ta

    fn = ta._paged_hstu_attention_kernel
    pointers = {name: f"*{dtype}" for name in ("Q", "K", "V", "KV", "OUT")}
    pointers.update({"PT": "*i32", "KV_LENS": "*i32", "Q_OFF": "*i32", "Q_POS": "*i64", "PART": "*fp32"})
    constants = dict(
        SCALE=head_dim**-0.5, INV_SCALE_LEN=1 / 4352, PAGE_SIZE=32, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=triton.next_power_of_2(head_dim), MAX_USERS=64, BALANCE_BELOW=0.5, LANES_ABOVE=0.8, IEEE=dtype == "fp32",
        SILU=0 if dtype == "fp32" else ta.SILU_MODES.index(silu), WARP_SPECIALIZE=False, USE_TMA=tma,
    )
    if tma:  # TMA tiles are one page of one head: block_n must be the page size
        constants["PAGE_SIZE"] = block_n
        pointers["KV_DESC"] = f"tensordesc<{dtype}[{block_n}, {constants['BLOCK_D']}]>"
    else:
        constants["KV_DESC"] = None
    options = {"num_warps": num_warps, "num_stages": num_stages}
    kernel = compile_ahead(fn, pointers, constants, _DIVISIBLE, options, arch)
    return {"config": (block_m, block_n, num_warps, num_stages), **kernel_report(kernel, arch)}


def compile_gluon(head_dim: int = 256, page_size: int = 32, dtype: str = "bf16", arch: int = 90,
                  masked_tma: bool = False, own_tma: bool = False, stream: bool = False) -> dict:
    """The Gluon attention kernel (ops/gluon_attention.py, or with `stream` the stream-K one of
    ops/gluon_stream_attention.py and its own tiles by TMA when `own_tma`) at `head_dim` and
    `page_size`: shared memory bytes, registers, spill bytes and its PTX's counts."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from hstu.ops import gluon_attention as ga
    from hstu.ops import gluon_stream_attention as gs

    box = min(page_size, ga.BLOCK_N)
    pointers = {name: f"*{dtype}" for name in ("Q", "K", "V", "KV", "OUT")}
    pointers.update({"PT": "*i32", "KV_LENS": "*i32", "Q_POS": "*i64", "ITEMS": "*i32", "PART": "*fp32"})
    layout = gl.NVMMASharedLayout.get_default_for([box, head_dim], gl.bfloat16 if dtype == "bf16" else gl.float16)
    desc = f"tensordesc<{dtype}[{box}, {head_dim}],{layout!r}>"
    pointers["KV_DESC"] = desc
    constants = dict(SCALE=head_dim**-0.5, INV_SCALE_LEN=1 / 4352, BLOCK_M=ga.BLOCK_M, BLOCK_N=ga.BLOCK_N,
                     HEAD_DIM=head_dim, PAGE_SIZE=page_size, BOX=box, FIELDS=ga.FIELDS, MASKED_TMA=masked_tma)
    if stream:
        pointers["STARTS"] = "*i32"
        constants["OWN_TMA"] = own_tma
        for name in ("K_DESC", "V_DESC"):
            if own_tma:
                pointers[name] = desc
            else:
                constants[name] = None
    divisible = tuple(n for n in _DIVISIBLE if n not in ("Q_OFF", "head_dim")) + ("ITEMS",)
    kernel = compile_ahead((gs if stream else ga)._attention_kernel, pointers, constants, divisible,
                           {"num_warps": ga.WARPS}, arch, GluonASTSource)
    flags = (("stream",) if stream else ()) + (("masked_tma",) if masked_tma else ()) + (("own_tma",) if own_tma else ())
    return {"config": ("gluon", head_dim, page_size) + flags, **kernel_report(kernel, arch)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", nargs="+", default=["128,64,8,2", "64,64,8,2"], help="block_m,block_n,warps,stages")
    parser.add_argument("--head-dim", type=int, default=256)
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--tma", action="store_true", help="the TMA-descriptor key loop (AttentionConfig.tma)")
    parser.add_argument("--gluon", nargs="*", type=int, metavar="PAGE_SIZE",
                        help="the Gluon kernel (ops/gluon_attention.py) at these page sizes instead of the configs")
    args = parser.parse_args()
    print(f"{'config':<16}{'smem':>8}{'regs':>6}{'spill st':>10}{'spill ld':>10}{'wgmma':>7}{'cp.async':>10}{'tma':>5}")
    if args.gluon is not None:
        runs = {f"gluon,page{p}{',stream' if st else ''}{',mtma' if m else ''}{',otma' if o else ''}":
                lambda p=p, m=m, o=o, st=st: compile_gluon(args.head_dim, p, args.dtype, args.arch, m, o, st)
                for p in args.gluon or [32]
                for st, m, o in ((False, False, False), (False, True, False), (True, True, False), (True, True, True))}
    else:
        runs = {spec: lambda spec=spec: compile_config(*(int(x) for x in spec.split(",")), head_dim=args.head_dim,
                                                       dtype=args.dtype, arch=args.arch, tma=args.tma)
                for spec in args.configs}
    for spec, compile_one in runs.items():
        r = compile_one()
        print(f"{spec:<16}{r['shared_bytes']:>8}{r['registers'] or '-':>6}{r['spill_store_bytes']:>10}"
              f"{r['spill_load_bytes']:>10}{r['wgmma']:>7}{r['cp_async']:>10}{r['tma']:>5}")


if __name__ == "__main__":
    main()
