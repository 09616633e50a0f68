"""cutelayers.cute_call: user kernels through the same primitive, cache and checks as the layers."""

import os
import subprocess
import sys
import textwrap
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numerics import random

import cutelayers as cl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

pytestmark = pytest.mark.cute  # every test here builds a user's CuTe kernel


@pytest.fixture(scope="module")
def uk():
    """tests/user_kernels.py: the kernels these tests call (CuTe DSL code)."""
    import user_kernels

    return user_kernels


@pytest.fixture(scope="module")
def ck():
    """examples/custom_kernel.py: the documented example (CuTe DSL code)."""
    import custom_kernel

    return custom_kernel


def lower_cuda(f, *avals):
    return jax.jit(f).trace(*avals).lower(lowering_platforms=("cuda",)).as_text()


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setenv("CUTELAYERS_CACHE_DIR", "")  # compiles counted here: none loaded from the run's disk cache
    cl.clear_cache()
    jax.clear_caches()


def test_reference_runs_off_gpu_and_kernel_lowers_for_cuda(uk):
    x = jnp.arange(5.0)
    np.testing.assert_allclose(jax.jit(lambda x: uk.add(x, 2.5))(x), x + 2.5)
    hlo = lower_cuda(lambda x: uk.add(x, 2.5), jax.ShapeDtypeStruct((300,), jnp.float32))
    assert "custom_call @cutelayers_add_" in hlo
    lower_cuda(lambda x: uk.add(x, 2.5), jax.ShapeDtypeStruct((7,), jnp.float32))  # new size: no compile
    lower_cuda(lambda x: uk.add(x, 4.0), jax.ShapeDtypeStruct((7,), jnp.float32))  # new constexpr: compile
    assert cl.cache_info()["add"].compiles == 2


def test_compile_key_shares_compiles_between_launcher_objects(uk):
    from cutlass import cute

    def make():
        @cute.jit
        def launcher(stream, x: cute.Tensor, y: cute.Tensor):
            uk.add_kernel(x, y, 1.0).launch(grid=[cute.ceil_div(x.shape[0], 128), 1, 1], block=[128, 1, 1], stream=stream)
        return launcher

    aval = jax.ShapeDtypeStruct((64,), jnp.float32)
    for _ in range(3):
        f = cl.cute_call(make(), out_shape=aval, name="keyed", compile_key="add-one-v1")
        lower_cuda(f, aval)
    assert cl.cache_info()["keyed"].compiles == 1
    f = cl.cute_call(make(), out_shape=aval, name="unkeyed")
    g = cl.cute_call(make(), out_shape=aval, name="unkeyed")
    lower_cuda(f, aval), lower_cuda(g, aval)
    assert cl.cache_info()["unkeyed"].compiles == 2  # two launcher objects, no key: two kernels


def test_aliases_lower_to_output_operand_aliases(uk):
    f = cl.cute_call(uk.add_in_place_launcher, out_shape=jax.ShapeDtypeStruct((256,), jnp.float32),
                     input_output_aliases={0: 0}, name="add_in_place")
    hlo = lower_cuda(f, jax.ShapeDtypeStruct((256,), jnp.float32))
    assert "output_operand_aliases" in hlo


def test_pytree_inputs_outputs_and_modes():
    from cutlass import cute

    @cute.jit
    def launcher(stream, a: cute.Tensor, b: cute.Tensor, out_t: cute.Tensor, out_s: cute.Tensor):
        pass  # compile-only: the structure and the mode view are what is tested

    inputs = {"a": jax.ShapeDtypeStruct((32, 16), jnp.bfloat16), "b": jax.ShapeDtypeStruct((32,), jnp.float32)}
    out_shape = (jax.ShapeDtypeStruct((32, 16), jnp.bfloat16), {"s": jax.ShapeDtypeStruct((32,), jnp.float32)})
    f = cl.cute_call(launcher, out_shape=out_shape, input_modes=[(1, 0), None], output_modes=[(1, 0), None],
                     dynamic_dims=[(0,), (0,), (0,), ()], name="tree")
    lowered = jax.jit(f).trace(inputs).lower(lowering_platforms=("cuda",))
    out_tree = jax.tree.structure(lowered.out_info)
    assert out_tree == jax.tree.structure(out_shape)
    assert cl.cache_info()["tree"].compiles == 1


