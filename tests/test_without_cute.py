"""A plain install, without the `cute` extra: in a process where importing the CuTe DSL and TVM-FFI
fails, cutelayers and its modules import, the ops run their jnp reference with one log line naming
the extra (on the CPU and lowered for CUDA alike), and an explicit ``use_backend("cute")`` is an
error naming it."""

import json
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROGRAM = textwrap.dedent("""
    import json, logging, sys

    # What `pip install cutelayers` lacks: a None entry makes `import` fail and find_spec see nothing.
    sys.modules.update(dict.fromkeys(["cutlass", "nvidia_cutlass_dsl", "cuda", "tvm_ffi", "jax_tvm_ffi"]))

    import jax
    import jax.numpy as jnp
    from flax import nnx

    import cutelayers as cl
    import cutelayers.equinox
    import cutelayers.flax.linen
    import cutelayers.flax.nnx

    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("cutelayers").addHandler(handler)

    x = jnp.arange(24.0).reshape(4, 6)
    report = {"sum_ok": bool(jnp.allclose(jax.jit(cl.ops.reduce_sum)(x), jnp.sum(x, -1)))}
    hlo = jax.jit(cl.ops.reduce_sum).trace(x).lower(lowering_platforms=("cuda",)).as_text()
    report["cuda_kernel_calls"] = hlo.count("custom_call @cutelayers_")
    report["lines"] = list(lines)
    try:
        with cl.use_backend("cute"):
            jax.jit(cl.ops.reduce_sum).trace(x).lower(lowering_platforms=("cuda",))
        report["cute_error"] = None
    except RuntimeError as error:
        report["cute_error"] = str(error)

    # The drop-in modules, one per framework, on the reference path.
    y = jnp.ones((2, 8))
    dense = cl.flax.linen.Dense(4)
    outputs = [dense.apply(dense.init(jax.random.key(0), y), y),
               cl.flax.nnx.LayerNorm(8, rngs=nnx.Rngs(0))(y),
               jax.vmap(cl.equinox.RMSNorm(8))(y)]
    report["module_shapes"] = [list(o.shape) for o in outputs]
    report["cute_modules"] = sorted(m for m in sys.modules if m.startswith("cutlass") and sys.modules[m] is not None)
    print(json.dumps(report))
""")


def test_a_plain_install_runs_the_reference_and_names_the_extra():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", PROGRAM], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["sum_ok"]
    assert report["cuda_kernel_calls"] == 0  # lowered for CUDA (sm_90a): the reference too
    (line,) = report["lines"]  # one line, for the CPU run and the CUDA lowering alike
    assert line.startswith("cutelayers: running the reference path (reduce_sum: the CuTe DSL is not installed")
    assert "nvidia-cutlass-dsl, apache-tvm-ffi, jax-tvm-ffi missing" in line
    assert "pip install 'cutelayers[cute]'" in line
    assert report["cute_error"].startswith("reduce_sum: backend 'cute' asks for the CuTe kernels, but the CuTe DSL")
    assert "pip install 'cutelayers[cute]'" in report["cute_error"]
    assert report["module_shapes"] == [[2, 4], [2, 8], [2, 8]]
    assert report["cute_modules"] == []
