"""Benchmarks: ``python -m cutelayers.bench {reduce,norms,softmax,gemm,lm_head,embed,compile} ...``.

All but ``compile`` need a GPU.

Every table states its floor first: the HBM copy bandwidth measured in the same run (a read+write
elementwise pass over a large buffer), then each op's minimum bytes over its time, as % of that
copy bandwidth, next to XLA's own version timed in the same process. Those tables (``reduce``,
``norms``, ``softmax``) can be saved (``--json FILE``) and compared with a saved run
(``--baseline FILE``: a previous release's kernels, say), row by row.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp

import cutelayers as cl
from cutelayers.bench import gemm
from cutelayers.bench.compile import bench_compile
from cutelayers.bench.embed import bench_embed
from cutelayers.bench.lm_head import bench_lm_head
from cutelayers.bench.norms import DEFAULT_NS as NORM_NS
from cutelayers.bench.norms import OPS as NORM_OPS
from cutelayers.bench.norms import PASSES as NORM_PASSES
from cutelayers.bench.norms import bench_norms
from cutelayers.bench.reduce import bench_reduce
from cutelayers.bench.softmax import bench_softmax
from cutelayers.bench.timing import load_baseline, measured_bandwidth, print_table, save_rows
from cutelayers.ops.embed import BLOCK_TOKENS
from cutelayers.ops.softmax import check_loss_options


def print_records(rows: list[dict]) -> None:
    """A markdown table of dict rows, columns in the first row's key order."""
    if rows:
        print("| " + " | ".join(rows[0]) + " |")
        print("|" + "---|" * len(rows[0]))
        for row in rows:
            print("| " + " | ".join(str(v) for v in row.values()) + " |")


def _size(multiple: int = 1, why: str = ""):
    """argparse type: a positive integer, a multiple of ``multiple`` (``why``: what needs that)."""
    allowed = f"a positive multiple of {multiple}{why}" if multiple > 1 else "a positive integer"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer; got {text!r}") from None
        if value < 1 or value % multiple:
            raise argparse.ArgumentTypeError(f"must be {allowed}; got {value}")
        return value

    return parse


