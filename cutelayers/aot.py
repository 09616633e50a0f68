"""Ahead-of-time export of functions that use cutelayers kernels.

``jax.export`` serializes a function's StableHLO, in which each CuTe kernel is a custom call to an
XLA FFI target (``cutelayers_<kernel>_<digest>``). The compiled kernels themselves live in the
exporting process; a *bundle* carries them along:

* ``exported.jax`` -- ``jax.export.Exported.serialize()`` of the function;
* ``kernels/<target>.o`` -- each kernel's relocatable object (sm_90a code plus its TVM-FFI entry);
* ``manifest.json`` -- format, GPU arch, versions of the libraries the objects were built with, and
  each object's SHA-256.

:func:`deserialize` checks the manifest and hashes, loads every object and registers it under its
target name, then returns the ``Exported``: no CuTe DSL compile happens in the loading process.
That process needs jax (able to read the serialization), jax-tvm-ffi, and the *same*
nvidia-cutlass-dsl and apache-tvm-ffi versions (the objects link against their runtime libraries),
and a GPU of the recorded arch to run the CUDA code.

    exported = cutelayers.aot.export(model_fn, x_spec)
    blob = cutelayers.aot.serialize(exported)
    ...                                       # another process, same library versions
    exported = cutelayers.aot.deserialize(blob)
    y = exported.call(x)
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import zipfile
from collections.abc import Callable, Sequence

import jax
from jax import export as jax_export

from cutelayers.runtime.primitive import (
    LIBRARIES,
    kernel_from_object,
    library_versions,
    registered_kernel,
    target_arch,
)

__all__ = ["deserialize", "export", "kernel_targets", "serialize"]

BUNDLE_FORMAT = 1
_TARGET_NAME = re.compile(r"cutelayers_\w+")
_TARGET = re.compile(rf"custom_call @({_TARGET_NAME.pattern})")
# Versions the object files depend on at load time (cutelayers and jax do not enter the code).
_ABI_LIBRARIES = ("nvidia-cutlass-dsl", "apache-tvm-ffi")


def kernel_targets(module_text: str) -> list[str]:
    """The cutelayers FFI targets a StableHLO module calls, in first-use order."""
    return list(dict.fromkeys(_TARGET.findall(module_text)))


def export(fun: Callable, *args, platforms: Sequence[str] = ("cuda",), **export_kwargs) -> jax_export.Exported:
    """``jax.export.export`` of ``fun`` at ``args`` (arrays or ``jax.ShapeDtypeStruct``) that
    allows cutelayers' custom calls: their stability is ours to guarantee, through the bundle's
    version check, not XLA's list of stable targets."""
    if isinstance(platforms, str) or not all(isinstance(p, str) for p in platforms):
        raise TypeError(f"export: platforms={platforms!r}; expected a sequence of platform names, e.g. "
                        "('cuda',) or ('cuda', 'cpu')")
    jitted = fun if hasattr(fun, "trace") else jax.jit(fun)
    text = jitted.trace(*args).lower(lowering_platforms=tuple(platforms)).as_text()
    checks = [jax_export.DisabledSafetyCheck.custom_call(t) for t in kernel_targets(text)]
    checks += list(export_kwargs.pop("disabled_checks", ()))
    return jax_export.export(jitted, platforms=tuple(platforms), disabled_checks=checks, **export_kwargs)(*args)


def _manifest(targets: list[str], objects: dict[str, bytes]) -> dict:
    return {
        "format": BUNDLE_FORMAT,
        "arch": target_arch()[0],
        "versions": dict(zip(LIBRARIES, library_versions())),
        "kernels": [{"target": t, "sha256": hashlib.sha256(objects[t]).hexdigest(),
                     "graph_safe": registered_kernel(t).graph_safe} for t in targets],
    }


