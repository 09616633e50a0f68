"""Drop-in compatibility: every argument of the stock modules, ours against theirs.

For each stock module -- flax.linen Dense / LayerNorm / RMSNorm, flax.nnx Linear / LayerNorm /
RMSNorm, equinox.nn Linear / LayerNorm / RMSNorm -- every constructor and call argument of the
installed version (read from its signature: an argument this file does not know fails
``test_every_upstream_argument_is_covered`` until a case handles it) is tried with a non-default
value, for float32 and bfloat16 inputs (float32 alone where the argument itself sends the call to
the stock computation, and each module's default call for complex64, which runs the stock
computation), under ``jax_numpy_rank_promotion="raise"``.
Ours must give the same parameter tree (and values, from the same key), the same outputs and
gradients to the dtype's tolerance -- or the same error type where stock refuses -- and must take
the path the README promises: the cutelayers op (kernels on Hopper) or the stock computation.
"""

import dataclasses
import functools
import inspect

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from numerics import assert_close, least_precise

import cutelayers
import cutelayers.backend
from cutelayers import equinox as cl_eqx
from cutelayers.flax import linen as cl_linen
from cutelayers.flax import nnx as cl_nnx

KERNEL, STOCK = "kernel", "stock"
X_DTYPES = (jnp.float32, jnp.bfloat16, jnp.complex64)
FEATURES, OUT = 8, 16
normal = jax.nn.initializers.normal(1.0)


@pytest.fixture(autouse=True)
def _rank_promotion_raises():
    with jax.numpy_rank_promotion("raise"):
        yield


# --- the cases: (argument values, the path ours takes for float32 / bfloat16 input) -------------

@dataclasses.dataclass(frozen=True)
class Case:
    module: str                      # "linen.LayerNorm", ...
    init: dict = dataclasses.field(default_factory=dict)  # constructor arguments beyond the fixed ones
    call: dict = dataclasses.field(default_factory=dict)  # call arguments (a callable gets x)
    path: str = KERNEL               # for float32 / bfloat16 inputs; complex always runs stock
    axis_name: str | None = None     # run under jax.vmap with this axis name

    def __str__(self):
        args = {**self.init, **self.call}
        return f"{self.module}({', '.join(f'{k}={_short(v)}' for k, v in args.items())})"


def _short(v):
    return getattr(v, "__name__", None) or (type(v).__name__ if callable(v) else repr(v))[:30]


def _custom_promote_linen(*args, **kwargs):
    return nn.dtypes.promote_dtype(*args, **kwargs)


def _custom_promote_nnx(args, **kwargs):
    return nnx.nn.dtypes.promote_dtype(args, **kwargs)


class _DotGeneral:
    def __call__(self, *args, **kwargs):
        return jax.lax.dot_general(*args, **kwargs)


def _mask(x):
    return jnp.real(x) > -0.5


FLAX_NORM_INIT = {  # argument -> cases (values, path), shared by linen and nnx
    "epsilon": [({"epsilon": 1e-3}, KERNEL), ({"epsilon": -1e-7}, STOCK)],  # the ops take >= 0
    "dtype": [({"dtype": jnp.bfloat16}, KERNEL), ({"dtype": jnp.float16}, KERNEL)],
    "param_dtype": [({"param_dtype": jnp.bfloat16}, KERNEL), ({"param_dtype": jnp.complex64}, STOCK)],
    "use_scale": [({"use_scale": False}, KERNEL)],
    "scale_init": [({"scale_init": normal}, KERNEL)],
    "reduction_axes": [({"reduction_axes": (1, 2)}, STOCK), ({"reduction_axes": 2}, KERNEL),
                       ({"reduction_axes": (-1,)}, KERNEL)],
    "feature_axes": [({"feature_axes": (-1,)}, KERNEL)],
    "axis_name": [({"axis_name": "batch"}, STOCK)],
    "axis_index_groups": [({"axis_name": "batch", "axis_index_groups": [[0, 1], [2, 3]]}, STOCK)],
    "use_fast_variance": [({"use_fast_variance": False}, KERNEL)],
}
FLAX_LAYER_NORM_INIT = {**FLAX_NORM_INIT, "use_bias": [({"use_bias": False}, KERNEL)],
                        "bias_init": [({"bias_init": normal}, KERNEL)]}
