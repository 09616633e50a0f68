"""``cutelayers.ops.embed`` and the drop-in embedding modules (linen / nnx ``Embed``, Equinox
``Embedding``): values equal to the stock lookup, table gradients against a float64 scatter-add,
index rules (negative, out of range, ``clip``), vmap / grad compositions, errors, and each stock
constructor and call argument."""

import dataclasses
import inspect
import re

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from numerics import assert_close, dtype_cover, random

import cutelayers.backend
from cutelayers import equinox as cl_eqx
from cutelayers.flax import linen as cl_linen
from cutelayers.flax import nnx as cl_nnx
from cutelayers.ops import embed
from cutelayers.ops.embed import BLOCK_TOKENS, table_grad

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


@pytest.fixture(autouse=True)
def _rank_promotion_raises():
    with jax.numpy_rank_promotion("raise"):
        yield


def token_ids(rng, shape, vocab, hot=0.5, out_of_range=0):
    """Ids in [-vocab, vocab): about ``hot`` of them one id (the collisions the gradient is built
    for); ``out_of_range`` of them beyond the table on either side."""
    ids = rng.integers(-vocab, vocab, shape)
    ids = np.where(rng.random(shape) < hot, rng.integers(vocab), ids)
    flat = ids.reshape(-1)
    where = rng.choice(flat.size, out_of_range, replace=False)
    flat[where] = rng.choice([-vocab - 3, vocab, vocab + 7], out_of_range)
    return jnp.asarray(ids, jnp.int32)


def scatter_reference(dy, ids, vocab, clip=False):
    """float64 (vocab, H) sum of dy's rows by id, in numpy; ids as the op reads them."""
    ids = np.asarray(ids).reshape(-1)
    ids = np.where(ids < 0, ids + vocab, ids)
    if clip:
        ids = np.clip(ids, 0, vocab - 1)
    keep = (ids >= 0) & (ids < vocab)
    out = np.zeros((vocab, dy.shape[-1]))
    np.add.at(out, ids[keep], np.asarray(jnp.asarray(dy, jnp.float32), np.float64).reshape(-1, dy.shape[-1])[keep])
    return out