def serialize(exported: jax_export.Exported) -> bytes:
    """A bundle (zip bytes) of ``exported`` and the object code of every kernel it calls."""
    targets = kernel_targets(str(exported.mlir_module()))
    missing = [t for t in targets if registered_kernel(t) is None]
    if missing:
        raise ValueError(f"serialize: the export calls kernels not compiled in this process: {missing}; "
                         "export and serialize in the same process")
    objects = {t: registered_kernel(t).object_bytes() for t in targets}
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as bundle:
        bundle.writestr("manifest.json", json.dumps(_manifest(targets, objects), indent=1))
        bundle.writestr("exported.jax", bytes(exported.serialize()))
        for target, data in objects.items():
            bundle.writestr(f"kernels/{target}.o", data)
    return buffer.getvalue()


def _check_manifest(manifest) -> None:
    """Refuse a manifest not written by :func:`serialize` (its fields' types), or one whose kernels
    this environment cannot load (library versions) or run (GPU arch)."""
    kernels = manifest.get("kernels") if isinstance(manifest, dict) else None
    well_formed = (
        isinstance(kernels, list) and isinstance(manifest.get("versions"), dict)
        and isinstance(manifest.get("arch"), (str, type(None)))
        and all(isinstance(k, dict) and isinstance(k.get("target"), str) and _TARGET_NAME.fullmatch(k["target"])
                and isinstance(k.get("sha256"), str) and isinstance(k.get("graph_safe"), bool) for k in kernels)
    )
    if not well_formed:
        raise ValueError("deserialize: not a valid cutelayers bundle (its manifest.json lacks or mistypes "
                         "'versions', 'arch' or a kernel's 'target', 'sha256' or 'graph_safe')")
    if manifest.get("format") != BUNDLE_FORMAT:
        raise ValueError(f"deserialize: bundle format {manifest.get('format')!r}; this cutelayers reads "
                         f"format {BUNDLE_FORMAT}")
    here = dict(zip(LIBRARIES, library_versions()))
    for library in _ABI_LIBRARIES:
        built = manifest["versions"].get(library)
        if built != here[library]:
            raise ValueError(f"deserialize: the bundle's kernels were built with {library} {built}, this "
                             f"environment has {here[library]}; install {library}=={built} to load them")
    arch, where = target_arch()
    on_a_gpu = not where.startswith("no CUDA device")  # else loading is fine; running needs a GPU
    if on_a_gpu and arch != manifest["arch"]:
        raise ValueError(f"deserialize: the bundle's kernels are built for {manifest['arch']}, this GPU is "
                         f"{arch} ({where})")


def deserialize(data: bytes) -> jax_export.Exported:
    """Load a bundle from :func:`serialize`: check it, register its kernels, return the Exported."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as bundle:
            manifest = json.loads(bundle.read("manifest.json"))
            _check_manifest(manifest)
            exported = bundle.read("exported.jax")
            objects = {k["target"]: bundle.read(f"kernels/{k['target']}.o") for k in manifest["kernels"]}
    except (zipfile.BadZipFile, KeyError, UnicodeDecodeError, json.JSONDecodeError, zipfile.LargeZipFile) as error:
        raise ValueError(f"deserialize: not a valid cutelayers bundle ({type(error).__name__}: {error})") from None
    try:
        module = jax_export.deserialize(bytearray(exported))
    except Exception as error:  # noqa: BLE001 -- jax reports a damaged one from deep inside (struct.error, ...)
        raise ValueError(f"deserialize: the bundle's exported.jax is not a jax.export serialization this jax "
                         f"reads ({type(error).__name__}: {error})") from None
    missing = [t for t in kernel_targets(str(module.mlir_module())) if t not in objects and registered_kernel(t) is None]
    if missing:
        raise ValueError(f"deserialize: the bundle's function calls kernels the bundle does not carry: {missing}")
    for record in manifest["kernels"]:
        target, payload = record["target"], objects[record["target"]]
        if hashlib.sha256(payload).hexdigest() != record["sha256"]:
            raise ValueError(f"deserialize: the object of kernel {target} does not match its hash")
        if registered_kernel(target) is None:  # else the same content-named kernel is already live here
            kernel_from_object(target, payload, record["graph_safe"])
    return module