LINEN_NORM_EXTRA = {"feature_axes": [*FLAX_NORM_INIT["feature_axes"],
                                     ({"feature_axes": (1, 2), "reduction_axes": (1, 2)}, STOCK)],
                    "force_float32_reductions": [({"force_float32_reductions": False}, KERNEL)]}
NNX_NORM_EXTRA = {"promote_dtype": [({"promote_dtype": _custom_promote_nnx}, STOCK)]}
FLAX_DENSE_INIT = {
    "use_bias": [({"use_bias": False}, KERNEL)],
    "dtype": [({"dtype": jnp.bfloat16}, KERNEL)],
    "param_dtype": [({"param_dtype": jnp.bfloat16}, KERNEL), ({"param_dtype": jnp.complex64}, STOCK)],
    "precision": [({"precision": jax.lax.Precision.HIGHEST}, KERNEL)],
    "kernel_init": [({"kernel_init": normal}, KERNEL)],
    "bias_init": [({"bias_init": normal}, KERNEL)],
}
METADATA = {"kernel_metadata": [({"kernel_metadata": {"note": "k"}}, KERNEL)],
            "bias_metadata": [({"bias_metadata": {"note": "b"}}, KERNEL)],
            "scale_metadata": [({"scale_metadata": {"note": "s"}}, KERNEL)]}

INIT = {
    "linen.LayerNorm": {**FLAX_LAYER_NORM_INIT, **LINEN_NORM_EXTRA},
    "linen.RMSNorm": {**FLAX_NORM_INIT, **LINEN_NORM_EXTRA},
    "linen.Dense": {**FLAX_DENSE_INIT, "promote_dtype": [({"promote_dtype": _custom_promote_linen}, STOCK)],
                    "dot_general": [({"dot_general": _DotGeneral()}, STOCK)],
                    "dot_general_cls": [({"dot_general_cls": _DotGeneral}, STOCK)]},
    "nnx.LayerNorm": {**FLAX_LAYER_NORM_INIT, **NNX_NORM_EXTRA,
                      **{k: v for k, v in METADATA.items() if k != "kernel_metadata"}},
    "nnx.RMSNorm": {**FLAX_NORM_INIT, **NNX_NORM_EXTRA, "scale_metadata": METADATA["scale_metadata"]},
    "nnx.Linear": {**FLAX_DENSE_INIT, "promote_dtype": [({"promote_dtype": _custom_promote_nnx}, STOCK)],
                   "dot_general": [({"dot_general": _DotGeneral()}, STOCK)],
                   "preferred_element_type": [({"preferred_element_type": jnp.float32}, KERNEL),
                                              ({"preferred_element_type": jnp.bfloat16}, STOCK)],
                   **{k: v for k, v in METADATA.items() if k != "scale_metadata"}},
    "equinox.LayerNorm": {"eps": [({"eps": 1e-3}, KERNEL), ({"eps": -1e-7}, STOCK)], "use_weight": [({"use_weight": False}, KERNEL)],
                          "use_bias": [({"use_bias": False}, KERNEL)], "dtype": [({"dtype": jnp.bfloat16}, KERNEL)],
                          "elementwise_affine": [({"elementwise_affine": False}, KERNEL)]},
    "equinox.RMSNorm": {"eps": [({"eps": 1e-3}, KERNEL), ({"eps": -1e-7}, STOCK)], "use_weight": [({"use_weight": False}, KERNEL)],
                        "use_bias": [({"use_bias": False}, KERNEL)], "dtype": [({"dtype": jnp.bfloat16}, KERNEL)]},
    "equinox.Linear": {"use_bias": [({"use_bias": False}, KERNEL)], "dtype": [({"dtype": jnp.bfloat16}, KERNEL),
                                                                              ({"dtype": jnp.complex64}, STOCK)],
                       "in_features": [({"in_features": 0}, STOCK), ({"in_features": "scalar"}, KERNEL)],
                       "out_features": [({"out_features": "scalar"}, KERNEL), ({"out_features": 0}, STOCK)]},
}
CALL = {  # call argument -> cases
    **{f"{fw}.{n}": {"mask": [({"mask": _mask}, STOCK)]} for fw in ("linen", "nnx") for n in ("LayerNorm", "RMSNorm")},
    "linen.Dense": {},
    "nnx.Linear": {"out_sharding": [({"out_sharding": jax.sharding.PartitionSpec()}, STOCK)]},
    **{f"equinox.{n}": {"state": [({"state": "state"}, KERNEL)], "key": [({"key": jax.random.key(3)}, KERNEL)]}
       for n in ("LayerNorm", "RMSNorm")},
    "equinox.Linear": {"key": [({"key": jax.random.key(3)}, KERNEL)]},
}
# constructor arguments every case passes (the sizes, the keys); the input
FIXED = {"linen": {"parent", "name", "features"}, "nnx": {"num_features", "in_features", "out_features", "rngs"},
         "equinox": {"shape", "key"}}
