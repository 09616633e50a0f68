"""The kernel-call primitive: one JAX primitive for every CuTe kernel.

Abstract evaluation comes from the kernel family's output contract. Lowering is per platform:

* ``cuda``: compile the family's ``@cute.jit`` launcher once per compile key (see
  :mod:`cutelayers.runtime.cache`), register it as an XLA FFI target through TVM-FFI
  (``jax_tvm_ffi.register_ffi_target``) and emit a custom call to it -- unless the backend says to
  run the reference;
* any other platform: the family's jnp reference, lowered with ``mlir.lower_fun``.

Only compiling imports the CuTe DSL and TVM-FFI (the ``cute`` extra); without them every platform
lowers the reference (:func:`cute_dsl_missing` says why).

Why TVM-FFI rather than ``cutlass.jax.cutlass_call``: the TVM-FFI function takes XLA's buffers and
stream directly (no per-call Python, no extra descriptor marshalling), is CUDA-graph capturable, and
lets us compile with our own fake tensors (symbolic row count, 16-byte alignment) and our own
compile-once cache, whose statistics we report.

The raw primitive has no JVP, transpose or batching rule on purpose: differentiation and vmap
belong to the ops (``custom_vjp``, and :mod:`cutelayers.ops._batching`'s vmap rule), which pick
the right backward kernels and fold batch dims into rows.

Ops call kernels through :func:`cutelayers.runtime.sharding.kernel_call`, which binds this
primitive per device by the family's sharding rule; this module knows nothing of sharding.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import hashlib
import importlib.metadata
import importlib.util
import os
import secrets
import sys
import tempfile
import threading
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from cutelayers import backend as _backend
from cutelayers.runtime import disk_cache, placement
from cutelayers.runtime._jax_compat import apply_primitive
from cutelayers.runtime.cache import COMPILE_CACHE
from cutelayers.runtime.family import KernelFamily
from cutelayers.runtime.tensors import fake_tensor

LIBRARIES = ("cutelayers", "nvidia-cutlass-dsl", "jax", "apache-tvm-ffi")  # whose versions key kernels


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "none"


@functools.cache
def library_versions() -> tuple[str, ...]:
    """The versions of :data:`LIBRARIES`, in that order; part of every compile key."""
    return tuple(_version(dist) for dist in LIBRARIES)


def target_arch() -> tuple[str | None, str]:
    """The GPU architecture kernels are built for, and where that answer came from.

    A visible CUDA device decides; without one, ``CUTE_DSL_ARCH`` (e.g. ``sm_90a``) allows
    compiling for a GPU this machine does not have.
    """
    import os

    try:
        gpus = jax.devices("cuda")
    except RuntimeError:
        gpus = []
    if gpus:
        cc = getattr(gpus[0], "compute_capability", None)
        if cc:
            major, minor = str(cc).split(".")
            return f"sm_{major}{minor}{'a' if major == '9' else ''}", f"{gpus[0].device_kind}, compute capability {cc}"
    arch = os.environ.get("CUTE_DSL_ARCH")
    if arch:
        return arch, f"no CUDA device visible; CUTE_DSL_ARCH={arch}"
    return None, "no CUDA device visible and CUTE_DSL_ARCH unset"


HOPPER_ARCHS = ("sm_90a", "sm_90")  # what the kernels are built for (wgmma, TMA, clusters)


def kernels_supported(arch: str | None) -> bool:
    """Whether kernels built for ``arch`` (from :func:`target_arch`) can run: Hopper."""
    return arch in HOPPER_ARCHS


# What building and calling kernels imports, by module, and the distribution that brings it: the
# ``cute`` extra (a plain install runs the jnp references only).
CUTE_PACKAGES = {"cutlass": "nvidia-cutlass-dsl", "tvm_ffi": "apache-tvm-ffi", "jax_tvm_ffi": "jax-tvm-ffi"}


TVM_FFI_TORCH_VARIABLE = "CUTELAYERS_TVM_FFI_TORCH"


@functools.cache
def import_tvm_ffi() -> None:
    """Import TVM-FFI (how compiled kernels are called) before anything else does, keeping it from
    importing PyTorch. ``tvm_ffi`` imports torch at import time, where it is installed, to exchange
    torch tensors -- which this library never passes; that import cost 7-10 s in every process that
    built or loaded a kernel (compile workers too) on an H100 host with torch installed, most of a
    train step's cold compile. Called first by every path that compiles, loads or registers a
    kernel. Torch already imported, or ``CUTELAYERS_TVM_FFI_TORCH=1``: the plain import, torch
    interop included (set it to pass torch tensors to TVM-FFI functions in the same process)."""
    if "tvm_ffi" in sys.modules or "torch" in sys.modules or os.environ.get(TVM_FFI_TORCH_VARIABLE) == "1":
        import tvm_ffi
        return
    sys.modules["torch"] = None  # makes `import torch` raise ImportError, which tvm_ffi handles
    try:
        import tvm_ffi  # noqa: F401
    finally:
        if "torch" in sys.modules and sys.modules["torch"] is None:
            del sys.modules["torch"]  # torch stays importable by everyone else


@functools.cache
def cute_dsl_missing() -> str | None:
    """Why this environment cannot build CuTe kernels (the ``cute`` extra's packages that are not
    installed), or None when it can. Looks the modules up without importing them."""
    missing = [dist for module, dist in CUTE_PACKAGES.items() if importlib.util.find_spec(module) is None]
    if not missing:
        return None
    return (f"the CuTe DSL is not installed ({', '.join(missing)} missing); the kernels need the 'cute' extra: "
            "pip install 'cutelayers[cute]'")


def choose_path(op: str) -> str:
    """``"cute"`` or ``"reference"`` for a call lowered for CUDA, per the backend rules."""
    choice = _backend.current_backend()
    if choice == "reference":
        _backend.log_once("reference", "CUTELAYERS_BACKEND/use_backend says 'reference'")
        return "reference"
    missing = cute_dsl_missing()
    if missing:
        _backend.fall_back(op, missing)
        return "reference"
    arch, why = target_arch()
    if kernels_supported(arch):
        _backend.log_once("CuTe kernel", f"{why}")
        return "cute"
    _backend.fall_back(op, f"this call needs a Hopper GPU (compute capability 9.x) and the target is "
                           f"{arch or 'unknown'} ({why}); CUTE_DSL_ARCH=sm_90a compiles for a GPU this machine "
                           "does not have")
    return "reference"


@dataclasses.dataclass(eq=False)
class CompiledKernel:
    """A kernel ready to call: the XLA FFI target it is registered under and its TVM-FFI function.

    ``owner`` keeps the loaded code alive; ``object_bytes()`` gives the kernel as a relocatable
    object (what the disk cache and exported bundles store).
    """

    target: str
    function: Any
    graph_safe: bool
    owner: Any
    _object: bytes | None = None

    def object_bytes(self) -> bytes:
        """The kernel's relocatable object (what the disk cache and an export bundle store)."""
        if self._object is None:
            self._object = disk_cache.object_bytes(self.owner)
        return self._object


