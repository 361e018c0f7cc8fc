"""Lowering a jitted call for an NVIDIA H100 on a machine without one: JAX lowers Pallas' Triton kernels to Triton IR
itself (`jax.sharding.AbstractDevice` names the GPU the kernel is lowered for), so a kernel that Pallas cannot lower
for a GPU — a load of a length that is not a power of two, an unsupported primitive, a block that does not fit its
array — fails on CPU, before any GPU time is spent. What this does not cover: Triton's own compile to PTX and XLA's
GPU compile (both run only on a GPU), and the kernel's speed."""

from __future__ import annotations

import re

import jax

H100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="cuda")


def dispatch_as_on_a_gpu(monkeypatch) -> None:
    """The dispatchers' fail-closed rule (`kernels._use_kernel`) as on a GPU: impl "auto" takes a kernel wherever
    its shapes are supported."""
    from hyspec_jax import kernels
    monkeypatch.setattr(kernels, "gpu_kernels_available", lambda: True)


def lower_for_h100(fn, *args, **kwargs) -> str:
    """The StableHLO text of `jax.jit(fn)(*args, **kwargs)` lowered for one H100 (args may be
    `jax.ShapeDtypeStruct`s: nothing is allocated)."""
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=H100)
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.jit(fn).trace(*args, **kwargs).lower(lowering_platforms=("cuda",)).as_text()


def triton_kernels(text: str) -> list[str]:
    """The backend config (the kernel's serialized Triton IR, grid and launch settings) of each Triton kernel call in
    a lowered module's text, in order: calls with equal configs run the same kernel."""
    out, key = [], "mhlo.backend_config = {"
    for start in (m.end() for m in re.finditer(r"custom_call @__gpu\$xla\.gpu\.triton\(", text)):
        i = text.index(key, start) + len(key)
        j, depth, quoted = i, 1, False
        while depth:
            c = text[j]
            if quoted and c == "\\":
                j += 1                     # an escaped character inside a string
            elif c == '"':
                quoted = not quoted
            elif not quoted:
                depth += (c == "{") - (c == "}")
            j += 1
        out.append(text[i:j - 1])
    return out


def calls_of_the_kernels_function(text: str, name: str | None = None) -> int:
    """How often the module calls the function that holds its first Triton kernel call (of the kernel called `name`,
    when given): a jitted kernel entry that JAX lowered once and every caller shares."""
    at = text.index("custom_call @__gpu$xla.gpu.triton")
    if name is not None:
        at = text.index(f'name = "{name}"')
    holder = re.findall(r"func\.func private @(\S+?)\(", text[:at])[-1]
    return text.count(f"call @{holder}(")
