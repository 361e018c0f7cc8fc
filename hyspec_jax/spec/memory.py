"""Transient memory of GDN tree verification: Bole's factorized design vs SGLang's per-node snapshots.

What is counted (per round, for `batch` requests each verifying `nodes` tree nodes, anchor included):

(a) Bole / this library (gdn.masked_solve + gdn.node_state). Held from the verify forward until the commit,
    for every GDN layer (the accepted node is only known after sampling, so all layers' factors live at once):
      Γ   log path decay      [HV, N]      state dtype (fp32)
      k   keys                [HK, N, dk]  state dtype, per key head (`shared_keys`, as gdn.SolveFactors holds
                                           them: value heads of one key group share the key) — or [HV, N, dk]
                                           without it (an expanded copy per value head)
      V'  corrected values    [HV, N, dv]  state dtype
      x   raw conv inputs     [N, conv_dim] activation dtype (bf16) — needed to commit the conv window
                                           along the accepted path (tree.window_taps_after); `conv` toggles
    optionally (`interaction`) the per-head N×N matrices a non-fused solve writes to memory: Bole's G
    (strictly-lower ancestor interaction, our L) and C (q·k ⊙ D readout), fp32 [HV, N, N] each. They are
    consumed inside their layer, so only ONE layer's worth is live at a time (counted once, not × layers).
(b) SGLang 0.5.23 tree verify (docs/reference/target_model.md §13.2): per request
      intermediate_ssm          [num_gdn_layers, N, HV, dv, dk]      state dtype (fp32)
      intermediate_conv_window  [num_gdn_layers, N, conv_dim, K−1]   activation dtype (bf16); `conv` toggles

Not counted, because both designs need them identically: the committed state and conv window (persistent,
not transient), per-layer outputs o, the attention KV of the nodes, the tree topology (mask / parents).
The ratio is independent of N and batch unless `interaction` is on (then it falls slowly with N).
"""

from __future__ import annotations

import dataclasses

from hyspec_jax.config import FULL, LINEAR, TargetConfig


@dataclasses.dataclass(frozen=True)
class VerifyDesign:
    """Knobs of the accounting (defaults = what this library's gdn.masked_solve produces)."""
    shared_keys: bool = True    # keys stored per key head (HK) instead of per value head (HV)
    conv: bool = True           # count conv (Bole: raw per-node inputs; SGLang: per-node windows)
    interaction: bool = False   # count G and C ([HV, N, N] fp32 each) for one layer
    state_bytes: int = 4        # fp32 factors / SGLang intermediate_ssm
    act_bytes: int = 2          # bf16 conv inputs / SGLang conv windows


OURS = VerifyDesign()
# Bole's Table I accounting, eq. (9): factors (P, K, U) only, keys per key head, no conv, no N×N matrices.
BOLE_TABLE_I = VerifyDesign(conv=False)


@dataclasses.dataclass(frozen=True)
class VerifyMemory:
    batch: int
    nodes: int
    design: VerifyDesign
    # (a) factorized
    log_decay_bytes: int      # Γ, all GDN layers
    key_bytes: int            # k, all GDN layers
    corrected_bytes: int      # V', all GDN layers
    conv_input_bytes: int     # raw per-node conv inputs, all GDN layers
    interaction_bytes: int    # G and C of one layer
    # (b) snapshots
    snapshot_ssm_bytes: int   # intermediate_ssm
    snapshot_conv_bytes: int  # intermediate_conv_window

    @property
    def factor_bytes(self) -> int:
        return self.log_decay_bytes + self.key_bytes + self.corrected_bytes

    @property
    def bole_bytes(self) -> int:
        return self.factor_bytes + self.conv_input_bytes + self.interaction_bytes

    @property
    def sglang_bytes(self) -> int:
        return self.snapshot_ssm_bytes + self.snapshot_conv_bytes

    @property
    def ratio(self) -> float:
        """How many times less transient memory the factorized design needs."""
        return self.sglang_bytes / self.bole_bytes


