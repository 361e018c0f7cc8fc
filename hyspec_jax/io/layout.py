"""The one home of the mapping between module parameters and checkpoint tensors (target, MTP head, drafter).

A parameter is stored under its own path, except the fused ones, each assembled on load from several on-disk
tensors (its `Part`s) and split back into them on save, byte for byte:

- an `MLP`'s `gate_up_proj.weight` [2I, H] (rows interleaved, `layers.gate_up`) <- `gate_proj.weight`,
  `up_proj.weight` [I, H] (the dense MLP, the shared expert, the MTP head's and the drafter's MLP);
- a `GatedDeltaNet`'s `in_proj.weight` [HK·G, H] (rows grouped by key head, `gdn.key_head_groups`) <- the
  checkpoint's own layout (`TargetConfig.projection_layout`; what each tensor holds: `layers.IN_PROJ_TENSORS`,
  which the module's seeded init follows too): "split" (Qwen3.5: `in_proj_qkv` [q | k | v, each head-major],
  `in_proj_z`, `in_proj_b`, `in_proj_a`) or "interleaved" (Qwen3-Next: `in_proj_qkvz` per group
  [q_g | k_g | v_g | z_g], `in_proj_ba` per group [b_g | a_g]); saved back in that layout;
- routed `Experts`' `gate_up_proj` [E, 2I, H] (gate rows first) and `down_proj` [E, H, I] <- per expert
  `experts.{e}.gate_proj.weight` / `up_proj` / `down_proj` (as transformers' save_pretrained writes them); a
  checkpoint may also hold these two fused under their own names (transformers' in-memory form), read as is.

A `Part` gives matching views (on-disk tensor side, parameter side): loading copies one way (converting to the
model dtype in the copy), saving the other. The row maps of the MLP and GDN parts apply to any trailing
dimensions, so a LoRA factor B [out, r] of a fused weight splits into its parts' factors the same way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import numpy as np
from flax import nnx

from hyspec_jax.gdn import key_head_groups
from hyspec_jax.models.layers import IN_PROJ_TENSORS, MLP, Experts, GatedDeltaNet, gate_up, in_proj_tensor_parts

Views = Callable[[np.ndarray, np.ndarray], list[tuple[np.ndarray, np.ndarray]]]


@dataclasses.dataclass(frozen=True)
class Part:
    """One on-disk tensor of a fused parameter: its name (relative to the module, like the parameter's), its
    shape, and `views(tensor, param)` -> pairs of equal-shape views (tensor side, parameter side)."""
    key: str
    shape: tuple[int, ...]
    views: Views
    rows: bool = False          # a map of rows only (any trailing dims): a LoRA factor B splits by it too


@dataclasses.dataclass(frozen=True)
class Fused:
    """A parameter assembled from `parts`; `stored_whole`: a checkpoint may hold it under its own name too."""
    name: str
    shape: tuple[int, ...]
    parts: tuple[Part, ...]
    stored_whole: bool = False


def _mlp(prefix: str, m: MLP) -> list[Fused]:
    two_i, H = m.gate_up_proj.weight.shape

    def part(i: int, proj: str) -> Part:
        return Part(f"{prefix}{proj}_proj.weight", (two_i // 2, H), lambda t, p: [(t, gate_up(p, 0)[i])], rows=True)
    return [Fused(f"{prefix}gate_up_proj.weight", (two_i, H), (part(0, "gate"), part(1, "up")))]


def _gdn(prefix: str, g: GatedDeltaNet) -> list[Fused]:
    rows, H = g.in_proj.weight.shape
    widths, hk = g.in_proj_widths, g.hk

    def part(name: str, names: tuple[str, ...]) -> Part:
        def views(tensor, param):
            t = in_proj_tensor_parts(tensor, g.layout, name, widths, hk)
            p = key_head_groups(param, widths, hk, 0)
            return [(t[x], p[x]) for x in names]
        return Part(f"{prefix}{name}.weight", (hk * sum(widths[x] for x in names), H), views, rows=True)
    return [Fused(f"{prefix}in_proj.weight", (rows, H),
                  tuple(part(name, names) for name, names in IN_PROJ_TENSORS[g.layout].items()))]


def _experts(prefix: str, x: Experts) -> list[Fused]:
    E, two_i, H = x.gate_up_proj.shape
    I = two_i // 2
    _, _, I_down = x.down_proj.shape

    def one(e: int, proj: str) -> Part:
        shape = (H, I_down) if proj == "down" else (I, H)
        view = {"gate": lambda p: p[e, :I], "up": lambda p: p[e, I:], "down": lambda p: p[e]}[proj]
        return Part(f"{prefix}{e}.{proj}_proj.weight", shape, lambda t, p: [(t, view(p))])
    return [Fused(f"{prefix}gate_up_proj", (E, two_i, H), tuple(one(e, p) for e in range(E) for p in ("gate", "up")),
                  stored_whole=True),
            Fused(f"{prefix}down_proj", (E, H, I_down), tuple(one(e, "down") for e in range(E)), stored_whole=True)]


_FUSERS = {MLP: _mlp, GatedDeltaNet: _gdn, Experts: _experts}     # module class -> its fused parameters


def fused_params(module: nnx.Module) -> dict[str, Fused]:
    """The fused parameters of `module` (and its submodules) by dotted parameter path, as `hf.flat_params`
    names them."""
    out: dict[str, Fused] = {}
    for path, node in nnx.iter_graph(module):
        fuser = _FUSERS.get(type(node))
        for f in fuser("".join(f"{p}." for p in path), node) if fuser else ():
            out[f.name] = f
    return out


def scatter(part: Part, tensor: np.ndarray, param: np.ndarray, *, add: bool = False) -> None:
    """Copy an on-disk tensor into its place in the fused parameter array (cast to its dtype in the copy), or
    with `add` add it there (a LoRA update of that tensor)."""
    for t, p in part.views(tensor, param):
        assert np.shares_memory(p, param), part.key      # a view, not a copy (param must be C-contiguous)
        if add:
            p += t
        else:
            p[...] = t


def gather(part: Part, param: np.ndarray) -> np.ndarray:
    """The on-disk tensor of `part` from the fused parameter array — or, for a row part, from any array whose
    rows are the parameter's (a LoRA factor B [out, r])."""
    shape = (part.shape[0], *param.shape[1:]) if part.rows else part.shape
    out = np.empty(shape, param.dtype)
    for t, p in part.views(out, param):
        assert np.shares_memory(t, out), part.key
        t[...] = p
    return out


def disk_tensors(module: nnx.Module, arrays: dict[str, np.ndarray]) -> Iterator[tuple[str, np.ndarray]]:
    """(on-disk name, tensor) for every parameter array of `module` (`arrays`: dotted path -> host array, e.g.
    `hf.flat_params` read out): the fused ones split into their parts, the others as they are."""
    fused = fused_params(module)
    for name, arr in arrays.items():
        if name in fused:
            for part in fused[name].parts:
                yield part.key, gather(part, arr)
        else:
            yield name, arr


__all__ = ["Fused", "Part", "disk_tensors", "fused_params", "gather", "scatter"]
