"""The GPT models (models/): forward / backward per framework on CPU, the stock twins (same
parameter tree, parameters move across, same loss), and, lowered for CUDA on this machine
(CUTE_DSL_ARCH=sm_90a, set by conftest), each block's MLP as one ``ops.mlp``, the compile-once
property of deep24's blocks and the AoT export of a train step."""

import contextlib
import dataclasses
import io
import math
import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import built
from jax.ad_checkpoint import print_saved_residuals
from numerics import assert_close
from test_linear import kernel_operand_counts

import cutelayers as cl
from models import common
from models.configs import CONFIGS, GPTConfig, get_config

FRAMEWORKS = common.FRAMEWORKS


def tokens(seed, shape, vocab=256):
    x = jax.random.randint(jax.random.key(seed), shape, 0, vocab)
    return x, jnp.roll(x, -1, axis=-1)


@pytest.fixture(autouse=True)
def _rank_promotion_raises():
    """The models (both twins, every design) use no implicit rank promotion."""
    with jax.numpy_rank_promotion("raise"):
        yield


@pytest.fixture(scope="module")
def tiny():
    return get_config("tiny")


# The block designs the models build: GPT-2's, and Llama's parts (the llama preset's) at tiny's size.
DESIGNS = {"gpt": {}, "llama": {"norm": "rms", "activation": "swiglu", "bias": False, "rope": True, "n_kv_heads": 2},
           "tied": {"tie_embeddings": True}}


# --- configs -----------------------------------------------------------------------------------

def test_configs():
    assert set(CONFIGS) == {"tiny", "small", "deep24", "gpt2", "wide", "llama"}
    assert CONFIGS["deep24"].n_layers == 24
    gpt2 = CONFIGS["gpt2"]
    assert (gpt2.n_layers, gpt2.d_model, gpt2.n_heads, gpt2.vocab_size, gpt2.seq_len, gpt2.dtype) == (
        12, 768, 12, 50304, 1024, "bfloat16")
    wide = CONFIGS["wide"]  # Llama 3.2 1B's width, depth, heads of 128 and vocabulary
    assert (wide.n_layers, wide.d_model, wide.head_dim, wide.d_mlp, wide.vocab_size, wide.seq_len) == (
        16, 2048, 128, 8192, 128256, 2048)
    assert 1.3e9 <= wide.num_params() <= 1.4e9
    llama = CONFIGS["llama"]  # Llama 3.2 1B's block at the same shapes
    assert dataclasses.replace(llama, norm="layer", activation="gelu", bias=True, rope=False, n_heads=16,
                               n_kv_heads=None) == wide
    assert (llama.norm, llama.activation, llama.bias, llama.rope, llama.fc1_features) == ("rms", "swiglu", False, True, 16384)
    assert (llama.n_heads, llama.kv_heads, llama.head_dim, llama.qkv_features, llama.splits_qkv) == (32, 8, 64, 3072, False)
    d, f, v, n = llama.d_model, llama.d_mlp, llama.vocab_size, llama.n_layers
    assert llama.num_params() == 2 * v * d + n * (2 * d + d * (2 * d + 2 * 512) + 3 * d * f) + d
    # tied, it is Llama 3.2 1B's count (1.24B)
    assert 1.23e9 < dataclasses.replace(llama, tie_embeddings=True).num_params() < 1.24e9
    assert dataclasses.replace(llama, tie_embeddings=True).num_params() == llama.num_params() - v * d
    assert 20e6 <= CONFIGS["small"].num_params() <= 50e6
    assert CONFIGS["tiny"].num_params() < 1e6
    with pytest.raises(ValueError, match="multiple of n_heads"):
        GPTConfig(d_model=65, n_heads=4)
    with pytest.raises(ValueError, match="dtype"):
        GPTConfig(dtype="int8")
    with pytest.raises(ValueError, match=r"GPTConfig.norm must be one of 'layer', 'rms'; got 'batch'"):
        GPTConfig(norm="batch")
    with pytest.raises(ValueError, match=r"GPTConfig.activation must be one of 'gelu', 'swiglu'; got 'relu'"):
        GPTConfig(activation="relu")
    for kv in (3, 0, 2.0):
        with pytest.raises(ValueError, match=rf"n_kv_heads must be None or a positive integer dividing n_heads=4; got {kv}"):
            GPTConfig(n_kv_heads=kv)
    with pytest.raises(ValueError, match=r"GPTConfig.remat must be one of 'none', 'full', 'dots'; got 'some'"):
        GPTConfig(remat="some")
    with pytest.raises(ValueError, match="GPTConfig.rope_theta must be a positive number; got 0"):
        GPTConfig(rope=True, rope_theta=0)
    with pytest.raises(ValueError, match="head_dim=3 .* must be even"):
        GPTConfig(d_model=12, n_heads=4, rope=True)
    with pytest.raises(ValueError, match="unknown model config 'huge'"):
        get_config("huge")
    with pytest.raises(ValueError, match="unknown framework 'torch'"):
        common.load("torch")