def verify_memory(cfg: TargetConfig, batch: int, nodes: int, design: VerifyDesign = OURS) -> VerifyMemory:
    """Transient bytes of verifying `nodes` tree nodes for `batch` requests, both designs (module docstring)."""
    if batch < 1 or nodes < 1:
        raise ValueError(f"batch and nodes must be ≥ 1, got batch={batch}, nodes={nodes}")
    Lg = len(cfg.gdn_layers)
    HK, HV = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, K = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim
    s, a = design.state_bytes, design.act_bytes
    per_layer = batch * nodes          # node-rows per layer
    return VerifyMemory(
        batch=batch, nodes=nodes, design=design,
        log_decay_bytes=Lg * per_layer * HV * s,
        key_bytes=Lg * per_layer * (HK if design.shared_keys else HV) * dk * s,
        corrected_bytes=Lg * per_layer * HV * dv * s,
        conv_input_bytes=Lg * per_layer * cfg.conv_dim * a if design.conv else 0,
        interaction_bytes=2 * batch * HV * nodes * nodes * s if design.interaction else 0,
        snapshot_ssm_bytes=Lg * per_layer * HV * dv * dk * s,
        snapshot_conv_bytes=Lg * per_layer * cfg.conv_dim * (K - 1) * a if design.conv else 0,
    )


def qwen35_9b() -> TargetConfig:
    """The Qwen3.5 "9B-style" geometry, the numbers of docs/reference/target_model.md §15 (transformers'
    `Qwen3_5TextConfig` defaults, whose docstring cites Qwen3.5-9B): hidden 4096, 32 layers (24 GDN + 8 full
    attention, interval 4), attention 16 / 4 KV / head_dim 256, GDN 16 key / 32 value heads of 128 / 128,
    conv 4, dense MLP 12288, vocab 248320, untied."""
    return _qwen35_geometry(hidden=4096, layers=32, heads=16, intermediate=12288, value_heads=32)


def qwen38_27b() -> TargetConfig:
    """Qwen3.8-27B geometry (docs/reference/target_model.md §15), built from the numbers there."""
    return _qwen35_geometry(hidden=5120, layers=64, heads=24, intermediate=17408, value_heads=48)


def _qwen35_geometry(*, hidden: int, layers: int, heads: int, intermediate: int, value_heads: int) -> TargetConfig:
    """What the published Qwen3.5 / 3.8 geometries share (a full-attention layer every 4th, 4 KV heads of 256,
    16 GDN key heads, GDN heads of 128, conv 4, vocab 248320) around the sizes that differ."""
    return TargetConfig(
        model_type="qwen3_5_text", vocab_size=248320, hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=4, head_dim=256, intermediate_size=intermediate,
        layer_types=tuple(FULL if (i + 1) % 4 == 0 else LINEAR for i in range(layers)),
        linear_num_key_heads=16, linear_num_value_heads=value_heads, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, rope_theta=1e7, partial_rotary_factor=0.25)


def memory_table(cfg: TargetConfig | None = None, nodes: tuple[int, ...] = (32, 64, 128), batch: int = 1,
                 design: VerifyDesign = OURS) -> list[VerifyMemory]:
    cfg = qwen38_27b() if cfg is None else cfg
    return [verify_memory(cfg, batch, n, design) for n in nodes]


def format_table(rows: list[VerifyMemory]) -> str:
    """Markdown table (MiB = 2^20 bytes)."""
    mib = lambda x: f"{x / 2**20:,.1f}"
    out = ["| N | batch | factors MiB | conv in MiB | G,C MiB | Bole MiB | SGLang MiB | ratio |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r.nodes} | {r.batch} | {mib(r.factor_bytes)} | {mib(r.conv_input_bytes)} | "
                   f"{mib(r.interaction_bytes)} | {mib(r.bole_bytes)} | {mib(r.sglang_bytes)} | {r.ratio:.1f}x |")
    return "\n".join(out)


if __name__ == "__main__":  # python -m hyspec_jax.spec.memory
    for name, d in [("this library (gdn.masked_solve)", OURS),
                    ("+ G, C materialised", dataclasses.replace(OURS, interaction=True)),
                    ("Bole Table I accounting (no conv)", BOLE_TABLE_I)]:
        print(f"\nQwen3.8-27B, {name}\n{format_table(memory_table(design=d))}")