_REGISTERED: dict[str, CompiledKernel] = {}  # FFI target -> kernel; XLA registrations are for life
_REGISTER_LOCK = threading.Lock()


def register_kernel(kernel: CompiledKernel) -> None:
    """Register ``kernel`` as an XLA FFI target (once per target name per process)."""
    import_tvm_ffi()
    import jax_tvm_ffi

    with _REGISTER_LOCK:
        if kernel.target in _REGISTERED:
            return
        jax_tvm_ffi.register_ffi_target(
            kernel.target, kernel.function, ["args", "rets"], platform="gpu", allow_cuda_graph=kernel.graph_safe
        )
        _REGISTERED[kernel.target] = kernel


def registered_kernel(target: str) -> CompiledKernel | None:
    """The kernel registered under FFI target ``target`` in this process, if any."""
    return _REGISTERED.get(target)


@dataclasses.dataclass(frozen=True)
class CompileJob:
    """One kernel to build: its family, the shapes and dtypes of its operands and results (as
    ``jax.ShapeDtypeStruct``: all a family's hooks read, and picklable), the FFI target it is
    registered under and its disk cache entry (None: not stored)."""

    family: KernelFamily
    avals: tuple[jax.ShapeDtypeStruct, ...]
    out_avals: tuple[jax.ShapeDtypeStruct, ...]
    target: str
    entry: disk_cache.DiskEntry | None

    @property
    def name(self) -> str:
        """The kernel family's name."""
        return self.family.name