# --- each framework's model and its stock twin -----------------------------------------------------

def perturbed(params, seed=5, scale=0.05):
    """Parameters moved off their init (norm scales / biases away from 1 / 0); numpy noise (cheap
    on CPU: no per-shape random-number kernels to compile)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda p: p + jnp.asarray(scale * rng.standard_normal(p.shape), p.dtype), params)


@pytest.mark.parametrize("design", DESIGNS)
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_forward_backward_and_stock_twin(framework, design, tiny):
    """Our model and its stock twin: the same parameter tree; with the same (perturbed) parameters,
    the same loss and gradients, and each one's logits give its loss."""
    tiny = dataclasses.replace(tiny, **DESIGNS[design])
    stock = common.init(framework, tiny, jax.random.key(0), stock=True)
    ours = common.init(framework, tiny, jax.random.key(1), abstract=True)  # only its tree is needed
    assert sum(int(np.prod(p.shape)) for p in jax.tree.leaves(stock.params)) == tiny.num_params()
    # the same parameter tree: key paths, shapes, dtypes
    assert common.tree_signature(stock.params) == common.tree_signature(ours.params)
    # and the same empty (None) nodes, which an Orbax checkpoint holds and compares too: the tied
    # Equinox twins differed there (a weightless head vs none), and neither read the other's checkpoint
    nodes = lambda tree: [jax.tree_util.keystr(path) for path, _ in
                          jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is None)[0]]
    assert nodes(stock.params) == nodes(ours.params)
    # train-ish stock parameters, loaded into ours: the same loss and gradients
    stock_params = perturbed(stock.params)
    loaded = common.transfer_params(stock_params, ours.params)
    x, y = tokens(4, (2, 48))
    ref, ref_grads = jax.jit(jax.value_and_grad(stock.loss))(stock_params, x, y)
    out, out_grads = jax.jit(jax.value_and_grad(ours.loss))(loaded, x, y)
    assert out.dtype == jnp.float32 and out.shape == ()
    assert abs(float(out) - math.log(256)) < 0.5  # small weights: near-uniform predictions
    assert jax.tree.structure(out_grads) == jax.tree.structure(ours.params)
    for path, g in jax.tree.leaves_with_path(out_grads):
        assert np.all(np.isfinite(g)) and float(jnp.max(jnp.abs(g))) > 0, jax.tree_util.keystr(path)
    assert_close(out, ref, jnp.float32, scale=2.0)
    flat = lambda t: jnp.concatenate([g.ravel() for g in jax.tree.leaves(t)])
    assert_close(flat(out_grads), flat(ref_grads), jnp.float32, scale=50.0)
    # each twin's logits give its loss
    for model, params, loss in ((ours, loaded, out), (stock, stock_params, ref)):
        logits = jax.jit(model.logits)(params, x)
        assert logits.shape == (*x.shape, tiny.vocab_size) and logits.dtype == jnp.float32
        assert_close(common.cross_entropy(logits, y), loss, jnp.float32, scale=4)
    with pytest.raises(ValueError, match=r"sequence length 65 exceeds the model's maximum \(config.seq_len=64\)"):
        jax.eval_shape(ours.loss, ours.params, *tokens(2, (1, tiny.seq_len + 1)))