INPUT = {"x", "inputs"}


def _cases():
    for module in INIT:
        yield Case(module, {})
        for table, field in ((INIT, "init"), (CALL, "call")):
            for options in table[module].values():
                for values, path in options:
                    axis = values.get("axis_name")
                    yield Case(module, **{field: values}, path=path, axis_name=axis)


CASES = list(_cases())


# --- running one module: parameters, outputs, gradients --------------------------------------------

STOCK_CLASSES = {"linen": nn, "nnx": nnx, "equinox": eqx.nn}
OUR_CLASSES = {"linen": cl_linen, "nnx": cl_nnx, "equinox": cl_eqx}


def _loss_of(y):
    """A real loss whose gradient is not trivially zero (a sum of a norm's output is)."""
    y = jnp.asarray(y)
    return jnp.sum(jnp.sin(3.0 * jnp.real(y.astype(jnp.promote_types(y.dtype, jnp.float32)))))


def _run(case: Case, classes, x):
    """(parameters, output, gradients wrt parameters and x) of the module built by ``classes``."""
    framework, name = case.module.split(".")
    cls = getattr(classes[framework], name)
    init = dict(case.init)
    call = {k: v(x) if callable(v) and k == "mask" else v for k, v in case.call.items()}
    vmapped = functools.partial(jax.vmap, axis_name=case.axis_name) if case.axis_name else None
    if framework == "linen":
        m = cls(**({"features": OUT} if name == "Dense" else {}), **init)
        variables = (jax.vmap(lambda x: m.init(jax.random.key(0), x), axis_name=case.axis_name, out_axes=None)(x)
                     if vmapped else m.init(jax.random.key(0), x, **call))

        def apply(v, x):
            f = lambda x: m.apply(v, x, **call)
            return vmapped(f)(x) if vmapped else f(x)

        y = apply(variables, x)
        grads = jax.grad(lambda v, x: _loss_of(apply(v, x)), argnums=(0, 1))(variables, x)
        return variables, y, grads
    if framework == "nnx":
        sizes = (FEATURES, OUT) if name == "Linear" else (FEATURES,)
        m = cls(*sizes, rngs=nnx.Rngs(0), **init)

        def apply(m, x):
            f = lambda x: m(x, **call)
            return vmapped(f)(x) if vmapped else f(x)

        y = apply(m, x)
        grads = nnx.grad(lambda m, x: _loss_of(apply(m, x)), argnums=(0, 1))(m, x)
        return nnx.state(m, nnx.Param), y, grads
    if name == "Linear":
        sizes = {"in_features": FEATURES, "out_features": OUT, **init}
        m = cls(sizes.pop("in_features"), sizes.pop("out_features"), **sizes, key=jax.random.key(0))
    else:
        m = cls((3, FEATURES), **init)

    def apply(m, x):  # unbatched modules, vmapped; a state passed in comes back unchanged
        return jax.vmap(lambda x: m(x, **call)[0] if "state" in call else m(x, **call))(x)

    y = apply(m, x)
    grads = eqx.filter_grad(lambda mx: _loss_of(apply(*mx)))((m, x))
    return m, y, grads


def _input(case: Case, dtype, rng):
    framework, name = case.module.split(".")
    if framework != "equinox" or name != "Linear":
        shape = (4, 3, FEATURES)
    else:
        n_in = case.init.get("in_features", FEATURES)
        shape = (4,) if n_in == "scalar" else (4, n_in)
    x = rng.standard_normal(shape) + (1j * rng.standard_normal(shape) if jnp.issubdtype(dtype, jnp.complexfloating) else 0)
    return jnp.asarray(x + 0.5, dtype)


