"""Does the target's committed GDN state carry anything beyond the drafter's taps? `hyspec bench reader-probe`.

On a trained target, its DSpark + ReaDy drafter and the corpus validation split (long windows, the target's
training length by default), with every stride-aligned anchor a of every window (the block sees context < a,
the reader the committed state after tokens 0 .. a − 1, as `hyspec train-drafter` trains and evaluates it):

(a) teacher-forced τ̂ per block (`train.drafter.drafter_loss`, the trainer's definition: 1 + the accepted prefix of
    argmax draft = argmax target, previous tokens the corpus's) of three drafters:
      dspark        the drafter without its reader (the stage-1 weights chain / tree modes use);
      ready         with the reader fed its own window's committed states (stage-2 LoRA merged, as served);
      ready_swapped the same anchors, the states of another window of the same domain (the batch rolled by one);
    per domain and pooled, binned by prefix length a, each with a standard error clustered by window (blocks of
    one window are not independent) and the paired differences ready − dspark and ready − ready_swapped.

(b) the no-training bound: closed-form ridge probes, fitted on the first half of each domain's windows (the ridge
    penalty chosen by top-1 agreement on the last quarter of those) and scored on the second half, predicting the
    target's final-norm hidden state at t + j (t = a − 1, the last context position; j = 1 .. horizons; its logits
    are this hidden times the LM head, so this is the ridge of the logits), scored by top-1 agreement of the probe's
    logits with the target's and by R² of the hidden state, from
      taps                 the tapped layer outputs at t and the embedding of token a (the block's first input);
      draft                taps plus the DSpark drafter's own final hidden for the slot predicting t + j (its
                           whole view: it attends to every tapped position < a); these fit the residual of the
                           target's hidden from the drafter's (one LM head reads both), so with nothing to add they
                           keep the drafter's own prediction;
      ... +Sq[layers]      plus o = S_L(t)ᵀ q_L(t + j) per value head of GDN layer L: S the committed state after t,
                           q the target's TRUE query at t + j (an oracle: the most any reader of that state could
                           extract with a perfect query);
      ... swapped          the same with S from another window: q alone leaks the future tokens t + 2 .. t + j,
                           so own − swapped is what the state itself adds;
      draft +Sq̂[sources]   the reader's source states read by q̂, the target's query at t + j predicted by a ridge
                           from the draft features (fitted on the fit windows, states read in a second pass): what a
                           reader whose query imitates the target's could extract without the future tokens.
    Layers: the reader's source layers together, and each probed GDN layer alone (untapped layers included).

States come from `train.forward.train_forward` (committed states at every stride boundary); queries from the
target's own layer modules (input norm, projection, causal conv, `mixer_inputs`) applied to the layer's input (the
previous layer's output); o from `gdn.step` with the identity gates (g = 0, β = 0: the state unchanged, o = Sᵀq).

    hyspec bench reader-probe --json bench/results/ready_scale/reader_probe_cpu.json --windows 32

On a GPU machine (package not installed): `ln -sfn $PWD/bench hyspec_jax/bench; ln -sfn $PWD/train
hyspec_jax/train; PYTHONPATH=$PWD python3 -m hyspec_jax.bench.reader_probe --json $OUT/reader_probe.json`.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import sys
import time
from pathlib import Path

import numpy as np

F32 = np.float32
VARIANTS = ("dspark", "ready", "ready_swapped")


# ------------------------------------------------------------------------------------------------
# Configuration
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ProbeConfig:
    model: str
    drafter: str
    corpus: str
    seq_len: int = 512
    windows: int = 64                      # per domain (fewer where the validation shard is shorter)
    batch: int = 4                         # windows per forward (>= 2: the swapped states come from the batch)
    stride: int = 8                        # GDN chunk = anchor stride (the trainer's state_stride)
    bins: tuple[int, ...] = (32, 128, 256, 448)
    horizons: int = 3
    probe_layers: tuple[int, ...] | None = None  # GDN layers probed alone (default: sources + untapped GDN)
    base_taps: tuple[int, ...] | None = None     # layers of the `taps` features (default: the drafter's taps)
    lambdas: tuple[float, ...] = (1e-2, 1e-1, 1.0, 10.0, 100.0)   # ridge penalty per row (standardised X)
    domains: tuple[str, ...] | None = None

    def __post_init__(self):
        if self.batch < 2:
            raise ValueError("--batch must be >= 2 (the swapped states are another window of the batch)")
        if self.seq_len % self.stride or self.seq_len < 2 * self.stride:
            raise ValueError(f"--seq-len {self.seq_len} must be a multiple of --stride {self.stride}, >= 2 strides")
        if list(self.bins) != sorted(set(self.bins)) or (self.bins and self.bins[0] <= 0):
            raise ValueError("--bins must be increasing positive prefix lengths")
        if self.horizons < 1 or self.windows < 2:
            raise ValueError("--horizons must be >= 1 and --windows >= 2")


def bin_labels(bins: tuple[int, ...]) -> list[str]:
    """Bin i holds prefix lengths [edge_i, edge_{i+1}): '<32', '32-127', ..., '448+'."""
    e = list(bins)
    return ([f"<{e[0]}"] if e else []) + [f"{lo}-{hi - 1}" for lo, hi in itertools.pairwise(e)] + \
        ([f"{e[-1]}+"] if e else ["all"])


def bin_of(prefix: np.ndarray, bins: tuple[int, ...]) -> np.ndarray:
    """Index of each prefix length's bin (every length >= 0 falls in exactly one)."""
    return np.searchsorted(np.asarray(bins, np.int64), np.asarray(prefix), side="right")


def anchors_for(seq_len: int, stride: int) -> np.ndarray:
    """Every stride-aligned anchor of a window (`DrafterTrainer.anchors_for`'s aligned candidates)."""
    return np.arange(stride, seq_len - 1, stride, dtype=np.int32)