def _shapes(avals) -> tuple[jax.ShapeDtypeStruct, ...]:
    return tuple(jax.ShapeDtypeStruct(tuple(a.shape), a.dtype) for a in avals)


def build_launcher(family: KernelFamily, avals, out_avals):
    """Compile ``family``'s launcher against fake tensors: the CuTe DSL compiled function, neither
    stored nor registered. The build step of every compile, in this process (:func:`compile_kernel`)
    or in a compile worker (:mod:`cutelayers.runtime.parallel_compile`)."""
    import_tvm_ffi()
    from cutlass import cute
    from cutlass.cute.runtime import make_fake_stream

    from cutelayers.runtime.launch import call_launcher

    symbols: dict[int, Any] = {}
    every = (*avals, *out_avals)
    # Fake tensors as XLA stores the buffers (what TVM-FFI checks at each call); the launch shim
    # applies mode orders, drops outputs written in place and passes compile-time keywords.
    fakes = [fake_tensor(a.dtype, a.shape, family.dynamic_dims_at(i, a), symbols) for i, a in enumerate(every)]
    plan = (
        tuple(family.modes_at(i) for i in range(len(every))),
        len(avals),
        family.kept_outputs(len(out_avals)),
        family.constexpr_items(),
    )
    return cute.compile(
        call_launcher,
        make_fake_stream(use_tvm_ffi_env_stream=True),  # XLA's stream, passed through TVM-FFI
        *fakes,
        launcher=family.launcher(avals, out_avals),
        plan=plan,
        options="--enable-tvm-ffi",
    )


def compile_kernel(job: CompileJob) -> CompiledKernel:
    """Build ``job``'s kernel in this process, store it on disk, register it."""
    compiled = build_launcher(job.family, job.avals, job.out_avals)
    function = compiled.__tvm_ffi_object__() if hasattr(compiled, "__tvm_ffi_object__") else compiled
    kernel = CompiledKernel(job.target, function, job.family.graph_safe, owner=compiled)
    if job.entry is not None:
        job.entry.store(kernel.object_bytes())
    register_kernel(kernel)
    return kernel


def kernel_from_object(target: str, data: bytes, graph_safe: bool) -> CompiledKernel:
    """A kernel from its relocatable object (:func:`disk_cache.object_bytes`: a compile worker's
    result, an exported bundle's kernel), loaded and registered under ``target``."""
    import_tvm_ffi()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.o"
        path.write_bytes(data)
        function = disk_cache.load_object(path)  # reads the file whole; the engine keeps the code
    kernel = CompiledKernel(target, function, graph_safe, owner=function, _object=data)
    register_kernel(kernel)
    return kernel


def _load(entry, target: str, graph_safe: bool) -> CompiledKernel | None:
    """The kernel from its disk cache entry (registered), or None if the entry is absent/invalid."""
    import_tvm_ffi()
    loaded = entry.load()
    if loaded is None:
        return None
    function, data = loaded
    kernel = CompiledKernel(target, function, graph_safe, owner=function, _object=data)
    register_kernel(kernel)
    return kernel


def static_key(family: KernelFamily, avals, out_avals) -> Hashable:
    """Everything that decides a recompile: the family's identity, dtypes, static dims, which
    dynamic dims are equal (they share one symbol). Never the dynamic sizes themselves."""
    classes: dict[int, int] = {}

    def describe(position, a):
        dyn = family.dynamic_dims_at(position, a)
        dims = tuple(("dyn", classes.setdefault(s, len(classes))) if d else s for s, d in zip(a.shape, dyn))
        return (jnp.dtype(a.dtype).name, dims)

    every = (*avals, *out_avals)
    return (family.identity(), tuple(describe(i, a) for i, a in enumerate(every)))


# The compile session of :func:`cutelayers.runtime.parallel_compile.parallel_compiles` in force
# here, or None: compile now. A context variable, so a session covers the code inside its block
# only (another thread lowering meanwhile compiles as usual). Its ``submit(key, job)`` returns
# a placeholder kernel (its ``target`` known before the compile) and ``track(kernel)`` notes any
# placeholder a lowering used, to be finished before the block ends.
COMPILE_SESSION: contextvars.ContextVar[Any] = contextvars.ContextVar("cutelayers_compile_session", default=None)