def _comparable(a):
    """A leaf as float32 data for the tolerance check (a complex leaf: its real and imaginary parts)."""
    a = jnp.asarray(a)
    if jnp.issubdtype(a.dtype, jnp.complexfloating):
        return jnp.stack([a.real, a.imag]).astype(jnp.float32)
    return a.astype(jnp.float32)


def _real(dtype):
    dtype = jnp.dtype(dtype)
    return jnp.dtype(jnp.float32) if jnp.issubdtype(dtype, jnp.complexfloating) else dtype


def _assert_trees_close(got, ref, tol_dtype, scale):
    paths = lambda t: [jax.tree_util.keystr(p) for p, _ in jax.tree.leaves_with_path(t)]
    assert paths(got) == paths(ref)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        a, b = jnp.asarray(a), jnp.asarray(b)
        assert (a.shape, a.dtype) == (b.shape, b.dtype), (a.shape, a.dtype, b.shape, b.dtype)
        assert_close(_comparable(a), np.asarray(_comparable(b)), least_precise(tol_dtype, _real(b.dtype)), scale=scale)


@pytest.fixture
def fallbacks(monkeypatch):
    """The modules that fell back to the stock computation during the test (backend.fall_back calls
    named after a module, not an op)."""
    seen = []
    original = cutelayers.backend.fall_back

    def record(op, why, **kwargs):
        seen.append(op)
        return original(op, why, **kwargs)

    monkeypatch.setattr(cutelayers.backend, "fall_back", record)
    return seen


def _input_dtypes(case):
    """float32 and bfloat16 input for every case that takes the op's path; float32 only where the
    argument sends every input to the stock computation, whatever its float dtype; complex64
    input, which every module hands to the stock computation whatever its arguments (one
    branch, taken after the same argument checks as a float input's), with each module's
    default arguments."""
    if not (case.init or case.call):
        return X_DTYPES
    return (jnp.float32,) if case.path == STOCK else (jnp.float32, jnp.bfloat16)


@pytest.mark.parametrize("case, dtype", [pytest.param(case, dtype, id=f"{case}-{jnp.dtype(dtype).name}")
                                         for case in CASES for dtype in _input_dtypes(case)])
def test_same_as_stock(case, dtype, rng, fallbacks):
    x = _input(case, dtype, rng)
    try:
        stock_params, y_ref, g_ref = _run(case, STOCK_CLASSES, x)
    except Exception as error:  # noqa: BLE001 -- stock refuses: ours must refuse with the same type
        with pytest.raises(type(error)):
            _run(case, OUR_CLASSES, x)
        return
    params, y, g = _run(case, OUR_CLASSES, x)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(stock_params), strict=True):
        np.testing.assert_array_equal(a, b)  # same key or Rngs: the very same parameters
    _, name = case.module.split(".")
    float_input = not jnp.issubdtype(dtype, jnp.complexfloating)
    expected = case.path if float_input else STOCK
    assert (name in fallbacks) == (expected == STOCK), (expected, fallbacks)
    tol_dtype = least_precise(_real(dtype), _real(y_ref.dtype))
    _assert_trees_close(y, y_ref, tol_dtype, scale=4.0)
    _assert_trees_close(g, g_ref, tol_dtype, scale=10.0)


def _arguments(fn):
    return {p for p in inspect.signature(fn).parameters if p != "self"}


@pytest.mark.parametrize("module", INIT)
def test_every_upstream_argument_is_covered(module):
    framework, name = module.split(".")
    stock = getattr(STOCK_CLASSES[framework], name)
    init = (_arguments(stock) if framework == "linen" else _arguments(stock.__init__)) - FIXED[framework]
    call = _arguments(stock.__call__) - INPUT
    assert init == set(INIT[module]), f"{module}: constructor arguments without a case: {init ^ set(INIT[module])}"
    assert call == set(CALL[module]), f"{module}: call arguments without a case: {call ^ set(CALL[module])}"
    ours = getattr(OUR_CLASSES[framework], name)
    assert issubclass(ours, stock)