# ------------------------------------------------------------------------------------------------
# Statistics
# ------------------------------------------------------------------------------------------------
def cluster_mean(values: np.ndarray, clusters: np.ndarray) -> tuple[float, float]:
    """Mean of values and its standard error with clusters (windows) as the independent units:
    sqrt(G/(G−1) · Σ_g (Σ_{i∈g} (v_i − mean))²) / n. NaN SE with one cluster."""
    v = np.asarray(values, np.float64)
    n = v.size
    if n == 0:
        return float("nan"), float("nan")
    m = float(v.mean())
    _, inv = np.unique(clusters, return_inverse=True)
    g = int(inv.max()) + 1
    if g < 2:
        return m, float("nan")
    s = np.bincount(inv, weights=v - m, minlength=g)
    return m, float(np.sqrt(g / (g - 1) * np.sum(s * s)) / n)


@dataclasses.dataclass(frozen=True)
class Ridge:
    w: np.ndarray          # [D, K] on standardised inputs
    x_mean: np.ndarray
    x_scale: np.ndarray
    y_mean: np.ndarray
    lam: float

    def predict(self, x: np.ndarray) -> np.ndarray:
        return ((x - self.x_mean) / self.x_scale).astype(F32) @ self.w.astype(F32) + self.y_mean


def _standardised(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(column means, column scales, the standardised x)."""
    mean = x.mean(0, dtype=np.float64).astype(F32)
    scale = x.std(0, dtype=np.float64)
    scale = np.where(scale > 1e-8, scale, 1.0).astype(F32)
    return mean, scale, ((x - mean) / scale).astype(F32)


def _solve(xs: np.ndarray, y: np.ndarray, y_mean: np.ndarray, lams: tuple[float, ...]) -> list[np.ndarray]:
    """w = (XᵀX + λ n I)⁻¹ Xᵀ(Y − Ȳ) for each λ (one Gram matrix for all)."""
    gram = (xs.T @ xs).astype(np.float64)
    xty = (xs.T @ (y - y_mean)).astype(np.float64)
    eye = np.eye(gram.shape[0])
    return [np.linalg.solve(gram + lam * len(xs) * eye, xty) for lam in lams]


def ridge_fit(x: np.ndarray, y: np.ndarray, lam: float, standardised=None) -> Ridge:
    """Closed-form ridge on standardised columns: w = (XᵀX + λ n I)⁻¹ Xᵀ(Y − Ȳ). standardised: `_standardised(x)`
    when the caller has it."""
    mean, scale, xs = standardised or _standardised(x)
    y_mean = y.mean(0, dtype=np.float64).astype(F32)
    return Ridge(_solve(xs, y, y_mean, (lam,))[0], mean, scale, y_mean, lam)


def ridge_select(x: np.ndarray, y: np.ndarray, held: np.ndarray, lambdas: tuple[float, ...],
                 score=None) -> Ridge:
    """λ with the best score on the held-out rows (`held`, bool) when fitted on the others, then refit on all rows
    with it. score(prediction of the held rows) -> higher is better; default minus the squared error. Ties go to
    the larger λ."""
    if len(lambdas) == 1 or not held.any() or held.all():
        return ridge_fit(x, y, lambdas[0])
    std = _standardised(x)
    xs = std[2]
    a, b = ~held, held
    y_mean = y[a].mean(0, dtype=np.float64).astype(F32)
    scores = []
    for w in _solve(xs[a], y[a], y_mean, lambdas):
        pred = xs[b] @ w.astype(F32) + y_mean
        scores.append(-float(np.sum((pred - y[b]) ** 2)) if score is None else float(score(pred)))
    best = max(range(len(lambdas)), key=lambda i: (scores[i], lambdas[i]))
    return ridge_fit(x, y, lambdas[best], std)


# ------------------------------------------------------------------------------------------------
# Model side (JAX)
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Models:
    tcfg: object
    dcfg: object
    rcfg: object
    t_graphdef: object
    t_params: object
    heads: object
    dspark: tuple          # (graphdef, params): no reader
    ready: tuple           # (graphdef, params): reader + its stage-2 LoRA merged
    probe_layers: tuple[int, ...]
    base_taps: tuple[int, ...]      # the layers whose outputs at t are the `taps` features


def default_probe_layers(tcfg, dcfg, rcfg) -> tuple[int, ...]:
    """The reader's source layers and every GDN layer the drafter does not tap (the ones a reader could add to)."""
    untapped = [i for i in tcfg.gdn_layers if i not in dcfg.target_layer_ids]
    return tuple(sorted(set(rcfg.source_layers) | set(untapped)))


def load_models(model_dir, drafter_dir, probe_layers: tuple[int, ...] | None = None,
                base_taps: tuple[int, ...] | None = None) -> Models:
    import jax.numpy as jnp
    from flax import nnx

    from hyspec_jax.config import LINEAR
    from hyspec_jax.io.drafter_io import load_drafter
    from hyspec_jax.io.hf import load_pretrained
    from hyspec_jax.models.drafter import target_heads
    from hyspec_jax.models.target import unscan_layers

    tcfg, target = load_pretrained(model_dir, dtype=jnp.float32)
    if target.is_scanned:
        target = unscan_layers(target)
    ready = load_drafter(drafter_dir, with_reader=True)
    if ready.reader is None:
        raise ValueError(f"{drafter_dir}: the drafter has no reader (reader/)")
    dspark = load_drafter(drafter_dir, with_reader=False)
    dcfg, rcfg = ready.config, ready.reader_config
    layers = default_probe_layers(tcfg, dcfg, rcfg) if probe_layers is None else tuple(probe_layers)
    bad = [i for i in layers if not (0 <= i < tcfg.num_hidden_layers and tcfg.layer_types[i] == LINEAR)]
    if bad:
        raise ValueError(f"probe layers {bad} are not GDN layers of the target")
    base = tuple(dcfg.target_layer_ids) if base_taps is None else tuple(base_taps)
    if [i for i in base if not 0 <= i < tcfg.num_hidden_layers] or not base:
        raise ValueError(f"base taps {list(base)}: not layers of the {tcfg.num_hidden_layers}-layer target")
    t_graphdef, t_params = nnx.split(target)
    return Models(tcfg, dcfg, rcfg, t_graphdef, t_params, target_heads(target), nnx.split(dspark), nnx.split(ready),
                  layers, base)


def states_before(states, anchors, stride: int, roll: int = 0):
    """Chunk states [Ls, nC, B, HV, dk, dv] (`train_forward`) -> per anchor [B, A, Ls·HV, dk, dv]: the committed
    state after tokens 0 .. a − 1 (the layout `DrafterTrainer._forward` feeds the reader); roll > 0 takes them from
    the window `roll` rows earlier in the batch instead (the swapped-state control)."""
    import jax
    import jax.numpy as jnp
    if roll:
        states = jnp.roll(states, roll, axis=2)
    c = anchors // stride - 1
    picked = jax.vmap(lambda s_b, c_b: s_b[:, c_b], in_axes=(2, 0), out_axes=1)(states, c)   # [Ls, B, A, ...]
    picked = jnp.moveaxis(picked, 0, 2)                                                       # [B, A, Ls, ...]
    return picked.reshape(picked.shape[:2] + (-1,) + picked.shape[-2:])


def block_metrics(out, target_logits, anchors):
    """Per block (row b, anchor a) τ̂ and first-slot acceptance, each block scored alone by `drafter_loss`."""
    import jax

    from hyspec_jax.train.drafter import STAGE_DEFAULTS, drafter_loss
    _, ce, l1, conf = STAGE_DEFAULTS["dspark"]

    def one(o, tl, a):
        m = drafter_loss(jax.tree.map(lambda x: x[None, None], o), tl[None], a[None, None], ce=ce, l1=l1,
                         conf=conf, decay=4.0)[1]
        return m["tau"], m["acc0"]
    per_anchor = jax.vmap(one, in_axes=(0, None, 0))
    return jax.vmap(per_anchor, in_axes=(0, 0, 0))(out, target_logits, anchors)


def dspark_hidden(graphdef, params, heads, taps, tokens, anchors):
    """The drafter's final hidden of every block slot [B, A, G, H] (no reader): what `forward_train` turns into
    its base logits (slot k predicts the target's logits at a + k), the whole of the drafter's view of the context
    (it attends to every tapped position < a)."""
    import jax.numpy as jnp
    from flax import nnx
    model = nnx.merge(graphdef, params)
    B, T = tokens.shape
    ck, cv = model.context_kv(taps, jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)))
    x = heads.embed_tokens(model.block_tokens(jnp.take_along_axis(tokens, anchors, axis=1)))
    h = model.block_hidden(x, anchors, ck, cv, jnp.full((B,), T, jnp.int32))
    return h[:, :, model.config.logits_start:]