def _label_smoothing(text: str) -> float:
    """argparse type: a label smoothing, checked as ``linear_cross_entropy`` checks it ([0, 1))."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number; got {text!r}") from None
    try:
        return check_loss_options("--label-smoothing", value, 0.0, None)[0]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--label-smoothing: ")) from None


POSITIVE = _size()
GEMM_SIZE = _size(8, " (fused_linear's CuTe GEMM takes K and N multiples of 8)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cutelayers.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="suite", required=True)
    # the bandwidth tables (reduce, norms, softmax) can be saved and compared with a saved run
    rows = argparse.ArgumentParser(add_help=False)
    rows.add_argument("--json", metavar="FILE", help="also write the table's rows to FILE (JSON)")
    rows.add_argument("--baseline", metavar="FILE",
                      help="a table saved with --json (a previous release's kernels, say): adds each "
                           "row's baseline time over ours")
    red = sub.add_parser("reduce", parents=[rows], help="row reductions vs XLA")
    red.add_argument("--rows", type=POSITIVE, default=32768, help="rows M (default 32768)")
    red.add_argument("--n", type=POSITIVE, nargs="+", default=[4096], help="feature sizes N (default 4096)")
    red.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    norms = sub.add_parser("norms", parents=[rows],
                           help="layer_norm / rms_norm and their fused residual adds, fwd, fwd+bwd and fwd+bwd "
                                "as a training step runs them ('step') vs XLA (x = 256 MiB unless --rows)")
    norms.add_argument("--n", type=POSITIVE, nargs="+", default=NORM_NS)
    norms.add_argument("--rows", type=POSITIVE, default=None, help="rows M of x (default: x is 256 MiB)")
    norms.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    norms.add_argument("--ops", nargs="+", choices=NORM_OPS, default=NORM_OPS, help="ops to time (default: all)")
    norms.add_argument("--passes", nargs="+", choices=NORM_PASSES, default=NORM_PASSES,
                       help="passes to time (default: all; 'step': fwd+bwd with the cotangent given only after "
                            "the forward's output, as in training)")
    norms.add_argument("--param-dtype", choices=["bfloat16", "float16", "float32"], default=None,
                       help="scale and bias dtype (default: x's; float32 is what Flax's modules train with)")
    soft = sub.add_parser("softmax", parents=[rows],
                          help="softmax fwd/bwd and cross-entropy fwd+bwd vs XLA/optax")
    soft.add_argument("--n", type=POSITIVE, nargs="+", default=[4096, 32768, 131072])
    soft.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    soft.add_argument("--rows", type=POSITIVE, default=None,
                      help="rows of every array (default: 32768 for softmax, 8192 for cross-entropy, fewer where "
                           "an array would pass 1 GiB)")
    lin = sub.add_parser("gemm", help="fused_linear (Hopper GEMM + epilogue) TFLOP/s vs XLA")
    lin.add_argument("--shapes", type=gemm.parse_shape, nargs="+", default=(),
                     help="MxKxN ... (default: the transformer layers of cutelayers.bench.gemm.LAYERS)")
    lin.add_argument("--epilogue", choices=gemm.EPILOGUES, default="bias+gelu", help="epilogue of --shapes")
    lin.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    lin.add_argument("--param-dtype", choices=["float32"], default=None,
                     help="float32 parameters (mixed precision; default: --dtype's)")
    lin.add_argument("--parts", action="store_true",
                     help="then each layer's backward GEMMs (dx, dkernel) alone vs XLA's")
    lin.add_argument("--kernels", action="store_true",
                     help="then each layer's forward + backward kernel by kernel, ours and XLA's")
    head = sub.add_parser("lm_head", help="linear_cross_entropy fwd+bwd time and temp memory vs unfused XLA")
    # not "--h": the CuTe DSL parses sys.argv for its own flags at every compile, and "--h" is a
    # prefix of its "--help" (it printed its usage and exited mid-benchmark)
    head.add_argument("--tokens", type=POSITIVE, default=8192, help="tokens T (default 8192)")
    head.add_argument("--hidden", type=POSITIVE, default=4096, help="hidden size H (default 4096)")
    head.add_argument("--vocab", type=POSITIVE, default=131072, help="vocabulary size V (default 131072)")
    head.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    head.add_argument("--param-dtype", choices=["bfloat16", "float16", "float32"], default=None,
                      help="the kernel's dtype (default: --dtype's; float32: mixed precision, the XLA head "
                           "casting it for its GEMM)")
    head.add_argument("--chunk-size", type=POSITIVE, nargs="+", default=[None],
                      help="tokens per chunk of the fused head, one row each (default: the op's)")
    head.add_argument("--kernel-layout", choices=["hv", "vh"], default="hv",
                      help="the kernel as (H, V), or as a (V, H) table (Equinox's Linear weight, a tied embedding)")
    head.add_argument("--label-smoothing", type=_label_smoothing, default=0.0, metavar="A",
                      help="both heads' loss against smoothed labels (1 - A) onehot + A / V (default 0)")
    head.add_argument("--device-peak", action="store_true",
                      help="also each head's rise of the device's peak memory, one fresh process per head")
    emb = sub.add_parser("embed", help="embedding lookup + table gradient vs jnp.take, per id distribution")
    emb.add_argument("--tokens", type=POSITIVE, default=16384, help="tokens T (default 16384)")
    emb.add_argument("--hidden", type=POSITIVE, default=768, help="features H (default 768)")
    emb.add_argument("--vocab", type=POSITIVE, default=50304, help="vocabulary size V (default 50304)")
    emb.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    emb.add_argument("--block-tokens", type=POSITIVE, nargs="+", default=[BLOCK_TOKENS],
                     help=f"tokens summed per block before the gradient's scatter, one row each (default {BLOCK_TOKENS})")
    comp = sub.add_parser("compile", help="compile seconds per kernel family and disk-cache load seconds (no GPU needed)")
    comp.add_argument("--n", type=GEMM_SIZE, default=4096,
                      help="feature size N, also the GEMM's output width: a multiple of 8 (default 4096)")
    comp.add_argument("--k", type=GEMM_SIZE, default=4096, help="GEMM inner size K, a multiple of 8 (default 4096)")
    # the usage shows the suites as {reduce,...}: a missing one is named so, not by the dest "suite"
    sub.metavar = "{" + ",".join(sub.choices) + "}"
    args = parser.parse_args(argv)
    baseline = None
    if getattr(args, "json", None) is not None and not os.path.isdir(os.path.dirname(args.json) or "."):
        parser.error(f"argument --json: the folder of {args.json!r} does not exist")
    if getattr(args, "baseline", None) is not None:
        try:  # before anything runs
            described, baseline = load_baseline(args.baseline)
        except ValueError as e:
            parser.error(f"argument --baseline: {e}")
    if args.suite == "compile":
        print_records(bench_compile(n=args.n, k=args.k))
        return 0
    try:
        jax.devices("cuda")
    except RuntimeError:
        print("cutelayers.bench needs a CUDA GPU; none is visible.", file=sys.stderr)
        return 2
    if args.suite in ("reduce", "norms", "softmax"):
        if args.suite == "reduce":
            results = bench_reduce(args.rows, args.n, jnp.dtype(args.dtype))
        elif args.suite == "norms":
            if args.param_dtype:
                print(f"# parameters: {args.param_dtype}")
            results = bench_norms(args.n, jnp.dtype(args.dtype), args.rows, tuple(args.ops), tuple(args.passes),
                                  args.param_dtype)
        else:
            results = bench_softmax(args.n, jnp.dtype(args.dtype), args.rows)
        if baseline is not None:
            print(f"# baseline: {described}")
        print_table(results, baseline)
        if args.json:
            save_rows(args.json, results)
    elif args.suite == "gemm":
        print(f"# device: {jax.devices()[0].device_kind}")
        layers = gemm.layers_from_args(args.shapes, args.epilogue)
        param_dtype = args.param_dtype and jnp.dtype(args.param_dtype)
        if param_dtype:
            print(f"# parameters: {param_dtype.name}")
        results = gemm.bench_gemm(layers, jnp.dtype(args.dtype), param_dtype)
        if not args.shapes:
            results += gemm.bench_mlp(dtype=jnp.dtype(args.dtype), param_dtype=param_dtype)
        gemm.print_table(results)
        if args.parts:
            gemm.print_parts(gemm.bench_parts(layers, jnp.dtype(args.dtype)))
        if args.kernels:
            gemm.print_kernels(gemm.bench_kernels(layers, jnp.dtype(args.dtype), param_dtype))
    elif args.suite == "lm_head":
        print(f"# device: {jax.devices()[0].device_kind}")
        print_records(bench_lm_head(args.tokens, args.hidden, args.vocab, jnp.dtype(args.dtype), args.chunk_size,
                                    args.param_dtype and jnp.dtype(args.param_dtype), args.kernel_layout,
                                    args.device_peak, args.label_smoothing))
    elif args.suite == "embed":
        print_records(bench_embed(args.tokens, args.hidden, args.vocab, jnp.dtype(args.dtype), measured_bandwidth(),
                                  args.block_tokens))
    print("# cache:", {k: (v.compiles, v.memory_hits, v.disk_hits, round(v.compile_seconds, 2)) for k, v in cl.cache_info().items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