@pytest.mark.cute  # without the CuTe DSL, that is what the error names (tests/test_without_cute.py)
def test_cute_backend_fails_when_run_off_cuda():
    """An explicit request for kernels fails where they cannot run: here, lowered for the CPU."""
    x = jax.ShapeDtypeStruct((2, FEATURES), jnp.float32)
    with cutelayers.use_backend("cute"), pytest.raises(RuntimeError, match="backend 'cute' .* lowered for cpu"):
        jax.jit(cutelayers.ops.rms_norm).trace(x).lower(lowering_platforms=("cpu",))


def test_cute_backend_refuses_a_fallback():
    x = jnp.ones((2, 3, FEATURES))
    m = cl_nnx.LayerNorm(FEATURES, rngs=nnx.Rngs(0))
    with cutelayers.use_backend("cute"), pytest.raises(RuntimeError, match="LayerNorm: backend 'cute' .* mask"):
        m(x, mask=x > 0)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [c for c in CASES if c.path == KERNEL], ids=str)
def test_kernel_path_cases_gpu(case, rng, fallbacks):
    for dtype in (jnp.bfloat16, jnp.float32):  # backend auto: float32 GEMMs are the op's XLA path
        test_same_as_stock(case, dtype, rng, fallbacks)


# --- calls the table above cannot build ------------------------------------------------------------

def _same(got, want, dtype=jnp.float32):
    got, want = jnp.asarray(got), jnp.asarray(want)
    assert (got.shape, got.dtype) == (want.shape, want.dtype)
    assert_close(got, np.asarray(want), dtype)


def test_narrow_integer_ids_look_up_the_rows_stock_does(rng):
    # uint8 ids of a 256-row table (byte-level tokens): negative-id handling must not add 256 in uint8
    ids = jnp.asarray(rng.integers(0, 256, (5, 7)), jnp.uint8)
    linen_v = nn.Embed(256, 4).init(jax.random.key(0), ids)
    for ours, stock in ((cl_linen.Embed(256, 4), nn.Embed(256, 4)),):
        loss = lambda m: lambda v: jnp.sum(jnp.sin(m.apply(v, ids)))
        _same(ours.apply(linen_v, ids), stock.apply(linen_v, ids))
        _same(jax.grad(loss(ours))(linen_v)["params"]["embedding"], jax.grad(loss(stock))(linen_v)["params"]["embedding"])
    ours, stock = cl_nnx.Embed(256, 4, rngs=nnx.Rngs(0)), nnx.Embed(256, 4, rngs=nnx.Rngs(0))
    _same(ours(ids), stock(ids))
    ours = cl_eqx.Embedding(300, 4, key=jax.random.key(0))
    stock = eqx.nn.Embedding(300, 4, weight=ours.weight)
    _same(jax.vmap(jax.vmap(ours))(ids), jax.vmap(jax.vmap(stock))(ids))
    _same(ours(jnp.int8(5)), stock(jnp.int8(5)))


def test_empty_results_are_the_stock_layers(fallbacks):
    x = jnp.ones((3, 8))
    dense_v = nn.Dense(0, kernel_init=normal).init(jax.random.key(0), x)  # (lecun_normal divides by 0)
    _same(cl_linen.Dense(0, kernel_init=normal).apply(dense_v, x), nn.Dense(0, kernel_init=normal).apply(dense_v, x))
    _same(cl_nnx.Linear(8, 0, kernel_init=normal, rngs=nnx.Rngs(0))(x),
          nnx.Linear(8, 0, kernel_init=normal, rngs=nnx.Rngs(0))(x))
    linear = cl_eqx.Linear(8, 0, key=jax.random.key(0))
    _same(jax.vmap(linear)(x), jax.vmap(eqx.nn.Linear(8, 0, key=jax.random.key(0)))(x))
    ids = jnp.arange(3)
    embed_v = nn.Embed(10, 0, embedding_init=normal).init(jax.random.key(0), ids)
    _same(cl_linen.Embed(10, 0, embedding_init=normal).apply(embed_v, ids),
          nn.Embed(10, 0, embedding_init=normal).apply(embed_v, ids))
    _same(cl_nnx.Embed(10, 0, embedding_init=normal, rngs=nnx.Rngs(0))(ids),
          nnx.Embed(10, 0, embedding_init=normal, rngs=nnx.Rngs(0))(ids))
    table = cl_eqx.Embedding(10, 0, key=jax.random.key(0))
    _same(table(jnp.int32(2)), eqx.nn.Embedding(10, 0, key=jax.random.key(0))(jnp.int32(2)))
    assert {"Dense", "Linear", "Embed", "Embedding"} <= set(fallbacks)