def gdn_inputs(target, layer: int, x_in, valid):
    """GDN layer `layer`'s (q, k, v, g, β) over a whole window from its input x_in [B, T, H] (the previous layer's
    output): the layer's input norm, then `train.forward.window_mixer_inputs` as `train_forward` runs it; valid
    False turns every position into an identity step (g = 0, β = 0). q and k per value head (`gdn.value_heads`): the
    probe reads each value head's state with its own query."""
    from hyspec_jax import gdn
    from hyspec_jax.train.forward import window_mixer_inputs
    lay = target.model.layers[layer]
    q, k, v, g, beta = window_mixer_inputs(lay.linear_attn, lay.input_layernorm(x_in), valid, target.config)[0]
    hv = v.shape[-2]
    return gdn.value_heads(q, hv), gdn.value_heads(k, hv), v, g, beta


def state_readout(S, q):
    """o = Sᵀq through `gdn.step` with identity gates (g = 0, β = 0, k = v = 0: S left as it is).
    S [B, A, HV, dk, dv], q [B, A, J, HV, dk] -> [B, A, J, HV·dv]."""
    import jax.numpy as jnp

    from hyspec_jax import gdn
    B, A, J, HV, dk = q.shape
    S = jnp.broadcast_to(S[:, :, None], (B, A, J) + S.shape[2:]).reshape((-1,) + S.shape[2:])
    zero = jnp.zeros((B * A * J, HV), jnp.float32)
    o, _ = gdn.step(S, q.reshape(-1, HV, dk), jnp.zeros_like(q).reshape(-1, HV, dk),
                    jnp.zeros((B * A * J, HV, S.shape[-1]), jnp.float32), zero, zero)
    return o.reshape(B, A, J, -1)


def own_and_swapped_readout(own, q):
    """[2, ...]: `state_readout` of each window's own states, then of the states of the window one row earlier in
    the batch (the swapped-state control)."""
    import jax.numpy as jnp
    return jnp.stack([state_readout(own, q), state_readout(jnp.roll(own, 1, axis=0), q)])