def test_misuse_errors(uk):
    x = jnp.ones((8,), jnp.float32)
    aval = jax.ShapeDtypeStruct((8,), jnp.float32)
    with pytest.raises(TypeError, match=r"keyword 'amount' holds a JAX array"):
        cl.cute_call(uk.add_launcher, out_shape=aval, amount=jnp.float32(1.0))
    with pytest.raises(TypeError, match=r"keyword 'amount' holds a JAX array"):
        cl.cute_call(uk.add_launcher, out_shape=aval, amount={"a": jnp.ones(2)})
    with pytest.raises(TypeError, match="not hashable"):
        cl.cute_call(uk.add_launcher, out_shape=aval, amount=[1.0])
    with pytest.raises(TypeError, match=r"takes 2 tensors after stream, but the call passes 2 input\(s\) and 1 output"):
        cl.cute_call(uk.add_launcher, out_shape=aval)(x, x)
    with pytest.raises(TypeError, match="input leaf 0: dtype complex64 has no CuTe DSL equivalent"):
        cl.cute_call(uk.add_launcher, out_shape=aval)(jnp.ones((8,), jnp.complex64))
    with pytest.raises(TypeError, match="out_shape leaf 0"):
        cl.cute_call(uk.add_launcher, out_shape=[(8,)])
    with pytest.raises(ValueError, match=r"input_modes\[0\] = \(0, 1\) is not a permutation of the dims of a rank-1"):
        cl.cute_call(uk.add_launcher, out_shape=aval, input_modes=[(0, 1)])(x)
    with pytest.raises(ValueError, match="input_modes has 2 entries; there are 1 input arrays"):
        cl.cute_call(uk.add_launcher, out_shape=aval, input_modes=[None, None])(x)
    with pytest.raises(ValueError, match=r"input 0 \(shape/dtype \(\(8,\), 'float32'\)\) is aliased to output 0, which out_shape declares as \(\(4,\), 'float32'\)"):
        cl.cute_call(uk.add_in_place_launcher, out_shape=jax.ShapeDtypeStruct((4,), jnp.float32),
                     input_output_aliases={0: 0})(x)
    with pytest.raises(ValueError, match="dynamic_dims entry 0 names dim 3"):
        cl.cute_call(uk.add_launcher, out_shape=aval, dynamic_dims=(3,))(x)
    with pytest.raises(NotImplementedError, match="has no reference implementation"):
        cl.cute_call(uk.add_launcher, out_shape=aval)(x)  # CPU, no reference given
    with pytest.raises(NotImplementedError, match="custom_vjp and vmap rules"):
        jax.grad(lambda x: uk.add(x).sum())(x)
    with pytest.raises(NotImplementedError, match="Batching"):
        jax.vmap(uk.add)(jnp.ones((2, 8)))


def test_argument_errors_name_the_argument(uk):
    x = jnp.ones((8,), jnp.float32)
    aval = jax.ShapeDtypeStruct((8,), jnp.float32)
    cases = [
        ({"dynamic_dims": 0}, TypeError, r"dynamic_dims=0; expected a tuple of dims"),
        ({"input_modes": 0}, TypeError, r"input_modes=0; expected one entry per input array"),
        ({"input_modes": (0,)}, TypeError, r"input_modes\[0\] = 0; expected None or a tuple of dims"),
        ({"input_output_aliases": [(0, 0)]}, TypeError, r"input_output_aliases=\[\(0, 0\)\]; expected a dict"),
        ({"input_output_aliases": {0: -1}}, ValueError, r"input_output_aliases 0: -1; indices must be integers >= 0"),
        ({"input_output_aliases": {-1: 0}}, ValueError, r"input_output_aliases -1: 0; indices must be integers >= 0"),
        ({"input_output_aliases": {0: 0, 1: 0}}, ValueError, r"writes one output in place of two inputs"),
        ({"compile_key": ["v1"]}, TypeError, r"compile_key=\['v1'\] is not hashable"),
        ({"name": 123}, TypeError, r"name=123; expected a str"),
        ({"name": "add-v2"}, ValueError, r"name='add-v2'; expected ASCII letters, digits and underscores"),
        ({"name": "my.add"}, ValueError, r"name='my.add'"),
        ({"graph_safe": "no"}, TypeError, r"graph_safe='no'; expected True or False"),
        ({"out_shape": jax.ShapeDtypeStruct((-1,), jnp.float32)}, ValueError,
         r"out_shape leaf 0 has shape \(-1,\); dims must be integers >= 0"),
        ({"out_shape": types.SimpleNamespace(shape=(8.5,), dtype=jnp.float32)}, ValueError,
         r"out_shape leaf 0 has shape \(8.5,\)"),
    ]
    for kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            cl.cute_call(uk.add_launcher, **{"out_shape": aval, **kwargs})(x)