@pytest.mark.parametrize("design", DESIGNS)
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_stock_twin_bfloat16(framework, design, tiny):
    cfg = dataclasses.replace(tiny, dtype="bfloat16", **DESIGNS[design])
    stock = common.init(framework, cfg, jax.random.key(0), stock=True)
    ours = common.init(framework, cfg, jax.random.key(1), abstract=True)
    params = perturbed(stock.params)
    x, y = tokens(6, (2, 48))
    ref = jax.jit(stock.loss)(params, x, y)
    out = jax.jit(ours.loss)(common.transfer_params(params, ours.params), x, y)
    assert out.dtype == jnp.float32
    assert_close(out, ref, jnp.bfloat16)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_remat_keeps_the_loss_and_gradients(framework, tiny):
    """``GPTConfig.remat``: each block recomputed in the backward, both twins -- the same parameter
    tree, loss and gradients as without it, and fewer activations kept ("full" the fewest)."""
    x, y = tokens(3, (2, 48))
    for stock in (False, True):
        kept, results = {}, {}
        for remat in ("none", "dots", "full"):
            model = common.init(framework, dataclasses.replace(tiny, remat=remat), jax.random.key(0), stock=stock)
            results[remat] = jax.jit(jax.value_and_grad(model.loss))(model.params, x, y)
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                print_saved_residuals(model.loss, model.params, x, y)
            kept[remat] = sum("from the argument" not in line for line in printed.getvalue().splitlines())
            assert common.tree_signature(model.params) == common.tree_signature(
                common.init(framework, tiny, jax.random.key(0), stock=stock, abstract=True).params)
        for remat in ("dots", "full"):
            assert_close(results[remat][0], results["none"][0], jnp.float32, scale=2.0)
            for g, want in zip(jax.tree.leaves(results[remat][1]), jax.tree.leaves(results["none"][1])):
                assert_close(g, want, jnp.float32, scale=4.0)
        assert kept["none"] > kept["dots"] > kept["full"], (stock, kept)


def test_llama_parts_in_the_parameter_trees(tiny):
    """The llama design's trees: RMSNorm scales and no bias anywhere, fc1 the gate and value
    halves, and no position table (rotary positions)."""
    cfg = dataclasses.replace(tiny, **DESIGNS["llama"])
    for framework in FRAMEWORKS:
        paths = {path: shape for path, shape, _ in common.tree_signature(
            common.init(framework, cfg, jax.random.key(0), abstract=True).params)}
        assert not [p for p in paths if "bias" in p or "wpe" in p], framework
        assert (cfg.d_model,) in {paths[p] for p in paths if "ln1" in p}, framework
        fc1 = [shape for p, shape in paths.items() if re.search(r"fc1|Dense_0", p)]
        assert fc1 and all(sorted(shape) == sorted((cfg.d_model, 2 * cfg.d_mlp)) for shape in fc1), framework