# --- the op -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,shape", dtype_cover([(1,), (7,), (3, 1000), (2, 5, 129)]))
def test_values_and_table_gradient(shape, dtype, rng):
    vocab, h = 37, 24
    table = random(rng, (vocab, h), dtype)
    ids = token_ids(rng, shape, vocab, out_of_range=min(3, int(np.prod(shape)) // 2))
    y, pullback = jax.vjp(lambda t: embed(table=t, ids=ids), table)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(jnp.take(table, ids, axis=0), np.float32))
    dy = random(rng, y.shape, dtype)
    (dtable,) = pullback(dy)
    assert dtable.dtype == table.dtype and dtable.shape == table.shape
    # float32 sums, rounded once to the table's dtype
    assert_close(dtable, scatter_reference(dy, ids, vocab), dtype)


@pytest.mark.parametrize("block", [1, 8, BLOCK_TOKENS])
def test_every_block_size_gives_the_same_sums(block, rng):
    vocab, h = 11, 8
    ids = token_ids(rng, (300,), vocab) % vocab  # every id in range
    dy = random(rng, (300, h), jnp.float32)
    got = table_grad(dy, ids, vocab, block_tokens=block)
    np.testing.assert_allclose(got, scatter_reference(dy, ids, vocab), rtol=1e-6, atol=1e-5)


def test_dtype_casts_after_the_lookup(rng):
    table = random(rng, (50, 16), jnp.float32)
    ids = token_ids(rng, (4, 9), 50)
    y = embed(table, ids, jnp.bfloat16)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_array_equal(y, jnp.take(table.astype(jnp.bfloat16), ids, axis=0))
    dtable = jax.grad(lambda t: jnp.sum(embed(t, ids, jnp.bfloat16).astype(jnp.float32)))(table)
    assert dtable.dtype == jnp.float32
    np.testing.assert_allclose(dtable, scatter_reference(jnp.ones(ids.shape + (16,)), ids, 50), rtol=1e-6)


def test_clip_mode_is_scalar_indexing(rng):
    vocab = 6
    table = random(rng, (vocab, 4), jnp.float32)
    for i in (-9, -6, -1, 0, 5, 6, 40):
        want_y, want_g = jax.value_and_grad(lambda t: jnp.sum(t[jnp.int32(i)] * jnp.arange(4.0)))(table)
        got_y, got_g = jax.value_and_grad(
            lambda t: jnp.sum(embed(t, jnp.int32(i), mode="clip") * jnp.arange(4.0)))(table)
        np.testing.assert_allclose(got_y, want_y, rtol=1e-6)
        np.testing.assert_allclose(got_g, want_g, rtol=1e-6)


def test_a_nonfinite_gradient_of_a_dropped_token_stays_out(rng):
    """An out-of-range token's row is NaN; its (NaN) gradient must not reach the block's sums."""
    table = random(rng, (10, 4), jnp.float32)
    ids = jnp.array([1, 2, 99, 2, 1], jnp.int32)
    grad = jax.grad(lambda t: jnp.nansum(embed(t, ids) ** 2))(table)
    want = jax.grad(lambda t: jnp.nansum(jnp.take(t, ids, axis=0) ** 2))(table)
    np.testing.assert_allclose(grad, want, rtol=1e-6)


def test_table_gradient_zeros_are_filled_after_the_block_sums():
    """The float32 table the gradient is scattered into is filled once the block sums exist
    (``ops._zeros``), not wherever XLA puts a constant broadcast: early in a train step it sat
    through the backward's memory peak (147 MiB at GPT-2 size)."""
    vocab, h = 300, 16
    grad = jax.grad(lambda t, i: jnp.sum(embed(t, i, jnp.bfloat16).astype(jnp.float32) ** 2))
    hlo = jax.jit(grad).lower(jax.ShapeDtypeStruct((vocab, h), jnp.float32),
                              jax.ShapeDtypeStruct((4, 256), jnp.int32)).as_text()
    assert len(re.findall(rf"stablehlo\.broadcast_in_dim .* -> tensor<{vocab}x{h}xf32>", hlo)) == 1
    (fill,) = re.findall(rf"stablehlo\.broadcast_in_dim (%\w+)#0, dims = \[\] : \(tensor<f32>\) -> tensor<{vocab}x{h}xf32>",
                         hlo)
    assert re.search(rf"{fill}:2 = stablehlo\.optimization_barrier", hlo)


def test_vmap_and_grad_compositions(rng):
    vocab, h = 40, 8
    table = random(rng, (vocab, h), jnp.float32)
    ids = token_ids(rng, (3, 4, 50), vocab) % vocab
    cot = random(rng, (3, 4, 50, h), jnp.float32)

    def loss(t, i, c):
        return jnp.sum(embed(t, i) * c)

    want = scatter_reference(cot, ids, vocab)
    # grad of a nested vmap: one gradient over all tokens
    folded = jax.grad(lambda t: jnp.sum(jax.vmap(jax.vmap(lambda i, c: loss(t, i, c)))(ids, cot)))(table)
    np.testing.assert_allclose(folded, want, rtol=1e-5, atol=1e-5)
    # vmap of grad: per-example gradients
    per_example = jax.jit(jax.vmap(jax.grad(loss), (None, 0, 0)))(table, ids, cot)
    np.testing.assert_allclose(per_example.sum(0), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(per_example[1], scatter_reference(cot[1], ids[1], vocab), rtol=1e-5, atol=1e-5)
    # a batched table (one per example)
    tables = random(rng, (3, vocab, h), jnp.float32)
    np.testing.assert_array_equal(jax.vmap(embed)(tables, ids), jax.vmap(lambda t, i: t[i])(tables, ids))


def test_errors(rng):
    table = random(rng, (10, 4), jnp.float32)
    with pytest.raises(TypeError, match="'ids' must be an integer array; got float32"):
        embed(table, jnp.zeros(3))
    with pytest.raises(ValueError, match="'table' must have rank 2"):
        embed(jnp.zeros((2, 3, 4)), jnp.zeros(3, jnp.int32))
    with pytest.raises(TypeError, match="'table' has dtype int32"):
        embed(jnp.zeros((2, 3), jnp.int32), jnp.zeros(3, jnp.int32))
    with pytest.raises(ValueError, match="'mode' is 'wrap'; allowed: 'fill', 'clip'"):
        embed(table, jnp.zeros(3, jnp.int32), mode="wrap")
    with pytest.raises(TypeError, match="'dtype' is 'foo'; allowed"):
        embed(table, jnp.zeros(3, jnp.int32), dtype="foo")
    with pytest.raises(ValueError, match=r"'table' has no rows \(shape \(0, 4\)\) to look 2 id\(s\) up in"):
        embed(jnp.zeros((0, 4)), jnp.zeros(2, jnp.int32))


@pytest.mark.parametrize("shape", [(0,), (2, 0), (0, 2)])
def test_no_tokens_give_a_zero_table_gradient(rng, shape):
    table = random(rng, (10, 4), jnp.float32)
    ids = jnp.zeros(shape, jnp.int32)
    assert embed(table, ids).shape == (*shape, 4)
    grad = jax.grad(lambda t: embed(t, ids).sum())(table)
    np.testing.assert_array_equal(grad, np.zeros((10, 4), np.float32))


# --- the modules -------------------------------------------------------------------------------------

def _loss(y):
    return jnp.sum(jnp.sin(jnp.nan_to_num(y.astype(jnp.float32))))


@pytest.fixture
def fallbacks(monkeypatch):
    """Modules that fell back to the stock computation during the test."""
    seen = []
    original = cutelayers.backend.fall_back
    monkeypatch.setattr(cutelayers.backend, "fall_back", lambda op, why: (seen.append(op), original(op, why)))
    return seen


NNX_CASES = [{}, {"dtype": jnp.bfloat16}, {"param_dtype": jnp.bfloat16}, {"dtype": jnp.float16},
             {"embedding_init": nnx.initializers.ones}, {"embedding_metadata": {"description": "tokens"}}]


def _case_id(init: dict) -> str:
    return ",".join(f"{k}={getattr(v, '__name__', v)}" for k, v in init.items()) or "defaults"


@pytest.mark.parametrize("init", NNX_CASES, ids=_case_id)
def test_nnx_embed_matches_stock(init, rng, fallbacks):
    vocab, h = 30, 8
    ids = token_ids(rng, (4, 33), vocab, out_of_range=4)
    ours, stock = (cls(vocab, h, **init, rngs=nnx.Rngs(3)) for cls in (cl_nnx.Embed, nnx.Embed))
    assert isinstance(ours, nnx.Embed)
    np.testing.assert_array_equal(ours.embedding[...], stock.embedding[...])
    y = ours(ids)
    assert y.dtype == stock(ids).dtype
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(stock(ids), np.float32))
    grad = nnx.grad(lambda m: _loss(m(ids)))(ours).embedding[...]
    dy = jax.grad(lambda y: _loss(y))(stock(ids))
    assert_close(grad, scatter_reference(dy, ids, vocab), y.dtype)
    query = random(rng, (3, h), jnp.float32)
    np.testing.assert_array_equal(ours.attend(query), stock.attend(query))
    assert fallbacks == []


def test_nnx_embed_falls_back_where_only_stock_serves(rng, fallbacks):
    one = cl_nnx.Embed(1, 4, rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(one(jnp.zeros((2, 3), jnp.int32)), nnx.Embed(1, 4, rngs=nnx.Rngs(0))(
        jnp.zeros((2, 3), jnp.int32)))
    layer = cl_nnx.Embed(10, 4, promote_dtype=lambda args, dtype, inexact: args, rngs=nnx.Rngs(0))
    layer(jnp.arange(3))
    with pytest.raises(ValueError, match="integer"):  # stock's own error for float ids
        cl_nnx.Embed(10, 4, rngs=nnx.Rngs(0))(jnp.zeros(3))
    mesh = jax.make_mesh((1,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
    with jax.set_mesh(mesh):
        layer = cl_nnx.Embed(10, 4, rngs=nnx.Rngs(0))
        y = layer(jnp.arange(3), out_sharding=jax.sharding.PartitionSpec())
    np.testing.assert_array_equal(y, layer.embedding[...][:3])
    assert fallbacks == ["Embed"] * 4


@pytest.mark.parametrize("init", [{}, {"dtype": jnp.bfloat16}, {"param_dtype": jnp.float16},
                                  {"embedding_init": nn.initializers.ones}], ids=_case_id)
def test_linen_embed_matches_stock(init, rng, fallbacks):
    vocab, h = 30, 8
    ids = token_ids(rng, (4, 33), vocab, out_of_range=4)
    ours, stock = cl_linen.Embed(vocab, h, **init), nn.Embed(vocab, h, **init)
    variables = ours.init(jax.random.key(1), ids)
    assert jax.tree.structure(variables) == jax.tree.structure(stock.init(jax.random.key(1), ids))
    y = ours.apply(variables, ids)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(stock.apply(variables, ids), np.float32))
    grad = jax.grad(lambda v: _loss(ours.apply(v, ids)))(variables)["params"]["embedding"]
    dy = jax.grad(_loss)(stock.apply(variables, ids))
    assert_close(grad, scatter_reference(dy, ids, vocab), y.dtype)
    query = random(rng, (3, h), jnp.float32)
    np.testing.assert_array_equal(ours.apply(variables, query, method="attend"),
                                  stock.apply(variables, query, method="attend"))
    assert fallbacks == []


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_equinox_embedding_matches_stock(dtype, rng, fallbacks):
    vocab, h = 30, 8
    ids = token_ids(rng, (4, 33), vocab, out_of_range=4)
    ours, stock = (cls(vocab, h, dtype=dtype, key=jax.random.key(2)) for cls in (cl_eqx.Embedding, eqx.nn.Embedding))
    np.testing.assert_array_equal(ours.weight, stock.weight)
    lookup = lambda m: jax.vmap(jax.vmap(m))(ids)
    np.testing.assert_array_equal(np.asarray(lookup(ours), np.float32), np.asarray(lookup(stock), np.float32))
    got = jax.grad(lambda m: _loss(lookup(m)))(ours).weight
    dy = jax.grad(_loss)(lookup(stock))  # stock sums in the weight's dtype: compare with float64
    assert_close(got, scatter_reference(dy, ids, vocab, clip=True), dtype)
    assert ours(3).shape == (h,) and fallbacks == []
    with pytest.raises(ValueError, match="scalar index"):  # stock's own error
        ours(jnp.arange(3))


@pytest.mark.parametrize("stock", [nnx.Embed.__init__, nnx.Embed.__call__, nn.Embed, eqx.nn.Embedding.__init__,
                                   eqx.nn.Embedding.__call__], ids=lambda f: getattr(f, "__qualname__", str(f)))
def test_every_upstream_argument_is_covered(stock):
    """An argument a new Flax / Equinox version adds fails here until the tests above try it."""
    covered = {"self", "num_embeddings", "features", "dtype", "param_dtype", "embedding_init", "promote_dtype",
               "rngs", "embedding_metadata", "inputs", "out_sharding", "parent", "name", "embedding_size",
               "weight", "key", "x"}
    names = ({f.name for f in dataclasses.fields(stock)} if isinstance(stock, type)
             else set(inspect.signature(stock).parameters))
    assert names <= covered, names - covered