def test_a_reference_that_disagrees_with_out_shape_is_named(uk):
    x = jnp.ones((8,), jnp.float32)
    for out, want in [(jax.ShapeDtypeStruct((8,), jnp.bfloat16),
                       r"returned float32\[8\] as output 0, where out_shape declares bfloat16\[8\]"),
                      (jax.ShapeDtypeStruct((8, 1), jnp.float32), r"returned float32\[8\] as output 0, where out_shape declares float32\[8, 1\]")]:
        f = cl.cute_call(uk.add_launcher, out_shape=out, name="add", reference=lambda x, amount: x + amount, amount=1.0)
        for call in (f, jax.jit(f)):
            with pytest.raises(ValueError, match=r"reference of 'add' " + want):
                call(x)


def test_a_constant_may_be_a_plain_parameter(uk):
    aval = jax.ShapeDtypeStruct((64,), jnp.float32)
    for kwargs in ({"amount": 2.0}, {}):  # given, and left to its default
        f = cl.cute_call(uk.add_launcher_positional, out_shape=aval, name="add_positional", **kwargs)
        assert "custom_call @cutelayers_add_positional_" in lower_cuda(f, aval)
    assert cl.cache_info()["add_positional"].compiles == 2
    with pytest.raises(TypeError, match=r"takes 2 to 3 tensors after stream, but the call passes 3 input\(s\)"):
        cl.cute_call(uk.add_launcher_positional, out_shape=aval)(*[jnp.ones(64)] * 3)


def test_a_symbolic_row_count_exports_a_user_kernel(uk):
    def add(x):
        return cl.cute_call(uk.add_launcher, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), name="add",
                            compile_key="add/v1", reference=lambda x, amount: x + amount, amount=1.5)(x)

    spec = jax.ShapeDtypeStruct(jax.export.symbolic_shape("b"), jnp.float32)
    exported = cl.aot.export(add, spec, platforms=("cuda", "cpu"))
    assert len(cl.aot.kernel_targets(str(exported.mlir_module()))) == 1
    for n in (1, 300):
        np.testing.assert_array_equal(exported.call(jnp.arange(n, dtype=jnp.float32)), np.arange(n) + 1.5)


def write_module(folder, name, source):
    path = folder / f"{name}.py"
    path.write_text(textwrap.dedent(source))
    return str(path)


def test_the_disk_key_covers_the_user_code_a_launcher_reaches(tmp_path, monkeypatch):
    from cutelayers.cute_call import reached_code

    monkeypatch.syspath_prepend(str(tmp_path))
    kernels = write_module(tmp_path, "cc_kernels", """
        def helper(x):
            return x + 1.0
        def kernel(x):
            return helper(x)
        """)
    consts = write_module(tmp_path, "cc_consts", "TILE = 128\n")
    launch = write_module(tmp_path, "cc_launch", """
        import numpy as np
        import cutelayers
        import cc_consts
        from cc_kernels import kernel
        def launcher(stream, x, y):
            return kernel(x) * cc_consts.TILE + np.float32(cutelayers.__name__ == "cutelayers")
        """)
    import cc_launch

    files, fileless = reached_code(cc_launch.launcher)
    assert set(files) == {kernels, consts, launch}  # not numpy's, nor cutelayers' own (hashed apart)
    assert fileless == ""

    def digest_of(source):  # a launcher with no file on disk (python -c): its code is the key
        namespace = {}
        exec(compile(textwrap.dedent(source), "<string>", "exec"), namespace)  # noqa: S102 -- as python -c does
        return reached_code(namespace["launcher"])

    one = digest_of("def launcher(stream, x, y):\n    return x + 1.0\n")
    assert one[0] == () and one[1]
    assert digest_of("def launcher(stream, x, y):\n    return x + 1.0\n") == one
    assert digest_of("def launcher(stream, x, y):\n    return x + 2.0\n") != one