def test_a_traced_epsilon_runs_the_stock_norm(rng, fallbacks):
    # an array epsilon is NNX state: traced under nnx.jit, so only the stock computation takes it
    x = jnp.asarray(rng.standard_normal((4, 8)), jnp.float32)
    for ours, stock in ((cl_nnx.LayerNorm(8, epsilon=jnp.float32(1e-3), rngs=nnx.Rngs(0)),
                         nnx.LayerNorm(8, epsilon=jnp.float32(1e-3), rngs=nnx.Rngs(0))),
                        (cl_nnx.RMSNorm(8, epsilon=jnp.float32(1e-3), rngs=nnx.Rngs(0)),
                         nnx.RMSNorm(8, epsilon=jnp.float32(1e-3), rngs=nnx.Rngs(0)))):
        _same(nnx.jit(lambda m, x: m(x))(ours, x), nnx.jit(lambda m, x: m(x))(stock, x))
    assert {"LayerNorm", "RMSNorm"} <= set(fallbacks)


def _outcome(fn):
    """fn()'s result, or the type of the exception it raised."""
    try:
        return fn()
    except Exception as error:  # noqa: BLE001 -- the stock layer's own error, whatever it is
        return type(error)


@pytest.mark.parametrize("axes", [2, -3, -4, -5, (1, 2), (-3, -1)])
def test_out_of_range_norm_axes_do_what_stock_does(axes, rng, fallbacks):
    # an axis outside [-rank, rank) must not be wrapped onto the last one by our check: the stock
    # computation takes the call and does what it does with it (raises, or wraps the axis its way)
    x = jnp.asarray(rng.standard_normal((4, 8)), jnp.float32)
    for name in ("reduction_axes", "feature_axes"):
        pairs = [(lambda cls=cls: cls(**{name: axes}).init_with_output(jax.random.key(0), x)[0])
                 for cls in (cl_linen.LayerNorm, nn.LayerNorm, cl_linen.RMSNorm, nn.RMSNorm)]
        pairs += [(lambda cls=cls: cls(8, **{name: axes}, rngs=nnx.Rngs(0))(x))
                  for cls in (cl_nnx.LayerNorm, nnx.LayerNorm, cl_nnx.RMSNorm, nnx.RMSNorm)]
        for ours, stock in zip(pairs[::2], pairs[1::2]):
            got, want = _outcome(ours), _outcome(stock)
            if isinstance(want, type):
                assert got is want, (name, axes, got, want)
            else:
                _same(got, want)
    assert {"LayerNorm", "RMSNorm"} <= set(fallbacks)


def test_linen_decides_from_the_parameters_it_is_given(rng, fallbacks):
    # parameters as apply gets them, not as param_dtype would make them: NumPy float64 ones (JAX
    # reads them as float32) run the kernels' path; complex ones the stock computation
    x = jnp.asarray(rng.standard_normal((3, 8)), jnp.float32)
    numpy_params = {"params": {"scale": rng.uniform(0.5, 1.5, 8), "bias": rng.standard_normal(8)}}
    _same(cl_linen.LayerNorm().apply(numpy_params, x), nn.LayerNorm().apply(numpy_params, x))
    _same(cl_linen.RMSNorm().apply({"params": {"scale": numpy_params["params"]["scale"]}}, x),
          nn.RMSNorm().apply({"params": {"scale": numpy_params["params"]["scale"]}}, x))
    assert not {"LayerNorm", "RMSNorm"} & set(fallbacks)  # (on the CPU the ops log their reference path)
    complex_params = {"params": {"kernel": jnp.ones((8, 4), jnp.complex64), "bias": jnp.zeros(4, jnp.complex64)}}
    _same(cl_linen.Dense(4).apply(complex_params, x), nn.Dense(4).apply(complex_params, x))
    assert "Dense" in fallbacks