def ffi_target_for(family: KernelFamily, avals, out_avals) -> str:
    """The FFI target name of the compiled kernel for these avals: from this process's cache, else
    from the disk cache, else compiled (once) -- or, inside ``parallel_compiles``, submitted to
    compile while lowering goes on (the name does not depend on the compile)."""
    arch, _ = target_arch()
    key = (static_key(family, avals, out_avals), arch, library_versions())
    key_text = disk_cache.stable_key_text((key, disk_cache.source_digest(family.source_files())))
    # A stable key names its target by content (the same name in every process, which exported
    # modules rely on); an unstable one (a user launcher without compile_key) gets a random name,
    # which no other process's kernel has: a bundle's and the loader's own kernels never collide.
    digest = hashlib.sha256(key_text.encode()).hexdigest() if key_text else secrets.token_hex(8)
    target = f"cutelayers_{family.name}_{digest[:16]}"
    entry = disk_cache.entry_for(key_text)
    job = CompileJob(family, _shapes(avals), _shapes(out_avals), target, entry)
    session = COMPILE_SESSION.get()
    kernel = COMPILE_CACHE.get_or_compile(
        family.name,
        key,
        compile=lambda: compile_kernel(job),
        load=(lambda: _load(entry, target, family.graph_safe)) if entry is not None else None,
        defer=(lambda: session.submit(key, job)) if session is not None else None,
    )
    if session is not None:
        session.track(kernel)
    return kernel.target


# --- the primitive -------------------------------------------------------------------------------

kernel_call_p = Primitive("cutelayers_kernel_call")
kernel_call_p.multiple_results = True
kernel_call_p.def_impl(functools.partial(apply_primitive, kernel_call_p))


@kernel_call_p.def_abstract_eval
def _abstract_eval(*avals, family: KernelFamily):
    # Inside shard_map, results vary over the same manual mesh axes as the row operand (always
    # first): `update` carries that type over, whatever this JAX version calls it.
    row = avals[0]
    return [
        row.update(shape=o.shape, dtype=o.dtype, weak_type=False,
                   sharding=row.sharding.update(spec=jax.sharding.PartitionSpec(*[None] * len(o.shape))))
        for o in family.out_avals(avals)
    ]


def _reference_lowering(ctx, *args, family: KernelFamily):
    return mlir.lower_fun(lambda *a: tuple(family.reference(*a)), multiple_results=True)(ctx, *args)


def _cuda_lowering(ctx, *args, family: KernelFamily):
    if choose_path(family.name) == "reference":
        return _reference_lowering(ctx, *args, family=family)
    placement.check_lowering_context(ctx, family.name, family.arg_names)
    target = ffi_target_for(family, ctx.avals_in, ctx.avals_out)
    aliases = family.operand_output_aliases()
    lowering = jax.ffi.ffi_lowering(target, **({"operand_output_aliases": aliases} if aliases else {}))
    return lowering(ctx, *args)


def _other_platform_lowering(ctx, *args, family: KernelFamily):
    platforms = ", ".join(ctx.module_context.platforms)
    # A missing CuTe DSL first: what the install lacks, wherever the call runs.
    _backend.fall_back(family.name, cute_dsl_missing()
                       or f"it is lowered for {platforms} and CuTe kernels run only on CUDA")
    return _reference_lowering(ctx, *args, family=family)


mlir.register_lowering(kernel_call_p, _other_platform_lowering)
mlir.register_lowering(kernel_call_p, _cuda_lowering, platform="cuda")


def _no_transform(kind: str):
    def rule(*args, family: KernelFamily, **kwargs):
        raise NotImplementedError(
            f"{kind} of the kernel call {family.name!r} is not defined. The cutelayers ops that wrap "
            "kernel calls carry jax.custom_vjp and vmap rules: they take first-order reverse-mode "
            "gradients (jax.grad, jax.vjp) and vmap, not a gradient's own gradient (jax.hessian, "
            "grad of grad) nor forward mode. A raw cutelayers.cute_call callable takes neither: "
            "cutelayers.custom_op gives it a custom_vjp and the vmap rule."
        )

    return rule


ad.primitive_jvps[kernel_call_p] = _no_transform("JVP (differentiation)")
ad.primitive_transposes[kernel_call_p] = _no_transform("Transposition")
batching.primitive_batchers[kernel_call_p] = _no_transform("Batching (vmap)")