def test_unkeyed_kernels_of_two_processes_have_different_targets():
    # A bundle's unkeyed kernel, loaded beside the loader's own, must not share its FFI target.
    code = textwrap.dedent("""
        import jax, jax.numpy as jnp, cutelayers as cl
        from user_kernels import add_launcher
        aval = jax.ShapeDtypeStruct((64,), jnp.float32)
        f = cl.cute_call(add_launcher, out_shape=aval, name="unkeyed")
        print(cl.aot.kernel_targets(jax.jit(f).trace(aval).lower(lowering_platforms=("cuda",)).as_text()))
        """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]),
           "CUTELAYERS_CACHE_DIR": ""}
    runs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    targets = [run.communicate(timeout=240)[0].strip().splitlines()[-1] for run in runs]
    assert all(run.returncode == 0 for run in runs)
    assert targets[0].startswith("['cutelayers_unkeyed_") and targets[0] != targets[1]


def test_example_custom_op_grads_and_vmap(rng, ck):
    ck.main()  # values, grads, nested vmap vs jnp (reference lowering here)
    x = random(rng, (3, 50), jnp.float32)
    s = random(rng, (3,), jnp.float32)
    hlo = lower_cuda(jax.grad(lambda x, s: jnp.sum(jax.vmap(ck.row_scale)(x[None], s[None]) ** 2), (0, 1)), x, s)
    assert hlo.count("custom_call @cutelayers_row_scale_") >= 2  # forward and dx


@pytest.mark.gpu
def test_example_on_gpu(rng, uk, ck):
    with cl.use_backend("cute"):
        ck.main()
        x = random(rng, (5, 7, 1000), jnp.bfloat16)
        s = random(rng, (5, 7), jnp.bfloat16)
        np.testing.assert_allclose(np.asarray(ck.row_scale(x, s), np.float32),
                                   np.asarray(x, np.float32) * np.asarray(s, np.float32)[..., None], rtol=1e-2, atol=1e-2)
        for dyn in [(0,), ()]:
            y = jax.jit(lambda x: uk.add(x, 3.0, dynamic_dims=dyn))(jnp.arange(1000.0))
            np.testing.assert_allclose(y, np.arange(1000.0) + 3.0)


@pytest.mark.gpu
def test_in_place_alias_writes_in_place_gpu(uk):
    f = cl.cute_call(uk.add_in_place_launcher, out_shape=jax.ShapeDtypeStruct((4096,), jnp.float32),
                     input_output_aliases={0: 0}, name="add_in_place", amount=2.0)
    x = jnp.arange(4096.0)
    pointer = x.unsafe_buffer_pointer()
    with cl.use_backend("cute"):
        y = jax.jit(f, donate_argnums=0)(x)
    np.testing.assert_allclose(y, np.arange(4096.0) + 2.0)
    assert y.unsafe_buffer_pointer() == pointer  # the kernel wrote into the donated input buffer


def test_mode_view_reference_and_lowering(uk):
    x = jnp.arange(12.0).reshape(3, 4)
    np.testing.assert_allclose(uk.transpose_call(x), x.T)
    hlo = lower_cuda(uk.transpose_call, jax.ShapeDtypeStruct((64, 48), jnp.float32))
    assert "custom_call @cutelayers_transpose_view_" in hlo


@pytest.mark.gpu
def test_mode_view_gpu(rng, uk):
    with cl.use_backend("cute"):
        for rows in (5, 300):
            x = random(rng, (rows, 48), jnp.bfloat16)
            np.testing.assert_array_equal(np.asarray(jax.jit(uk.transpose_call)(x), np.float32), np.asarray(x, np.float32).T)