def make_pass(m: Models, stride: int, horizons: int):
    """The jitted per-batch measurement: tokens [B, T] -> dict of host-bound arrays (module docstring)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from hyspec_jax.models.drafter import forward_train
    from hyspec_jax.train.drafter import gather_positions
    from hyspec_jax.train.forward import train_forward

    tcfg, dcfg, rcfg = m.tcfg, m.dcfg, m.rcfg
    d_taps = tuple(dcfg.target_layer_ids)
    tap_layers = tuple(sorted(set(d_taps) | set(m.base_taps) | {L - 1 for L in m.probe_layers if L > 0}))
    src_slots = tuple(rcfg.source_slots)
    slots = tuple(dict.fromkeys(src_slots + tuple(tcfg.layer_slot(L) for L in m.probe_layers)))
    d_graph, r_graph = m.dspark[0], m.ready[0]
    J = horizons

    def run(t_params, d_params, r_params, heads, tokens, anchors):
        target = nnx.merge(m.t_graphdef, t_params)
        B, T = tokens.shape
        logits, hidden, taps, states = train_forward(target, tokens, tap_layers=tap_layers, chunk=stride,
                                                     state_slots=slots)
        dtaps = taps[jnp.asarray([tap_layers.index(i) for i in d_taps])]
        src = states[jnp.asarray([slots.index(s) for s in src_slots])]
        outs = {
            "dspark": forward_train(d_graph, d_params, heads, dtaps, tokens, anchors),
            "ready": forward_train(r_graph, r_params, heads, dtaps, tokens, anchors,
                                   reader_states=states_before(src, anchors, stride)),
            "ready_swapped": forward_train(r_graph, r_params, heads, dtaps, tokens, anchors,
                                           reader_states=states_before(src, anchors, stride, roll=1)),
        }
        res = {}
        for k in VARIANTS:
            res[f"tau_{k}"], res[f"acc0_{k}"] = block_metrics(outs[k], logits, anchors)
        res["draft"] = dspark_hidden(d_graph, d_params, heads, dtaps, tokens, anchors)[:, :, :J]   # [B,A,J,H]

        # ---- ridge features, t = a − 1 ----------------------------------------------------------------------
        t_idx = (anchors - 1)[:, :, None]                                                   # [B, A, 1]
        btaps = taps[jnp.asarray([tap_layers.index(i) for i in m.base_taps])]
        tapped = gather_positions(jnp.moveaxis(btaps, 0, 2), t_idx)[:, :, 0]                # [B, A, L, H]
        first = heads.embed_tokens(gather_positions(tokens, anchors[:, :, None])[:, :, 0])  # token a
        res["base"] = jnp.concatenate([tapped.reshape(B, anchors.shape[1], -1), first], -1)
        fut = t_idx + jnp.arange(1, J + 1)                                                   # [B, A, J]
        res["y_hidden"] = gather_positions(hidden, fut)                                      # [B, A, J, H]
        res["y_top"] = jnp.argmax(gather_positions(logits, fut), -1)                         # [B, A, J]
        sq, qs = [], []
        for L in m.probe_layers:
            x_in = target.model.embed_tokens(tokens) if L == 0 else taps[tap_layers.index(L - 1)]
            q = gather_positions(gdn_inputs(target, L, x_in, jnp.ones((B, T), bool))[0], fut)  # [B, A, J, HV, dk]
            own = states_before(states[slots.index(tcfg.layer_slot(L))][None], anchors, stride)
            sq.append(own_and_swapped_readout(own, q))
            qs.append(q.reshape(q.shape[:3] + (-1,)))
        res["sq"] = jnp.stack(sq)                                                            # [P, 2, B, A, J, D]
        res["q"] = jnp.stack(qs)                                                             # [P, B, A, J, HV·dk]
        return res

    return jax.jit(run)


def make_readout(m: Models, stride: int, layers: tuple[int, ...]):
    """Jitted: (target params, tokens [B, T], anchors, queries [P, B, A, J, HV, dk]) -> [P, 2, B, A, J, HV·dv]:
    the committed state of each of `layers` after a − 1 (own window, then the batch rolled by one) read by the
    given queries."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from hyspec_jax.train.forward import train_forward
    slots = tuple(m.tcfg.layer_slot(L) for L in layers)

    def run(t_params, tokens, anchors, queries):
        target = nnx.merge(m.t_graphdef, t_params)
        states = train_forward(target, tokens, chunk=stride, state_slots=slots)[3]
        out = []
        for p in range(len(layers)):
            own = states_before(states[p][None], anchors, stride)
            out.append(own_and_swapped_readout(own, queries[p]))
        return jnp.stack(out)

    return jax.jit(run)


# ------------------------------------------------------------------------------------------------
# The measurement
# ------------------------------------------------------------------------------------------------
def batches(windows: dict[str, np.ndarray], seq_len: int, batch: int):
    """(domain, window indices, tokens [batch, seq_len]): every window once, the last batch of a domain filled with
    its first windows (swap donors whose outputs are dropped)."""
    for d, w in windows.items():
        if len(w) < 2:
            raise ValueError(f"domain {d}: fewer than 2 windows of {seq_len} tokens")
        w = w[:, :seq_len]
        for i in range(0, len(w), batch):
            idx = list(range(i, min(i + batch, len(w))))
            pad = [j % len(w) for j in range(batch - len(idx))]
            yield d, idx, w[idx + pad]


def _cat(rows: dict[str, list]) -> dict[str, np.ndarray]:
    """Batches joined along the window axis (axis 2 of `sq`-like [P, 2, B, ...] arrays, 1 of `q`, else 0)."""
    axis = {"sq": 2, "sqhat": 2, "q": 1}
    return {k: np.concatenate(v, axis=axis.get(k, 0)) for k, v in rows.items()}


def _keep(k: str, v: np.ndarray, n: int) -> np.ndarray:
    return v[:, :, :n] if k in ("sq", "sqhat") else v[:, :n] if k == "q" else v[:n]


