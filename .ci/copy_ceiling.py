"""What a plain copy of a norm forward's bytes reaches, as a fraction of the 1 GiB copy that the
benchmarks' "% of copy" divides by: ``python .ci/copy_ceiling.py [ROWS] [N ...]`` (default 16384
rows of 768, 1024, 2048, 4096 bf16 columns). A row-copy kernel in the norms' own thread layout
(every register-resident config of the forward's space; L1::evict_first loads with streaming stores
or plain accesses; one CTA a row tile, or a persistent grid of full SMs), XLA's elementwise copies,
and the bf16 norm forwards, timed side by side with ``time_fn`` (device time, rotated operands);
the six fastest per width last. On arrays of tens of MiB a kernel's ramp and last wave are a larger
part of its time than on the 1 GiB copy (sixtieth session, H100: the best copy of 16384 x 768 bf16
at 92.7 % of it, docs/benchmarks.md)."""
import sys

import cutlass
import jax
import jax.numpy as jnp
from cutlass import const_expr, cute

import cutelayers
from cutelayers.bench.timing import copy_bandwidth, time_fn
from cutelayers.kernels.hopper import HOPPER_SMS
from cutelayers.kernels.norm_config import FORWARD_VALUES_PER_THREAD
from cutelayers.kernels.reduction import cta_share, load_step, row_tiled_copy, save_step
from cutelayers.kernels.reduction_config import row_geometry_space


class RowCopy:
    """y = x for register-resident rows of ``geometry``: the norm forward's loads and stores alone
    (``persistent`` > 0: a grid of that many CTAs an SM walking the row tiles)."""

    def __init__(self, geometry, hints, persistent):
        self.geometry, self.hints, self.persistent = geometry, hints, persistent

    @cute.jit
    def __call__(self, stream, x, y):
        g = self.geometry
        tiles = cute.ceil_div(x.shape[0], g.row.rows_per_cta)
        grid = tiles
        if const_expr(self.persistent > 0):
            grid = cutlass.min(tiles, HOPPER_SMS * self.persistent)
        self.kernel(x, y, row_tiled_copy(x.element_type, g, "load" if self.hints else None),
                    row_tiled_copy(y.element_type, g, "store" if self.hints else None), tiles).launch(
            grid=[grid, 1, 1], block=[g.row.num_threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, x, y, copy_x, copy_y, tiles):
        g = self.geometry
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        share = cta_share(g, x.shape, tidx)
        if const_expr(self.persistent > 0):
            for tile in cutlass.range(bidx, tiles, gdim, unroll=1):
                s = share.for_tile(tile)
                self.copy_tile(s, x, y, copy_x, copy_y)
        else:
            self.copy_tile(share, x, y, copy_x, copy_y)

    @cute.jit
    def copy_tile(self, share, x, y, copy_x, copy_y):
        opx = share.operand(x, copy_x)
        opy = share.operand(y, copy_y)
        if opx.coords[0][0] < x.shape[0]:
            load_step(opx, 0)
            opy.frag.store(opx.frag.load())
            save_step(opy, 0)


def row_copy(geometry, hints, persistent):
    launcher, r = RowCopy(geometry, hints, persistent), geometry.row
    key = ("copy_ceiling", geometry, hints, persistent)

    def f(x):
        return cutelayers.cute_call(launcher, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                                    compile_key=key, name=f"row_copy_{r.threads_per_row}_{r.num_threads}_{int(hints)}_{persistent}")(x)
    return jax.jit(f)


def main():
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
    ns = [int(a) for a in sys.argv[2:]] or [768, 1024, 2048, 4096]
    bw = copy_bandwidth()
    print(f"# {jax.devices()[0].device_kind}; 1 GiB copy {bw / 1e12:.3f} TB/s", flush=True)
    results = []
    for n in ns:
        x = jax.random.normal(jax.random.key(n), (rows, n), jnp.bfloat16)
        floor = 2 * x.nbytes / bw

        def report(what, t, n=n, floor=floor):
            results.append((n, what, t))
            print(f"{n:6d} {what:52s} {t * 1e6:8.2f} us {100 * floor / t:6.1f} % of copy", flush=True)

        report("xla x+1", time_fn(jax.jit(lambda x: x + 1), x))
        report("xla copy", time_fn(jax.jit(lambda x: jnp.copy(x) * 1), x))
        scale, bias = jnp.ones((n,), jnp.bfloat16), jnp.zeros((n,), jnp.bfloat16)
        report("layer_norm", time_fn(jax.jit(cutelayers.ops.layer_norm), x, scale, bias))
        report("rms_norm", time_fn(jax.jit(cutelayers.ops.rms_norm), x, scale))
        for geometry in row_geometry_space(n, 16, FORWARD_VALUES_PER_THREAD):
            if not geometry.resident:
                continue
            for hints, persistent in ((True, 0), (False, 0), (True, 2048 // geometry.row.num_threads)):
                f = row_copy(geometry, hints, persistent)
                assert bool(jnp.array_equal(f(x), x)), (n, geometry, hints, persistent)
                r = geometry.row
                report(f"copy tpr={r.threads_per_row} cta={r.num_threads} u={r.unroll} hints={int(hints)} pers={persistent}",
                       time_fn(f, x))
    print("\n# best per width")
    for n in ns:
        ranked = sorted((t, w) for m, w, t in results if m == n)
        for t, w in ranked[:6] + [(t, w) for t, w in ranked if not w.startswith("copy")]:
            print(f"{n:6d} {w:52s} {t * 1e6:8.2f} us")


if __name__ == "__main__":
    main()