def test_a_custom_promote_dtype_is_called_once_as_stock_calls_it():
    calls = []

    def doubling(args, **kwargs):
        calls.append(1)
        return tuple(None if a is None else 2 * a for a in nnx.nn.dtypes.promote_dtype(args, **kwargs))

    x = jnp.ones((1, 2))
    ours = cl_nnx.Linear(2, 1, promote_dtype=doubling, kernel_init=nnx.initializers.ones, rngs=nnx.Rngs(0))
    stock = nnx.Linear(2, 1, promote_dtype=doubling, kernel_init=nnx.initializers.ones, rngs=nnx.Rngs(0))
    _same(ours(x), stock(x))
    assert len(calls) == 2  # once each


def test_a_residual_of_another_shape_is_refused_on_either_path():
    # the kernels' path refuses a residual that is not the result's shape; the stock path (here
    # complex inputs) must not broadcast it instead
    for dtype, error in ((jnp.float32, r"argument 'residual' must have shape \(4, 16\)"),
                         (jnp.complex64, r"Dense: argument 'residual' has shape \(16,\); expected the result's")):
        x = jnp.ones((4, 8), dtype)
        dense = cl_linen.Dense(16)
        v = dense.init(jax.random.key(0), x)
        with pytest.raises(ValueError, match=error):
            dense.apply(v, x, residual=jnp.ones(16, dtype))
    x = jnp.ones((4, 8), jnp.complex64)
    for layer in (cl_nnx.Linear(8, 16, rngs=nnx.Rngs(0)), cl_nnx.MLP(8, 32, 16, rngs=nnx.Rngs(0))):
        with pytest.raises(ValueError, match=r"(Linear|MLP): argument 'residual' has shape \(16,\)"):
            layer(x, residual=jnp.ones(16, jnp.complex64))


def test_residual_is_a_keyword_as_stock_has_no_second_positional():
    x = jnp.ones(8)
    linear = cl_eqx.Linear(8, 2, key=jax.random.key(0))
    for layer in (linear, eqx.nn.Linear(8, 2, key=jax.random.key(0))):
        with pytest.raises(TypeError):
            layer(x, jax.random.PRNGKey(1))  # a legacy key passed positionally: not a residual
    v = nn.Dense(2).init(jax.random.key(0), x)
    for dense in (cl_linen.Dense(2), nn.Dense(2)):
        with pytest.raises(TypeError):
            dense.apply(v, x, x)


def _strict_cases(rng):
    """(name, fn) pairs that stock JAX / optax / Equinox code runs under 'strict' dtype promotion:
    gradients of the losses and reductions, a boolean pooling mask, Equinox's norms on bfloat16."""
    x = jnp.asarray(rng.standard_normal((6, 16)), jnp.bfloat16)
    labels = jnp.arange(6) % 16
    h = jnp.asarray(rng.standard_normal((6, 8)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((8, 16)), jnp.float32)
    f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
    return {
        "cross entropy": lambda: jax.grad(lambda x: cutelayers.ops.softmax_cross_entropy(
            x, labels, label_smoothing=0.1, z_loss=1e-4).mean())(f32(x)),
        "linear cross entropy": lambda: jax.grad(lambda h, w: cutelayers.ops.linear_cross_entropy(h, w, labels),
                                                 argnums=(0, 1))(h, w),
        "reduce_max": lambda: jax.grad(lambda x: cutelayers.ops.reduce_max(x).sum())(f32(x)),
        "masked_mean_pool": lambda: cutelayers.ops.masked_mean_pool(x[None], jnp.arange(6)[None] < 4),
        "equinox LayerNorm": lambda: jax.vmap(cl_eqx.LayerNorm(16))(x),
        "equinox RMSNorm": lambda: jax.vmap(cl_eqx.RMSNorm(16))(x),
    }


@pytest.mark.parametrize("name", list(_strict_cases(np.random.default_rng(0))))
def test_strict_dtype_promotion_runs_where_stock_code_does(name, rng):
    # no implicit promotion of our own (a bool one-hot times a float, a float over an int count):
    # the same results under 'strict' as under 'standard'
    fn = _strict_cases(rng)[name]
    want = fn()
    with jax.numpy_dtype_promotion("strict"):
        got = fn()
    jax.tree.map(_same, got, want)