def collect(cfg: ProbeConfig, m: Models, windows: dict[str, np.ndarray], progress: bool = True) -> dict:
    """Run every window once (`batches`)."""
    import jax
    import jax.numpy as jnp

    fn = make_pass(m, cfg.stride, cfg.horizons)
    anchors_1 = anchors_for(cfg.seq_len, cfg.stride)
    anchors = jnp.asarray(np.broadcast_to(anchors_1, (cfg.batch, anchors_1.size)))
    rows: dict[str, list] = {}
    meta: list[tuple[str, int]] = []
    t0 = time.perf_counter()
    total = sum(len(w) for w in windows.values())
    for d, idx, toks in batches(windows, cfg.seq_len, cfg.batch):
        out = jax.device_get(fn(m.t_params, m.dspark[1], m.ready[1], m.heads, jnp.asarray(toks), anchors))
        for k, v in out.items():
            rows.setdefault(k, []).append(_keep(k, np.asarray(v), len(idx)))
        meta += [(d, j) for j in idx]
        if progress:
            print(f"  {d}: {len(meta)}/{total} windows, {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    data = _cat(rows)
    data["domain"] = np.array([d for d, _ in meta])
    data["window"] = np.array([j for _, j in meta])
    data["anchors"] = anchors_1
    data["seconds"] = time.perf_counter() - t0
    return data


def fit_split(data: dict) -> tuple[np.ndarray, np.ndarray]:
    """Per window: fit (the first half of its domain's windows) and held (the last quarter of those: the ridge
    penalty's held-out rows)."""
    dom, win = data["domain"], data["window"]
    n_dom = {d: int(np.sum(dom == d)) for d in dict.fromkeys(dom)}
    half = np.array([w < (n_dom[d] + 1) // 2 for d, w in zip(dom, win)])
    held = np.array([w >= (3 * ((n_dom[d] + 1) // 2)) // 4 for d, w in zip(dom, win)]) & half
    return half, held


def learned_query_readout(cfg: ProbeConfig, m: Models, windows: dict[str, np.ndarray], data: dict,
                          progress: bool = True) -> None:
    """data["sqhat"] [P, 2, W, A, J, HV·dv] for the reader's source layers: their states (own, swapped) read by
    q̂ — the target's query at t + j predicted by a ridge from the drafter's view (`draft` features), fitted on the
    fit windows: what a reader whose query imitates the target's could extract without the future tokens. With
    base taps other than the drafter's, also data["sqhat_taps"] for every probed layer, q̂ predicted from the
    `taps` features: what a reader on a drafter of those taps could extract."""
    t0 = time.perf_counter()
    W, A = data["tau_dspark"].shape
    src = tuple(m.probe_layers.index(L) for L in m.rcfg.source_layers)
    data["sqhat"] = _predicted_query_readout(cfg, m, windows, data, lambda j: draft_features(data, j), src)
    if m.base_taps != tuple(m.dcfg.target_layer_ids):
        taps = data["base"].reshape(W * A, -1)
        data["sqhat_taps"] = _predicted_query_readout(cfg, m, windows, data, lambda j: taps,
                                                      tuple(range(len(m.probe_layers))))
    data["seconds_qhat"] = time.perf_counter() - t0
    if progress:
        print(f"  learned-query readout: {data['seconds_qhat']:.0f} s", file=sys.stderr, flush=True)


def _predicted_query_readout(cfg: ProbeConfig, m: Models, windows: dict[str, np.ndarray], data: dict,
                             features, probes: tuple[int, ...]) -> np.ndarray:
    """[len(probes), 2, W, A, J, HV·dv]: the states of probed layers `probes` (indices into m.probe_layers), own
    and swapped, read by the target's query at t + j as a ridge predicts it from features(j) [W·A, F], fitted on
    the fit windows (a second pass over the windows)."""
    import jax
    import jax.numpy as jnp

    W, A = data["tau_dspark"].shape
    half, held = fit_split(data)
    fit, held_r = np.repeat(half, A), np.repeat(held, A)[np.repeat(half, A)]
    hv, dk = m.tcfg.linear_num_value_heads, m.tcfg.linear_key_head_dim
    qhat = np.zeros((len(probes), W * A, cfg.horizons, hv * dk), F32)
    for j in range(cfg.horizons):
        x = features(j)
        for i, p in enumerate(probes):
            y = data["q"][p][:, :, j].reshape(W * A, -1)
            qhat[i, :, j] = ridge_select(x[fit], y[fit], held_r, cfg.lambdas).predict(x)
    qhat = qhat.reshape(len(probes), W, A, cfg.horizons, hv, dk)
    fn = make_readout(m, cfg.stride, tuple(m.probe_layers[p] for p in probes))
    anchors = jnp.asarray(np.broadcast_to(data["anchors"], (cfg.batch, A)))
    where = {(d, w): i for i, (d, w) in enumerate(zip(data["domain"], data["window"]))}
    out = []
    for d, idx, toks in batches(windows, cfg.seq_len, cfg.batch):
        rows = [where[(d, i)] for i in idx] + [where[(d, i % len(windows[d]))] for i in range(cfg.batch - len(idx))]
        q = jnp.asarray(qhat[:, rows])
        out.append(np.asarray(jax.device_get(fn(m.t_params, jnp.asarray(toks), anchors, q)))[:, :, :len(idx)])
    return np.concatenate(out, axis=2)


def draft_features(data: dict, j: int) -> np.ndarray:
    """The drafter's view for horizon j (0-based): taps at t, token a's embedding, its hidden for slot j."""
    W, A = data["tau_dspark"].shape
    return np.concatenate([data["base"].reshape(W * A, -1), data["draft"][:, :, j].reshape(W * A, -1)], -1)


def tau_report(data: dict, bins: tuple[int, ...]) -> dict:
    """(a): per domain (+ pooled) and prefix bin: blocks, windows, τ̂ ± SE of each variant, paired differences."""
    labels = bin_labels(bins)
    W, A = data["tau_dspark"].shape
    b_of = np.broadcast_to(bin_of(data["anchors"], bins), (W, A))
    win = np.broadcast_to(np.arange(W)[:, None], (W, A))
    dom = np.broadcast_to(data["domain"][:, None], (W, A))
    out = {}
    for d in [*dict.fromkeys(data["domain"]), "pooled"]:
        sel_d = np.ones((W, A), bool) if d == "pooled" else dom == d
        per = {}
        for bi, lab in [*enumerate(labels), (None, "all")]:
            sel = sel_d & (True if bi is None else b_of == bi)
            if not sel.any():
                continue
            r = {"blocks": int(sel.sum()), "windows": int(np.unique(win[sel]).size)}
            for k in VARIANTS:
                r[k], r[k + "_se"] = cluster_mean(data[f"tau_{k}"][sel], win[sel])
                r["acc0_" + k] = float(data[f"acc0_{k}"][sel].mean())
            for name, a, b in (("ready_minus_dspark", "ready", "dspark"),
                               ("ready_minus_swapped", "ready", "ready_swapped")):
                r[name], r[name + "_se"] = cluster_mean(data[f"tau_{a}"][sel] - data[f"tau_{b}"][sel], win[sel])
            per[lab] = {k: (round(v, 5) if isinstance(v, float) else v) for k, v in r.items()}
        out[d] = per
    return out


def feature_sets(m: Models) -> dict[str, tuple[str, str, tuple[int, ...], int]]:
    """name -> (base features "taps" or "draft", readout "sq" (true query) or "sqhat" (learned query), its layer
    rows, own 0 / swapped 1); the bases alone have no rows."""
    src = tuple(m.probe_layers.index(L) for L in m.rcfg.source_layers)
    tag = ",".join(map(str, m.rcfg.source_layers))
    sets: dict[str, tuple[str, str, tuple[int, ...], int]] = {}
    for base in ("taps", "draft"):
        sets[base] = (base, "sq", (), 0)
        sets[f"{base} +Sq[{tag}]"] = (base, "sq", src, 0)
        sets[f"{base} +Sq[{tag}] swapped"] = (base, "sq", src, 1)
    other = m.base_taps != tuple(m.dcfg.target_layer_ids)
    for base in ("taps", "draft") if other else ("draft",):   # each layer alone: on the taps too where not the drafter's
        for p, L in enumerate(m.probe_layers):
            if (p,) != src:
                sets[f"{base} +Sq[{L}]"] = (base, "sq", (p,), 0)
                sets[f"{base} +Sq[{L}] swapped"] = (base, "sq", (p,), 1)
    if other:                        # the query predicted from those taps (`sqhat_taps`: every probed layer)
        sets[f"taps +Sq̂[{tag}]"] = ("taps", "sqhat_taps", src, 0)
        sets[f"taps +Sq̂[{tag}] swapped"] = ("taps", "sqhat_taps", src, 1)
        for p, L in enumerate(m.probe_layers):
            if (p,) != src:
                sets[f"taps +Sq̂[{L}]"] = ("taps", "sqhat_taps", (p,), 0)
                sets[f"taps +Sq̂[{L}] swapped"] = ("taps", "sqhat_taps", (p,), 1)
    sets[f"draft +Sq̂[{tag}]"] = ("draft", "sqhat", tuple(range(len(src))), 0)
    sets[f"draft +Sq̂[{tag}] swapped"] = ("draft", "sqhat", tuple(range(len(src))), 1)
    return sets


def ridge_report(data: dict, m: Models, cfg: ProbeConfig, progress: bool = True) -> dict:
    """(b): per horizon j and feature set: λ, and per prefix bin (+ all) top-1 agreement ± SE, its paired gain over
    its base features (and, with own states, over the same features with swapped states) ± SE, R² of the hidden
    state; fitted on each domain's first half of windows, scored on the second. `draft` sets fit the residual of
    the target's hidden from the drafter's own (both are read by the same LM head), so with no signal they fall
    back to the drafter's own prediction."""
    import jax
    import jax.numpy as jnp

    W, A = data["tau_dspark"].shape
    half, held = fit_split(data)
    fit, test, held_r = np.repeat(half, A), np.repeat(~half, A), np.repeat(held, A)[np.repeat(half, A)]
    win_t = np.repeat(np.arange(W), A)[test]
    b_t = np.tile(bin_of(data["anchors"], cfg.bins), W)[test]
    labels = bin_labels(cfg.bins)
    logits_of = jax.jit(lambda h, hd: jnp.argmax(hd.logits(h), -1))

    def top1_of(h: np.ndarray) -> np.ndarray:        # the target's LM head on predicted hidden states, argmax
        return np.concatenate([np.asarray(logits_of(jnp.asarray(h[s:s + 4096]), m.heads))
                               for s in range(0, len(h), 4096)])
    sets = feature_sets(m)
    out: dict = {"fit_windows": int(half.sum()), "test_windows": int((~half).sum()),
                 "fit_rows": int(fit.sum()), "test_rows": int(test.sum()), "horizons": {}}

    def paired(a, b, sel):
        return cluster_mean(a[sel].astype(F32) - b[sel], win_t[sel])

    for j in range(cfg.horizons):
        bases = {"taps": data["base"].reshape(W * A, -1), "draft": draft_features(data, j)}
        offsets = {"taps": 0.0, "draft": data["draft"][:, :, j].reshape(W * A, -1)}
        y = data["y_hidden"][:, :, j].reshape(W * A, -1)
        top = data["y_top"][:, :, j].reshape(-1)[test]
        top_fit = data["y_top"][:, :, j].reshape(-1)[fit]
        res, hits = {}, {}
        for name, (base, source, layers, swap) in sets.items():
            if source not in data:
                continue
            x = np.concatenate([bases[base]] + [data[source][p, swap][:, :, j].reshape(W * A, -1) for p in layers], -1)
            off = offsets[base]
            off_h = off[fit][held_r] if base == "draft" else 0.0

            def held_top1(pred, off_h=off_h, want=top_fit[held_r]):   # λ for the reported metric (top-1)
                return float(np.mean(top1_of(pred + off_h) == want))
            r = ridge_select(x[fit], (y - off)[fit], held_r, cfg.lambdas, score=held_top1)
            pred = r.predict(x[test]) + (off[test] if base == "draft" else 0.0)
            hits[name] = top1_of(pred) == top
            sq_err = np.sum((pred - y[test]) ** 2, -1)
            sq_tot = np.sum((y[test] - y[test].mean(0)) ** 2, -1)
            per = {}
            for bi, lab in [*enumerate(labels), (None, "all")]:
                sel = np.ones(top.size, bool) if bi is None else b_t == bi
                if not sel.any():
                    continue
                t1, t1_se = cluster_mean(hits[name][sel].astype(F32), win_t[sel])
                per[lab] = {"rows": int(sel.sum()), "top1": round(t1, 5), "top1_se": round(t1_se, 5),
                            "r2": round(1.0 - float(sq_err[sel].sum() / sq_tot[sel].sum()), 5)}
                if name != base:
                    g, g_se = paired(hits[name], hits[base], sel)
                    per[lab].update(gain_vs_base=round(g, 5), gain_se=round(g_se, 5))
            res[name] = {"base": base, "lambda": r.lam, "features": int(x.shape[1]), "bins": per}
            if name.endswith(" swapped") and name[:-len(" swapped")] in res:
                own = name[:-len(" swapped")]
                for lab, b in res[own]["bins"].items():
                    sel = np.ones(top.size, bool) if lab == "all" else b_t == labels.index(lab)
                    g, g_se = paired(hits[own], hits[name], sel)
                    b.update(gain_vs_swapped=round(g, 5), gain_vs_swapped_se=round(g_se, 5))
            if progress:
                print(f"  ridge j={j + 1} {name}: top-1 {per['all']['top1']:.4f} (λ {r.lam:g})", file=sys.stderr,
                      flush=True)
        out["horizons"][str(j + 1)] = res
    return out


def run(cfg: ProbeConfig, progress: bool = True) -> dict:
    from hyspec_jax.bench.report import portable_path, run_metadata
    from hyspec_jax.train.target import validation_windows

    m = load_models(cfg.model, cfg.drafter, cfg.probe_layers, cfg.base_taps)
    windows = validation_windows(cfg.corpus, cfg.seq_len, cfg.windows)
    if cfg.domains:
        missing = sorted(set(cfg.domains) - set(windows))
        if missing:
            raise ValueError(f"domains {missing} have no validation window of {cfg.seq_len} tokens")
        windows = {d: windows[d] for d in cfg.domains}
    windows = {d: w for d, w in windows.items() if len(w) >= 2}
    if not windows:
        raise ValueError(f"{cfg.corpus}: no domain has 2 validation windows of {cfg.seq_len} tokens")
    data = collect(cfg, m, windows, progress)
    t1 = time.perf_counter()
    learned_query_readout(cfg, m, windows, data, progress)
    ridge = ridge_report(data, m, cfg, progress)
    conf = dataclasses.asdict(cfg)
    for k in ("model", "drafter", "corpus"):
        conf[k] = portable_path(conf[k])
    conf["probe_layers"] = list(m.probe_layers)
    conf["base_taps"] = list(m.base_taps)
    return {**run_metadata(), "config": conf,
            "target": {"layers": m.tcfg.num_hidden_layers, "gdn_layers": list(m.tcfg.gdn_layers)},
            "drafter": {"taps": list(m.dcfg.target_layer_ids), "block_size": m.dcfg.block_size,
                        "reader_sources": list(m.rcfg.source_layers), "reader_rank": m.rcfg.rank},
            "windows": {d: int(np.sum(data["domain"] == d)) for d in windows},
            "anchors_per_window": int(data["anchors"].size),
            "seconds": {"forward": round(float(data["seconds"]), 1),
                        "learned_query": round(float(data["seconds_qhat"]), 1),
                        "ridge": round(time.perf_counter() - t1 - float(data["seconds_qhat"]), 1)},
            "tau": tau_report(data, cfg.bins), "ridge": ridge}


# ------------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------------
def _pm(v, se, digits=3) -> str:
    return f"{v:.{digits}f}" if math.isnan(se) else f"{v:.{digits}f} ± {se:.{digits}f}"


def markdown(report: dict) -> str:
    from hyspec_jax.bench.report import short_commit
    c = report["config"]
    lines = [f"# ReaDy reader probe ({report['device_kind']}, fp32)", "",
             f"`{report.get('command', '')}` — commit {short_commit(report['commit'])}, jax {report['jax']}; target "
             f"`{c['model']}`, drafter `{c['drafter']}` (taps {report['drafter']['taps']}, reader sources "
             f"{report['drafter']['reader_sources']}); the `taps` features: layers "
             f"{c.get('base_taps', report['drafter']['taps'])}; corpus validation windows of {c['seq_len']} tokens: "
             + ", ".join(f"{d} {n}" for d, n in report["windows"].items())
             + f"; every anchor a multiple of {c['stride']} ({report['anchors_per_window']} a window); "
             f"± is one standard error clustered by window; forward {report['seconds']['forward']} s, learned-query "
             f"readout {report['seconds']['learned_query']} s, ridge {report['seconds']['ridge']} s.", "",
             "## (a) Teacher-forced τ̂ by prefix length", "",
             ("| domain | prefix | blocks | windows | dspark | ready (own state) | ready (swapped state) | "
              "ready − dspark | ready − swapped |"),
             "|---|---|---|---|---|---|---|---|---|"]
    for d, per in report["tau"].items():
        for lab, r in per.items():
            name = f"**{d}**" if d == "pooled" else d
            lines.append(f"| {name} | {lab} | {r['blocks']} | {r['windows']} | {_pm(r['dspark'], r['dspark_se'])} | "
                         f"{_pm(r['ready'], r['ready_se'])} | {_pm(r['ready_swapped'], r['ready_swapped_se'])} | "
                         f"{_pm(r['ready_minus_dspark'], r['ready_minus_dspark_se'], 4)} | "
                         f"{_pm(r['ready_minus_swapped'], r['ready_minus_swapped_se'], 4)} |")
    rd = report["ridge"]
    lines += ["", "## (b) Ridge probe of the target's next-token logits at t + j (no training)", "",
              (f"Fitted on {rd['fit_windows']} windows ({rd['fit_rows']} anchors), scored on {rd['test_windows']} "
               f"others ({rd['test_rows']} anchors). `taps`: the tapped layers at t = a − 1 and the embedding of token "
               "a; `draft`: plus the DSpark drafter's own hidden state for the slot predicting t + j (fitting the "
               "residual from it); `+Sq[L]`: plus S_L(t)ᵀ q_L(t + j) with the target's true future query; `+Sq̂`: "
               "with that query predicted from the `draft` features; `swapped`: S from another window. Cells: "
               "top-1 agreement with the target's argmax, then the paired gain over the base features and, for own "
               "states, over the swapped ones (± SE, clustered by window). R²: the final-norm hidden state, all "
               "prefixes."),
              ""]
    for j, res in rd["horizons"].items():
        labels = list(next(iter(res.values()))["bins"])
        lines += [f"### j = {j}", "", "| features | λ | " + " | ".join(labels) + " | R² |",
                  "|---|---|" + "---|" * len(labels) + "---|"]
        for name, r in res.items():
            cells = []
            for lab in labels:
                b = r["bins"][lab]
                cell = f"{b['top1']:.3f}"
                if "gain_vs_base" in b:
                    cell += f" (base {b['gain_vs_base']:+.3f} ± {b['gain_se']:.3f}"
                    if "gain_vs_swapped" in b:
                        cell += f"; swap {b['gain_vs_swapped']:+.3f} ± {b['gain_vs_swapped_se']:.3f}"
                    cell += ")"
                cells.append(cell)
            lines.append(f"| {name} | {r['lambda']:g} | " + " | ".join(cells) + f" | {r['bins']['all']['r2']:.3f} |")
        lines.append("")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hyspec bench reader-probe", description=__doc__.split("\n")[0],
                                epilog=__doc__.split("\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", required=True, metavar="OUT.json", help="results (a .md table next to it)")
    p.add_argument("--model", default=None, help="target directory (default: the embedded model)")
    p.add_argument("--drafter", default=None, help="drafter directory with reader/ (default: MODEL/drafter)")
    p.add_argument("--corpus", default="train/data/corpus", help="corpus of `hyspec build-corpus` (validation split)")
    p.add_argument("--seq-len", type=int, default=512, help="window length (default 512, the target's training length)")
    p.add_argument("--windows", type=int, default=64, help="validation windows per domain (default 64)")
    p.add_argument("--batch", type=int, default=4, help="windows per forward, >= 2 (default 4)")
    p.add_argument("--stride", type=int, default=8, help="anchor stride = GDN state chunk (default 8)")
    p.add_argument("--bins", type=int, nargs="*", default=[32, 128, 256, 448], help="prefix-length bin edges")
    p.add_argument("--horizons", type=int, default=3, help="ridge: positions t+1 .. t+J (default 3)")
    p.add_argument("--probe-layers", type=int, nargs="+", default=None,
                   help="GDN layers probed alone (default: the reader's sources and every untapped GDN layer)")
    p.add_argument("--base-taps", type=int, nargs="+", default=None, metavar="L",
                   help="the layers whose outputs at t form the `taps` features (default: the drafter's taps), e.g. "
                        "1 3 5 for ReaDy's positive control, whose DSpark leaves GDN layer 6 untapped; each probed "
                        "layer is then also read alone on top of them. The `draft` features still add the drafter's "
                        "own hidden, which sees the drafter's taps")
    p.add_argument("--lambdas", type=float, nargs="+", default=[1e-2, 1e-1, 1.0, 10.0, 100.0],
                   help="ridge penalties per fitted row on standardised features, chosen on held-out fit windows (by "
                        "top-1 agreement for the logit probes, squared error for the query predictor)")
    p.add_argument("--domains", nargs="+", default=None, help="only these corpus domains")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    a = build_parser().parse_args(argv)
    try:
        if a.model is None:
            from hyspec_jax.embedded import default_model_dir
            a.model = default_model_dir()
            if a.model is None:
                raise ValueError("no embedded model in this installation: pass --model")
        drafter = Path(a.drafter) if a.drafter else Path(a.model) / "drafter"
        for what, p in (("--model", Path(a.model)), ("--drafter", drafter), ("--corpus", Path(a.corpus))):
            if not p.is_dir():
                raise ValueError(f"{what} {p}: no such directory")
        cfg = ProbeConfig(model=str(a.model), drafter=str(drafter), corpus=str(a.corpus), seq_len=a.seq_len,
                          windows=a.windows, batch=a.batch, stride=a.stride, bins=tuple(a.bins), horizons=a.horizons,
                          probe_layers=None if a.probe_layers is None else tuple(a.probe_layers),
                          base_taps=None if a.base_taps is None else tuple(a.base_taps),
                          lambdas=tuple(a.lambdas), domains=None if a.domains is None else tuple(a.domains))
        report = run(cfg, progress=not a.quiet)
    except (ValueError, OSError) as e:   # ConfigError, CheckpointError: ValueErrors
        print(f"error: {e}", file=sys.stderr)
        return 1
    from hyspec_jax.bench.report import portable_command, write_report
    report["command"] = portable_command("hyspec bench reader-probe", argv)
    write_report(report, a.json, markdown)
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