def test_rotary_positions():
    """Rotary positions turn each pair (x1_i, x2_i) of a head -- its two halves -- by t * theta^(-2i/Dh):
    the complex product (x1 + i x2) e^(i angle); so a query-key product depends on t - s only."""
    t, h, dh, theta = 7, 3, 8, 500.0
    x = jax.random.normal(jax.random.key(0), (2, t, h, dh), jnp.float32)
    angles = np.arange(t)[:, None] * theta ** (-np.arange(0, dh, 2) / dh)
    expected = (np.asarray(x[..., :dh // 2]) + 1j * np.asarray(x[..., dh // 2:])) * np.exp(1j * angles)[None, :, None]
    got = np.asarray(common.rotary(x, theta))
    np.testing.assert_allclose(got, np.concatenate([expected.real, expected.imag], -1), rtol=1e-5, atol=1e-5)
    assert common.rotary(x.astype(jnp.bfloat16), theta).dtype == jnp.bfloat16
    # the same q and k at every position: <q_t, k_s> is a function of t - s
    q, k = (jnp.broadcast_to(jax.random.normal(jax.random.key(i), (1, 1, dh)), (t, 1, dh)) for i in (1, 2))
    scores = np.asarray(jnp.einsum("thd,shd->ts", common.rotary(q, theta), common.rotary(k, theta)))
    for lag in range(-t + 1, t):
        np.testing.assert_allclose(np.diagonal(scores, lag), np.diagonal(scores, lag)[0], rtol=1e-4, atol=1e-5)
    assert np.ptp(np.diagonal(scores, 0)) < 1e-4 < np.ptp(scores)


@pytest.mark.parametrize("fused", [True, False])
def test_grouped_query_attention(fused):
    """kv_heads < n_heads: each key / value head serves n_heads / kv_heads consecutive query heads
    -- softmax attention with k and v repeated per group -- from one fused qkv array or three."""
    cfg = GPTConfig(d_model=32, n_heads=4, n_kv_heads=2, seq_len=8)
    dh, t = cfg.head_dim, 6
    qkv = jax.random.normal(jax.random.key(0), (2, t, cfg.qkv_features), jnp.float32)
    q, k, v = jnp.split(qkv, [32, 32 + 2 * dh], axis=-1)
    got = common.causal_attention(qkv if fused else (q, k, v), cfg)
    heads = lambda a: a.reshape(2, t, -1, dh)
    k, v = (jnp.repeat(heads(a), 2, axis=2) for a in (k, v))
    scores = jnp.einsum("bthd,bshd->bhts", heads(q), k) / np.sqrt(dh)
    scores = jnp.where(jnp.tril(jnp.ones((t, t), bool))[None, None], scores, -jnp.inf)
    expected = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(scores, axis=-1), v).reshape(2, t, 32)
    assert got.shape == (2, t, 32)
    assert_close(got, expected, jnp.float32, scale=4)


def test_equinox_takes_one_sequence_or_a_batch(tiny):
    model = common.init("equinox", tiny, jax.random.key(0))
    x, y = tokens(3, (2, 16))
    loss = jax.jit(model.loss)
    singles = jnp.stack([loss(model.params, x[i], y[i]) for i in range(2)])
    assert_close(loss(model.params, x, y), jnp.mean(singles), jnp.float32, scale=10)


def test_transfer_params_rejects_other_trees(tiny):
    a = common.init("linen", tiny, jax.random.key(0), abstract=True).params
    b = common.init("linen", dataclasses.replace(tiny, n_layers=1), jax.random.key(0), abstract=True).params
    with pytest.raises(ValueError, match="parameter trees differ"):
        common.transfer_params(a, b)


# --- attention: cuDNN where it serves, XLA elsewhere ------------------------------------------------

@pytest.mark.parametrize("dtype,head_dim,capability,expected", [
    ("bfloat16", 64, (9, 0), "cudnn"),
    ("float16", 256, (9, 0), "cudnn"),
    ("bfloat16", 192, (8, 0), "xla"),    # over 128: Hopper and later only
    ("float32", 64, (9, 0), "xla"),      # cuDNN attention takes bf16 / fp16
    ("bfloat16", 12, (9, 0), "xla"),     # not a multiple of 8
    ("bfloat16", 264, (9, 0), "xla"),    # over 256
    ("bfloat16", 64, (7, 5), "xla"),     # before Ampere
    ("bfloat16", 64, None, "xla"),       # no CUDA GPU
])
def test_attention_choice(dtype, head_dim, capability, expected):
    assert common._attention_choice(dtype, head_dim, capability) == expected


def test_attention_falls_back_to_xla_without_a_gpu(caplog):
    if jax.default_backend() == "gpu":
        pytest.skip("the CPU fallback; test_cudnn_attention_in_the_step covers GPUs")
    common._attention_choice.cache_clear()
    with caplog.at_level("INFO", logger="models"):
        assert common.attention_implementation(jnp.bfloat16, 64) == "xla"
        assert common.attention_implementation("bfloat16", 64) == "xla"
    assert [r.getMessage() for r in caplog.records] == [
        "attention: XLA (no CUDA GPU of compute capability >= 8.0 (default device: cpu))"]  # once


@pytest.mark.gpu
@pytest.mark.parametrize("stock", [False, True])
def test_cudnn_attention_in_the_step(stock):
    """Both twins run cuDNN's fused attention, forward and backward, in bfloat16 on the GPU."""
    cfg = get_config("small", seq_len=128, n_layers=2)
    model = common.init("nnx", cfg, jax.random.key(0), stock=stock, abstract=True)
    batch = jax.ShapeDtypeStruct((2, cfg.seq_len), jnp.int32)
    hlo = jax.jit(jax.value_and_grad(model.loss)).trace(model.params, batch, batch).lower().as_text()
    assert len(re.findall(r"__cudnn\$fmhaSoftmax\b", hlo)) == cfg.n_layers
    assert len(re.findall(r"__cudnn\$fmhaSoftmaxBackward", hlo)) == cfg.n_layers


# --- lowered for CUDA ------------------------------------------------------------------------------

# deep24's blocks, three of them (a first, a middle and a last: every norm kind, and blocks that
# reuse the first one's kernels); more blocks would only repeat the middle one
DEEP = get_config("deep24", n_layers=3, seq_len=32)
DEEP_BATCH = jax.ShapeDtypeStruct((2, DEEP.seq_len), jnp.int32)


def train_step_hlo(model, batch) -> str:
    """The model's loss and gradients, lowered for CUDA (StableHLO text)."""
    return (jax.jit(jax.value_and_grad(model.loss)).trace(model.params, batch, batch)
            .lower(lowering_platforms=("cuda",)).as_text())


@pytest.fixture(scope="module")
def deep_train_steps():
    """Each framework's DEEP train step lowered for CUDA from an empty kernel cache, and the
    cache's statistics after all three. Lowered with backend 'cute', which raises where an op
    would fall back to its reference: every op of the step runs its kernels, so the step is the
    one backend 'auto' lowers too. The kernels stay cached until the module ends: the export
    lowers the same model again (on another worker this fixture builds them there)."""
    cl.clear_cache()
    jax.clear_caches()
    with cl.use_backend("cute"):
        hlos = {framework: train_step_hlo(common.init(framework, DEEP, jax.random.key(0), abstract=True), DEEP_BATCH)
                for framework in FRAMEWORKS}
    yield hlos, cl.cache_info()
    cl.clear_cache()


@pytest.mark.cute
def test_each_mlp_is_one_op_in_the_train_step(deep_train_steps):
    """Each block's fc1 -> gelu -> fc2 (+ residual) is one ``ops.mlp`` (lowered with backend
    'cute': no fallback anywhere): fc1's forward stores its pre-activation (a linear_fwd with two
    results), the hidden-gradient GEMM applies gelu's derivative in its epilogue (the linear_dx
    with three operands), and no GELU is left to XLA."""
    hlos, _ = deep_train_steps
    for framework, hlo in hlos.items():
        assert kernel_operand_counts(hlo, "linear_dx").count(3) == DEEP.n_layers, framework
        # (the LM head's exp GEMM has two results too: its second, the row sums, is float32)
        fc1_forwards = [line for line in hlo.splitlines()
                        if re.search(r"%\S+:2 = stablehlo\.custom_call @cutelayers_linear_fwd_", line)
                        and not line.rstrip().endswith("xf32>)")]
        assert len(fc1_forwards) == DEEP.n_layers, framework
        assert "tanh" not in hlo, framework


@pytest.mark.cute
def test_flax_head_gradient_is_its_float32_sum(deep_train_steps):
    """The Flax models hold float32 parameters and compute in bfloat16: the LM head's kernel
    gradient is the float32 sum its GEMMs add up over the token chunks, as it is -- no bfloat16
    copy of it, nor a float32 one of that. (The Equinox model casts its parameters to bfloat16
    before the forward pass, as Equinox's dtype rule asks: its gradient goes through that cast.)"""
    hlos, _ = deep_train_steps
    d, vocab = DEEP.d_model, DEEP.vocab_size
    for framework in ("nnx", "linen"):
        shape = f"{d}x{vocab}"  # the head's (H, V) kernel (the embedding table is (V, H))
        narrowed = re.findall(rf"stablehlo\.convert .*\(tensor<(?:1x)?{shape}xf32>\) -> tensor<(?:1x)?{shape}xbf16>",
                              hlos[framework])
        widened = re.findall(rf"stablehlo\.convert .*\(tensor<(?:1x)?{shape}xbf16>\) -> tensor<(?:1x)?{shape}xf32>",
                             hlos[framework])
        # the forward's cast of the float32 kernel for the GEMMs, and nothing after the sum
        assert (len(narrowed), len(widened)) == (1, 0), framework


def kernel_calls(hlo: str) -> list[str]:
    """FFI targets of the cutelayers custom calls, one entry per call."""
    return re.findall(r"stablehlo\.custom_call @(cutelayers_\w+?)\(", hlo)


def kernel_name(target: str) -> str:
    return re.sub(r"^cutelayers_|_[0-9a-f]{16}$", "", target)


@pytest.mark.cute
def test_deep24_blocks_compile_each_kernel_once(deep_train_steps):
    assert DEEP.dtype == "bfloat16"
    hlos, info = deep_train_steps
    targets: set[str] = set()
    for framework, hlo in hlos.items():  # the three lower to (mostly) the same kernels: shared cache
        assert "__cudnn$fmha" not in hlo  # no GPU here: XLA attention (cuDNN's cannot be lowered)
        calls = kernel_calls(hlo)
        per_name = Counter(map(kernel_name, calls))
        n, blocks = DEEP.n_layers, DEEP.n_layers
        # two LayerNorms per block + the final one, forward and backward; all but the first
        # add the pending sublayer output to the residual stream in their kernels
        assert per_name["layer_norm_fwd"] == per_name["layer_norm_bwd"] == 1, framework
        assert per_name["add_layer_norm_fwd"] == per_name["add_layer_norm_bwd"] == 2 * blocks, framework
        # three GEMMs per block (attn_out, the MLP's two) + the LM head's, and the qkv projection
        # as q, k, v planes (split_linear: no slice or concatenation): forward, dx, dkernel
        for name in ("linear_fwd", "linear_dx", "linear_dkernel"):
            assert per_name[name] >= 3 * n, (framework, name, per_name)
            assert per_name[f"split_{name}"] == n, (framework, name, per_name)
        # the head, (H, V) or Equinox's (V, H), takes the exp path: its GEMM sums exp(logits) (a
        # float32 second result) and no cross-entropy kernel runs
        assert not [name for name in per_name if name.startswith("cross_entropy")], per_name
        assert re.search(r"@cutelayers_linear_fwd_\w+\(.*-> \(tensor<[^>]*bf16>, tensor<[^>]*xf32>\)", hlo), framework
        # one norm kernel per direction and kind serves all the norms
        distinct = Counter(kernel_name(t) for t in set(calls))
        for name in ("layer_norm_fwd", "layer_norm_bwd", "add_layer_norm_fwd", "add_layer_norm_bwd"):
            assert distinct[name] == 1, (framework, name)
        # the other kernels: one per distinct projection shape, not per block (five projections'
        # forward, dx and dkernel GEMMs, the head's exp GEMM, the four norms')
        assert sum(distinct.values()) <= 21, (framework, distinct)
        targets |= set(calls)
    # every distinct kernel (name + static key) was built (compiled, or loaded from the run's disk
    # cache) exactly once, over all three frameworks and 3 x 3 blocks; every other use was a hit
    expected = Counter(kernel_name(t) for t in targets)
    assert {name: built(stats) for name, stats in info.items()} == dict(expected)
    assert sum(stats.memory_hits for stats in info.values()) > 0  # linen / equinox reused nnx's kernels


@pytest.mark.cute
def test_remat_dots_launches_no_gemm_again(deep_train_steps):
    """Lowered for CUDA with backend 'cute', the blocks under ``remat="dots"`` launch the forward
    GEMMs as often as without remat (their results kept: ``cutelayers.remat_policy``) and only
    the norms again; under ``remat="full"`` every block's qkv, attention-out and fc1 forward again."""
    hlos, _ = deep_train_steps
    counts = {"none": Counter(map(kernel_name, kernel_calls(hlos["nnx"])))}
    for remat in ("dots", "full"):
        model = common.init("nnx", dataclasses.replace(DEEP, remat=remat), jax.random.key(0), abstract=True)
        with cl.use_backend("cute"):
            counts[remat] = Counter(map(kernel_name, kernel_calls(train_step_hlo(model, DEEP_BATCH))))
    n = DEEP.n_layers
    gemms = ("linear_fwd", "split_linear_fwd")
    assert [counts["dots"][g] for g in gemms] == [counts["none"][g] for g in gemms], counts
    assert counts["full"]["split_linear_fwd"] == 2 * n and counts["full"]["linear_fwd"] == counts["none"]["linear_fwd"] + 2 * n
    for remat in ("dots", "full"):  # each block's two norms again (the final one is outside the blocks)
        assert counts[remat]["add_layer_norm_fwd"] + counts[remat]["layer_norm_fwd"] == (
            counts["none"]["add_layer_norm_fwd"] + counts["none"]["layer_norm_fwd"] + 2 * n), counts
        for name in ("linear_dx", "linear_dkernel", "add_layer_norm_bwd"):
            assert counts[remat][name] == counts["none"][name], (remat, name)


@pytest.mark.cute
def test_llama_design_runs_its_kernels():
    """The llama design's train step, lowered for CUDA with backend 'cute' (no fallback anywhere):
    RMSNorm kernels, the residual add fused into all but the first, each SwiGLU MLP one op (its
    hidden gradient through silu' in a GEMM epilogue: a linear_dx with three operands; no sigmoid
    left to XLA)."""
    cfg = dataclasses.replace(DEEP, **DESIGNS["llama"])
    with cl.use_backend("cute"):
        hlo = train_step_hlo(common.init("nnx", cfg, jax.random.key(0), abstract=True), DEEP_BATCH)
    per_name = Counter(map(kernel_name, kernel_calls(hlo)))
    assert per_name["rms_norm_fwd"] == per_name["rms_norm_bwd"] == 1, per_name
    assert per_name["add_rms_norm_fwd"] == per_name["add_rms_norm_bwd"] == 2 * cfg.n_layers, per_name
    assert not [name for name in per_name if "layer_norm" in name], per_name
    assert kernel_operand_counts(hlo, "linear_dx").count(3) == cfg.n_layers
    assert "logistic" not in hlo and "cosine" in hlo  # silu in the kernels; the rotary angles XLA's


@pytest.mark.cute
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_tied_head_reads_the_table_as_stored(framework):
    """With tied embeddings the head's GEMMs read the (vocab, d) token table as stored -- no
    transposed copy -- on the exp path (lowered with backend 'cute': no fallback)."""
    cfg = dataclasses.replace(DEEP, n_layers=1, tie_embeddings=True)
    with cl.use_backend("cute"):
        hlo = train_step_hlo(common.init(framework, cfg, jax.random.key(0), abstract=True), DEEP_BATCH)
    d, vocab = cfg.d_model, cfg.vocab_size
    assert re.search(r"@cutelayers_linear_fwd_\w+\(.*-> \(tensor<[^>]*bf16>, tensor<[^>]*xf32>\)", hlo)
    assert not [name for name in map(kernel_name, kernel_calls(hlo)) if name.startswith("cross_entropy")]
    assert not re.search(rf"stablehlo\.transpose .*-> tensor<(?:1x)?{d}x{vocab}x", hlo)


@pytest.mark.cute
def test_export_of_a_model(deep_train_steps):
    """The NNX model's train step exported with cl.aot (flat parameter leaves: nnx's State types
    have no serializer), bundled with its kernels and read back. The kernels are the ones the
    fixture built for the same step: exporting builds none."""
    _, info = deep_train_steps
    fun = common.init("nnx", DEEP, jax.random.key(0), abstract=True)
    leaves, treedef = jax.tree.flatten(fun.params)

    def train_step_math(leaves, inputs, targets):
        loss, grads = jax.value_and_grad(fun.loss)(treedef.unflatten(leaves), inputs, targets)
        return loss, jax.tree.leaves(grads)

    exported = cl.aot.export(train_step_math, leaves, DEEP_BATCH, DEEP_BATCH)
    targets = cl.aot.kernel_targets(str(exported.mlir_module()))
    assert len(targets) >= 6 and all(t.startswith("cutelayers_") for t in targets)
    again = cl.aot.deserialize(cl.aot.serialize(exported))
    assert again.in_avals == exported.in_avals and again.out_avals == exported.out_avals
    assert {n: built(s) for n, s in cl.cache_info().items()} == {n: built(s) for n, s in info.items()}
