"""BICompFL: stochastic federated learning with bi-directional compression (docs/papers/bicompfl.md).

Every party trains or holds a FedPM model (:mod:`sidejax.algorithms.fedpm`): frozen random signed weights
and a Bernoulli keep-probability mask :math:`\\theta \\in [\\epsilon, 1 - \\epsilon]^d`. Nothing is sent as
real numbers: in **both** directions a sender transmits samples of its distribution by importance sampling
against a prior the receiver holds (the KLMS coder, :func:`sidejax.coding.klms_coder`, and its Fixed,
Adaptive and Adaptive-Avg block allocations), about :math:`D_{KL}(Q \\| P)` bits per sample instead of
:math:`d`.

Round ``t`` (the engine's order: downlink, local work, uplink, aggregation):

1. **Uplink** (all variants, Alg. 2/3): client ``i`` trains its mask from its estimate
   :math:`\\hat\\theta_{i,t}` (:func:`sidejax.algorithms.fedpm.train_mask`, Alg. 1: Adam on the scores,
   or :func:`sidejax.algorithms.mirror.mirror_descent` for App. B's reading) to :math:`q_i^t`, and sends
   ``n_UL`` samples of :math:`\\mathrm{Bern}(q_i^t)` against :math:`p = \\mathrm{Bern}(\\hat\\theta_{i,t})`
   (sample ``l`` with the keys :func:`sidejax.keys.draw_key` ``(keys, l)``), back to back in one stream.
2. **Aggregation**: the federator decodes every sample and sets
   :math:`\\theta_{t+1} = c\\big(\\frac1{n}\\sum_i \\frac1{n_{UL}} \\sum_l y_{i,l}\\big)` with the clip
   :math:`c(v) = \\epsilon + (1 - 2\\epsilon) v`, :math:`\\epsilon = 0.01` (docs/papers/bicompfl.md#s2-2 [R];
   unweighted mean [P], docs/papers/bicompfl.md#s8-16).
3. **Downlink** of :math:`\\theta_{t+1}` (at the start of round ``t + 1``), per variant:

   - **GR** (:func:`bicompfl_gr`, global shared randomness): the federator relays the other clients'
     uplink streams; each client decodes them (every client's candidates are reproducible from the global
     seed) and, with its own decoded samples, rebuilds :math:`\\theta_{t+1}` itself: all parties hold the
     same model bit for bit (:math:`\\zeta = 0`).
   - **GR-Reconst-Fixed** (:func:`bicompfl_gr_reconst`): the federator importance-samples
     :math:`n_{DL} = n \\cdot n_{UL}` masks of :math:`\\theta_{t+1}` against the common
     :math:`\\hat\\theta_t` and broadcasts one index stream; every party sets
     :math:`\\hat\\theta_{t+1} = c(\\text{mean})`.
   - **PR** (:func:`bicompfl_pr`, private shared randomness per client): the same, but per client, against
     that client's own prior :math:`\\hat\\theta_{i,t}` with randomness only the two share; estimates
     diverge across clients and the federator keeps a copy of each.
   - **PR-Fixed-SplitDL** (:func:`bicompfl_pr` with ``split_downlink=True``): client ``j`` is refreshed
     only on the block-aligned group :math:`G_j(t) = ` group :math:`(j + t) \\bmod n` of ``n`` contiguous
     groups (docs/papers/bicompfl.md#s3-6 [A]); the other coordinates keep :math:`\\hat\\theta_{j,t}`, so
     every coordinate is refreshed within ``n`` rounds and the downlink costs about ``1/n`` of PR's.
     The hybrid (``split_rounds=S``) splits only the downlinks of rounds :math:`t < S`, then sends PR's.

   These three take the downlink coder as an argument (:func:`bicompfl_downlink`: Fixed-KLMS with the
   CRC-32 on by default, since every party must hold bit-identical priors); a group is coded as the live
   prefix of a static buffer (:attr:`sidejax.coding.Coder.live_prefix`).

**Exact priors.** Every average is a count of 0/1 samples mapped through a lookup table,
:math:`c(k/N)` for :math:`k = 0..N` (:func:`clip_table`, float64 then float32), so the federator and
every client compute bit-identical priors in any compiled program (no reduction order, no fused
multiply-add can differ): the invariants "GR: every client's model equals the federator's" and "PR: the
federator's copy of client ``i``'s estimate equals client ``i``'s" hold bit for bit.

**Bits.** Every rate is the length of a real stream (the engine reads ``RoundInfo.uplink_bits`` and
``downlink_bits`` from the messages). The relayed GR downlink is the other clients' streams back to back
with no length fields: the KLMS streams are self-delimiting (:attr:`sidejax.coding.Coder.frame`). The
Fixed-allocation formulas of docs/papers/bicompfl.md#s2-3 are :func:`fixed_rates` (for checking and for the
table's "ideal" columns; never used as a measured rate).

Corrections (docs/papers/bicompfl.md#s8): Alg. 1 line 3's ``s^(0) - grad`` is ``s^(l-1) - eta grad``
(docs/papers/bicompfl.md#s8-3); the PR prior mixture is not implemented (``lambda = 1``, the paper's default
and the only value its tables use, docs/papers/bicompfl.md#s3-7); Alg. 3's superscript ``t`` on the new priors
is ``t + 1`` (docs/papers/bicompfl.md#s8-10); the probability clip, not in the paper, is applied exactly once
per average (docs/papers/bicompfl.md#s8-4).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sidejax.algorithms.fedpm import (
    ESTIMATORS,
    MASK_CLIP,
    fedpm_eval_params,
    mask_model_init,
    train_mask,
)
from sidejax.bits import BITS_DTYPE, as_bits
from sidejax.coding.base import (
    ERR_LENGTH,
    Coder,
    Message,
    check_live_prefix,
    concat_messages,
    concat_stacked,
    included,
    split_stacked,
)
from sidejax.coding.bitstream import mask_to_length, pack_fixed, unpack_fixed
from sidejax.coding.klms import KLMSConfig, klms_coder
from sidejax.distributions import Bernoulli
from sidejax.fl.base import Algorithm, ClientInfo, Evaluation, initial_round_state
from sidejax.fl.local import LocalTraining
from sidejax.keys import (
    ClientKeys,
    canonicalize_key,
    client_keys,
    client_streams,
    downlink_keys,
    draw_key,
)
from sidejax.types import Params
from sidejax.utils import check_count, keep_unless_none, masked_sum

__all__ = [
    "CLIP",
    "clip_table",
    "clipped_mean",
    "fixed_rates",
    "split_groups",
    "encode_samples",
    "decode_samples",
    "BiClientExtra",
    "GRServer",
    "GRClient",
    "BiServerInfo",
    "ReconstServer",
    "PRServer",
    "EstimateClient",
    "bicompfl_downlink",
    "bicompfl_gr",
    "bicompfl_gr_reconst",
    "bicompfl_pr",
]

CLIP = MASK_CLIP


# --------------------------------------------------------------------------------------------------
# exact averages, rates, groups


def clip_table(num_samples: int) -> np.ndarray:
    """``float32[num_samples + 1]``: :math:`c(k/N) = \\epsilon + (1 - 2\\epsilon) k / N` for ``k = 0..N``,
    computed in float64 and rounded once (docs/papers/bicompfl.md#s2-2, docs/papers/bicompfl.md#s7-13:
    averages lie on this grid)."""
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    k = np.arange(num_samples + 1, dtype=np.float64)
    return (CLIP + (1.0 - 2.0 * CLIP) * k / num_samples).astype(np.float32)


def clipped_mean(counts: jax.Array, num_samples: int) -> jax.Array:
    """:math:`c(\\text{counts} / N)` by table lookup (bit-identical wherever it is computed)."""
    return jnp.asarray(clip_table(num_samples))[counts]


@functools.lru_cache(maxsize=16)
def _clip_rows(num_clients: int, num_samples: int) -> np.ndarray:
    """``float32[num_clients + 1, num_clients * num_samples + 1]``: row ``m`` is :func:`clip_table` of
    ``m * num_samples`` samples (padded with its last value; row 0, no sample, is unused)."""
    width = num_clients * num_samples + 1
    rows = [np.full(width, 1.0 - CLIP, np.float32)]
    for m in range(1, num_clients + 1):
        row = clip_table(m * num_samples)
        rows.append(np.concatenate([row, np.full(width - row.shape[0], row[-1], np.float32)]))
    return np.stack(rows)


def included_clipped_mean(client_counts: jax.Array, include: jax.Array, num_samples: int) -> jax.Array:
    """:math:`c(k / N_I)` over the included clients: ``k`` the sum of their ``client_counts[C, d]`` (each
    of ``num_samples`` samples), :math:`N_I = |I| \\cdot` ``num_samples``, by table lookup (the same table
    entry as :func:`clipped_mean` when every client is included, so the same bits at every party)."""
    n = client_counts.shape[0]
    k = masked_sum(client_counts, include)
    return jnp.asarray(_clip_rows(n, num_samples))[jnp.sum(include), k]


def _counts(samples: jax.Array, axes) -> jax.Array:
    return jnp.sum((samples > 0.5).astype(jnp.int32), axis=axes)


def fixed_rates(
    dim: int,
    *,
    num_clients: int,
    block_size: int,
    log2_num_candidates: int,
    num_uplink_samples: int = 1,
    num_downlink_samples: int | None = None,
) -> dict[str, dict[str, float]]:
    """The Fixed-allocation rates of docs/papers/bicompfl.md#s2-3, in bits per parameter per client per round,
    for each variant: ``{"gr" | "gr_reconst" | "pr" | "pr_splitdl": {"uplink", "downlink", "bpp", "bc"}}``.

    One IS sample costs :math:`B \\log_2 n_{IS}` bits with :math:`B = \\lceil d / b \\rceil`. GR relays the
    other ``n - 1`` clients' samples; GR-Reconst and PR send :math:`n_{DL}` samples; SplitDL sends
    :math:`n_{DL}` samples of one group of :math:`B / n` blocks (the mean over groups is exactly
    :math:`B / n` blocks). "bc" (the broadcast channel) is :math:`UL + DL / n` for the broadcastable
    downlinks (GR, GR-Reconst) as the paper's tables count it, and ``bpp`` for the per-client ones.
    These are formulas, for checking; measured rates come from the messages.
    """
    n = num_clients
    n_dl = n * num_uplink_samples if num_downlink_samples is None else num_downlink_samples
    sample = -(-dim // block_size) * log2_num_candidates / dim
    ul = num_uplink_samples * sample
    dl = {
        "gr": (n - 1) * num_uplink_samples * sample,
        "gr_reconst": n_dl * sample,
        "pr": n_dl * sample,
        "pr_splitdl": n_dl * sample / n,
    }
    out = {}
    for name, down in dl.items():
        bpp = ul + down
        bc = ul + down / n if name in ("gr", "gr_reconst") else bpp
        out[name] = {"uplink": ul, "downlink": down, "bpp": bpp, "bc": bc}
    return out


def split_groups(num_blocks: int, num_groups: int) -> np.ndarray:
    """Block-aligned contiguous groups for SplitDL: ``int32[num_groups + 1]`` boundaries, group ``g`` is
    blocks ``[bounds[g], bounds[g + 1])``, sizes differing by at most one block (docs/papers/bicompfl.md#s3-6
    [A])."""
    if num_groups < 1 or num_groups > num_blocks:
        raise ValueError(
            f"SplitDL needs 1 <= num_groups <= num_blocks, got {num_groups} groups for {num_blocks} blocks "
            "(use smaller downlink blocks or fewer clients)"
        )
    return (np.arange(num_groups + 1, dtype=np.int64) * num_blocks // num_groups).astype(np.int32)


# --------------------------------------------------------------------------------------------------
# several importance samples in one stream


def _sample_keys(keys: ClientKeys, num_samples: int) -> ClientKeys:
    ls = jnp.arange(num_samples)
    return ClientKeys(
        jax.vmap(draw_key, (None, 0))(keys.shared, ls), jax.vmap(draw_key, (None, 0))(keys.private, ls)
    )


def encode_samples(coder: Coder, keys: ClientKeys, q, p, state, num_samples: int):
    """``num_samples`` independent messages of ``q`` against ``p`` (sample ``l`` with
    ``draw_key(keys.shared, l)`` / ``draw_key(keys.private, l)``), back to back in one stream.

    Returns ``(message, infos)`` with the coder's infos stacked over samples."""
    # one sample at a time (lax.map): the encoder's memory budget holds for any number of samples
    msgs, infos = jax.lax.map(lambda k: coder.encode(k, q, p, state), _sample_keys(keys, num_samples))
    if num_samples == 1:
        return Message(msgs.payload[0], msgs.num_bits[0]), infos
    return concat_stacked(msgs), infos


def samples_words(capacity: int, num_samples: int) -> int:
    """Static: the payload words of :func:`encode_samples`'s stream, from one message's declared
    ``capacity`` (``Coder.capacity_words``): the message itself, or ``num_samples`` of them back to back
    with one word for the bit shift (:func:`sidejax.coding.concat_stacked`)."""
    return capacity if num_samples == 1 else num_samples * capacity + 1


def decode_samples(coder: Coder, shared_key, p, state, message: Message, num_samples: int, capacity: int):
    """The receiver's side of :func:`encode_samples`: ``(samples[num_samples, d], decoded, errors)``.

    The stream is cut with the coder's ``frame`` (self-delimiting streams); ``errors`` is the OR of the
    samples' error bitmasks, plus ``ERR_LENGTH`` when the parts do not add up to the stream's length. It
    never raises on the stream's contents, inside ``jit`` or outside it; on the host
    :func:`sidejax.coding.check_decoded` turns a nonzero ``errors`` into a ``ValueError`` with the reasons
    (a mismatched prior, with the KLMS CRC on, reads "the parties' priors are out of sync")."""
    if num_samples == 1:  # the coder's own decode
        sample, decoded = coder.decode(draw_key(shared_key, 0), p, state, message)
        return (
            sample[None],
            jax.tree.map(lambda a: jnp.asarray(a)[None], decoded),
            jnp.asarray(decoded.errors),
        )
    else:
        if coder.frame is None:
            raise ValueError(
                f"coder {coder.name!r} has no frame (its streams are not self-delimiting), so several "
                "samples cannot share one stream; use num_uplink_samples=1 or a coder with frame (klms_coder)"
            )
        parts, ok = split_stacked(message, coder.frame, state, num_samples, capacity)
    shared = jax.vmap(draw_key, (None, 0))(shared_key, jnp.arange(num_samples))
    samples, decoded = jax.vmap(coder.decode, (0, None, None, 0))(shared, p, state, parts)
    errors = jax.lax.reduce(decoded.errors, jnp.int32(0), jax.lax.bitwise_or, (0,))
    errors = errors | jnp.where(ok, 0, ERR_LENGTH).astype(jnp.int32)
    return samples, decoded, errors


def _or_all(errors: jax.Array) -> jax.Array:
    return jax.lax.reduce(errors.reshape(-1), jnp.int32(0), jax.lax.bitwise_or, (0,))


def _flat(tree, n: int):
    return jax.tree.map(lambda a: a.reshape((n, *a.shape[2:])), tree)


# --------------------------------------------------------------------------------------------------
# the client's local work (shared by every variant)


class BiClientExtra(NamedTuple):
    """Per-client diagnostics.

    Attributes:
      uplink_kl_bits: :math:`D_{KL}(q_i \\| \\hat\\theta_i)` in bits (the ideal rate of one uplink sample).
      broadcast_bits: what this client's downlink costs on a broadcast channel: the bits of the one message
        every client would hear, divided by the ``n`` clients (GR: all ``n`` relayed streams, GR-Reconst:
        the shared stream); the point-to-point length for PR, whose messages are per client.
    """

    uplink_kl_bits: jax.Array
    broadcast_bits: jax.Array


class BiServerInfo(NamedTuple):
    """``theta_mean``: mean of the federator's new :math:`\\theta`; ``downlink_kl_bits``: the KL in bits
    the round's downlink had to convey, mean over participants (GR: :math:`D_{KL}(\\theta_{t+1} \\|
    \\theta_t)`; GR-Reconst and PR: :math:`D_{KL}(\\theta_t \\| \\hat\\theta_{i,t-1})`, the IS target
    against the recipient's prior; 0 when nothing was sent)."""

    theta_mean: jax.Array
    downlink_kl_bits: jax.Array


def _train_and_send(loss_fn, local, estimator, coder, num_samples, keys, received, theta, data):
    """Every variant's client work: Alg. 1 from ``theta`` (the model or estimate just ``received``), then
    ``num_samples`` uplink samples of ``Bern(phi)`` against ``Bern(theta)`` with the coder state received:
    ``(message, ClientInfo)``."""
    train_key, sample_key = client_streams(keys.private)
    phi, linfo = train_mask(loss_fn, local, estimator, received.weights, theta, train_key, data)
    q, p = Bernoulli(phi), Bernoulli(theta)
    message, infos = encode_samples(
        coder, ClientKeys(keys.shared, sample_key), q, p, received.coder, num_samples
    )
    info = ClientInfo(
        loss=linfo.loss,
        finite=linfo.finite & jnp.all(jnp.isfinite(phi)),
        extra=BiClientExtra(jnp.sum(q.kl_bits(p)), received.broadcast_bits),
        valid=jnp.all(jnp.asarray(infos.valid)),
        downlink_errors=received.errors,
    )
    return message, info


def _kl_bits(a, b) -> jax.Array:
    return jnp.sum(Bernoulli(a).kl_bits(Bernoulli(b)), axis=-1)


def _init_common(coder: Coder, key, params: Params):
    weights, theta, u = mask_model_init(key, params)
    return weights, theta, u, coder.init(theta.shape[0])


def _stack(tree, n: int):
    return jax.tree.map(lambda a: jnp.broadcast_to(a, (n, *jnp.shape(a))), tree)


def _check_common(name, coder, estimator, num_uplink_samples, num_clients) -> None:
    if not isinstance(coder, Coder):
        raise TypeError(
            f"coder must be a sidejax.coding.Coder (e.g. klms_coder(...)), got {type(coder).__name__}"
        )
    if not coder.uses_prior:
        raise ValueError(
            f"{name} codes every sample against the receiver's prior; coder {coder.name!r} ignores p "
            "(use klms_coder or klms_avg_coder)"
        )
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
    check_count(num_uplink_samples, "num_uplink_samples")
    if num_uplink_samples > 1 and coder.frame is None:
        raise ValueError(
            f"num_uplink_samples={num_uplink_samples} puts several samples in one stream, which needs a "
            f"self-delimiting coder (Coder.frame); {coder.name!r} has none"
        )
    check_count(num_clients, "num_clients")


def _check_init_clients(name: str, want: int, got: int) -> None:
    if got != want:
        raise ValueError(
            f"{name} was built for num_clients={want} but init got num_clients={got}; build it with the "
            "data's number of clients"
        )


def bicompfl_downlink(block_size: int, log2_num_candidates: int, *, crc32: bool = True) -> Coder:
    """The importance-sampled downlink of GR-Reconst, PR and SplitDL: Fixed-KLMS blocks of ``block_size``
    with :math:`n_{IS}` = ``2 ** log2_num_candidates`` candidates (docs/papers/bicompfl.md#s3-8),
    ``klms_coder(KLMSConfig(adaptive=False, block_size=..., log2_num_candidates=..., crc32=...))``.

    The CRC-32 is on by default: the protocol needs every party to hold bit-identical priors, and the check
    covers a fingerprint of the prior, so a receiver whose estimate has drifted from the federator's copy
    reports ``ERR_CRC`` (``ClientInfo.downlink_errors``) instead of decoding a plausible wrong estimate. It
    costs 32 bits per downlink message (each of the ``n_DL`` samples). ``crc32=False`` gives the paper's bit
    counts, which carry no check (docs/papers/bicompfl.md#dep-extras)."""
    return klms_coder(
        KLMSConfig(
            adaptive=False, block_size=block_size, log2_num_candidates=log2_num_candidates, crc32=crc32
        )
    )


def _check_downlink(downlink: Coder) -> None:
    """The downlink coder codes a (group of the) model against the receiver's estimate, ahead of the uplink
    coder's protocol stream: it must use ``p``, write self-delimiting streams (``frame``: the receiver cuts
    them off) and code a live prefix of a group-sized buffer (``live_prefix``)."""
    if not isinstance(downlink, Coder):
        raise TypeError(
            "downlink must be a sidejax.coding.Coder (e.g. bicompfl_downlink(block_size, "
            f"log2_num_candidates)), got {type(downlink).__name__}"
        )
    if not downlink.uses_prior or downlink.frame is None:
        raise ValueError(
            f"downlink: coder {downlink.name!r} must code against the receiver's prior (uses_prior) and "
            "write self-delimiting streams (Coder.frame), since the uplink coder's protocol stream follows "
            "it; use bicompfl_downlink(block_size, log2_num_candidates)"
        )
    check_live_prefix(downlink, "downlink")


def _metrics(info) -> dict:
    extra = info.clients.extra
    return {
        "uplink_kl_bits": jnp.mean(extra.uplink_kl_bits, axis=-1),
        "downlink_kl_bits": info.server.downlink_kl_bits,
        "broadcast_downlink_bits": jnp.mean(extra.broadcast_bits, axis=-1),
    }


def _where_tree(cond, a, b):
    return jax.tree.map(lambda x, y: jnp.where(cond, x, y), a, b)


def _uplink_aggregate(coder, num_samples, priors, cstate, shared_keys, messages, include=None):
    """Decode every participant's stream against that participant's prior (``priors[C, d]``) and aggregate
    the included ones (``include``, or :func:`sidejax.coding.included` of the streams):
    ``(theta c(k / N_I), coder_state, errors[C], include[C])``; with none included ``theta`` is not
    finite and the coder state is kept (the caller keeps its own)."""
    c = messages.num_bits.shape[0]
    cap = coder.capacity_words(priors.shape[1])  # one message's words, declared by the coder
    samples, decoded, errors = jax.vmap(
        lambda k, prior, m: decode_samples(coder, k, Bernoulli(prior), cstate, m, num_samples, cap)
    )(shared_keys, priors, messages)
    include = included(messages, errors == 0) if include is None else include & (errors == 0)
    decoded = _flat(decoded, c * num_samples)
    decoded = decoded._replace(valid=decoded.valid & jnp.repeat(include, num_samples))
    new_coder, _ = coder.update(cstate, decoded)
    theta = included_clipped_mean(_counts(samples, 1), include, num_samples)
    return theta, new_coder, errors, include


# --------------------------------------------------------------------------------------------------
# BICompFL-GR


class GRServer(NamedTuple):
    """The federator's state in BICompFL-GR.

    Attributes:
      weights: the frozen network (from the global seed).
      theta: :math:`\\theta_t` (float32 ``[d]``), identical at every party.
      eval_uniforms: the fixed evaluation-mask uniforms.
      coder: the uplink coder's protocol state (every client runs the same update on the same streams, so
        it needs no downlink of its own).
      relay: the last round's uplink streams, stacked over clients (payload ``[n, words]``, bits ``[n]``).
      relay_keys: their shared keys' data ``uint32[n, ...]``: *global* shared randomness, which every party
        derives from the global seed, the round and the sender's id (stored so the kernels need not
        re-derive the key schedule).
      has_relay: False in round 0 (nothing to relay yet).
      relay_included: bool ``[n]``: which of the relayed streams the federator's aggregate counted
        (:func:`sidejax.coding.included`). When any is excluded, the relay carries this mask after the
        streams (``n`` bits), so every client rebuilds the same aggregate; with all included it carries
        nothing more (the same bits as without exclusions).
    """

    weights: Params
    theta: jax.Array
    eval_uniforms: jax.Array
    coder: Any
    relay: Message
    relay_keys: jax.Array
    has_relay: jax.Array
    relay_included: jax.Array | None = None


class GRClient(NamedTuple):
    """A client's own memory in BICompFL-GR: its id, its copy of the global model (the prior it decodes
    against) and of the coder's protocol state, and its last uplink stream (it decodes its own samples like
    everybody else's)."""

    client_id: jax.Array
    theta: jax.Array
    coder: Any
    message: Message


class _GRReceived(NamedTuple):
    weights: Params
    theta: jax.Array
    coder: Any
    errors: jax.Array
    broadcast_bits: jax.Array


def _unless_live(message: Message, live) -> Message:
    """``message`` when ``live``, else the empty message with its buffer zeroed (the :class:`Message`
    contract: no set bit past ``num_bits``, which a transport's :func:`sidejax.coding.sent_message`
    checks)."""
    return Message(jnp.where(live, message.payload, 0), jnp.where(live, message.num_bits, 0))


def _gr_init(coder, num_samples, want_clients, key, params, num_clients):
    _check_init_clients("bicompfl_gr", want_clients, num_clients)
    weights, theta, u, cstate = _init_common(coder, key, params)
    words = samples_words(coder.capacity_words(theta.shape[0]), num_samples)
    empty = Message(jnp.zeros((num_clients, words), jnp.uint32), jnp.zeros(num_clients, BITS_DTYPE))
    key_data = jnp.zeros((num_clients, *jax.random.key_data(key).shape), jnp.uint32)
    server = GRServer(
        weights, theta, u, cstate, empty, key_data, jnp.asarray(False), jnp.ones(num_clients, bool)
    )
    ids = jnp.arange(num_clients, dtype=jnp.int32)
    clients = GRClient(ids, _stack(theta, num_clients), _stack(cstate, num_clients), empty)
    return initial_round_state(server, clients, num_clients)


def _gr_broadcast(dkey, server: GRServer, client_ids):
    """Per participant ``j``: the other clients' last uplink streams back to back (no length fields), then,
    only when the federator excluded any of them, the ``n``-bit mask of the included ones
    (``GRServer.relay_included``; a receiver knows it is there when the message is ``n`` bits longer than
    its ``n - 1`` framed streams)."""
    del dkey
    n = server.relay.num_bits.shape[0]
    mask = Message(pack_fixed(server.relay_included.astype(jnp.uint32), 1), as_bits(n))
    excluded = ~jnp.all(server.relay_included)

    def one(j):
        streams = concat_stacked(server.relay, jnp.arange(n) != j)
        marked = concat_messages(streams, mask)
        words = jnp.pad(streams.payload, (0, marked.payload.shape[0] - streams.payload.shape[0]))
        payload = jnp.where(excluded, marked.payload, words)
        num_bits = jnp.where(excluded, marked.num_bits, streams.num_bits)
        return _unless_live(Message(payload, num_bits), server.has_relay)

    return server, jax.vmap(one)(client_ids)


def _gr_rebuild(coder, num_samples, theta, cstate, messages: Message, keys_data, include=None):
    """Every party's reconstruction: decode all ``n`` clients' streams against ``theta`` and average the
    included ones (``include``: the federator's mask; ``None``: :func:`sidejax.coding.included`);
    ``((theta_next, coder_state), errors[n], include[n])``, the previous model and coder state when none is
    included."""
    n = messages.num_bits.shape[0]
    shared = jax.vmap(canonicalize_key)(keys_data)
    priors = jnp.broadcast_to(theta, (n, theta.shape[0]))
    new, new_coder, errors, include = _uplink_aggregate(
        coder, num_samples, priors, cstate, shared, messages, include
    )
    return keep_unless_none(include, (new, new_coder), (theta, cstate)), errors, include


def _composite_frame(coder: Coder, num_samples: int):
    """The length of one client's stream (``num_samples`` self-delimiting parts)."""
    if num_samples == 1:
        return coder.frame

    def frame(state, words, offset):
        def body(o, _):
            return o + as_bits(coder.frame(state, words, o)), None

        start = as_bits(offset)
        end, _ = jax.lax.scan(body, start, None, length=num_samples)
        return end - start

    return frame


def _gr_receive(coder, num_samples, dkey, keys, server: GRServer, me: GRClient, message: Message):
    """Client ``j`` cuts the relay into the ``n - 1`` other streams with the coder's ``frame``, puts its own
    last stream at position ``j``, decodes all ``n`` against its *own* prior with the global shared
    randomness, and rebuilds the model and the coder's protocol state."""
    del dkey, keys
    n = server.relay.num_bits.shape[0]
    cap = me.message.payload.shape[-1]
    others, ok = split_stacked(message, _composite_frame(coder, num_samples), me.coder, n - 1, cap)
    # the n - 1 framed streams, then (only when the federator excluded any) its n-bit mask of included ones
    end = jnp.sum(others.num_bits)
    words = jnp.pad(jnp.asarray(message.payload, jnp.uint32), (0, -(-n // 32) + 1))
    _, clean_tail = mask_to_length(words, message.num_bits)
    marked = (as_bits(message.num_bits) == end + n) & jnp.all(others.num_bits <= 32 * cap) & clean_tail
    include = jnp.where(marked, unpack_fixed(words, n, 1, bit_offset=end) == 1, True)
    ok = ok | marked
    idx = jnp.arange(n)
    src = jnp.clip(jnp.where(idx < me.client_id, idx, idx - 1), 0, max(n - 2, 0))
    mine = idx == me.client_id

    def place(a, own):
        return jnp.where(mine.reshape((n,) + (1,) * (a.ndim - 1)), own, a[src])

    everyone = Message(place(others.payload, me.message.payload), place(others.num_bits, me.message.num_bits))
    (theta, cstate), errors, _ = _gr_rebuild(
        coder, num_samples, me.theta, me.coder, everyone, server.relay_keys, include
    )
    errors = _or_all(jnp.where(include, errors, 0)) | jnp.where(ok, 0, ERR_LENGTH).astype(jnp.int32)
    live = server.has_relay
    return _GRReceived(
        weights=server.weights,
        theta=jnp.where(live, theta, me.theta),
        coder=_where_tree(live, cstate, me.coder),
        errors=jnp.where(live, errors, 0),
        broadcast_bits=jnp.where(live, (message.num_bits + me.message.num_bits) / n, 0.0),
    )


def _gr_client_update(loss_fn, local, estimator, coder, num_samples, keys, received: _GRReceived, me, data):
    message, info = _train_and_send(
        loss_fn, local, estimator, coder, num_samples, keys, received, received.theta, data
    )
    return me._replace(theta=received.theta, coder=received.coder, message=message), message, info


def _gr_track(view: GRServer, received: _GRReceived, round_index, rkey, client_ids) -> GRServer:
    """A GR client's view of the federator's state after a round (:attr:`sidejax.fl.Algorithm.track_server`):
    the next relay holds this round's streams, whose shared keys every party derives from the round key and
    the senders' ids; the rest of what ``_gr_receive`` reads from the state (the frozen weights, the relay's
    shape) is fixed from ``init``."""
    del received, round_index
    keys = jax.vmap(client_keys, (None, 0))(rkey, client_ids)
    return view._replace(relay_keys=jax.random.key_data(keys.shared), has_relay=jnp.asarray(True))


def _gr_server_update(coder, num_samples, rkey, server: GRServer, client_ids, shared_keys, messages, weights):
    del rkey, client_ids, weights  # unweighted mean [P]
    keys_data = jax.random.key_data(shared_keys)
    (theta, cstate), errors, include = _gr_rebuild(
        coder, num_samples, server.theta, server.coder, messages, keys_data
    )
    # a withheld stream (no length) is relayed as its bits cut by the coder's frame, so that the receivers
    # can frame every part; the mask tells them it does not count
    frame = _composite_frame(coder, num_samples)
    framed = jax.vmap(lambda w: as_bits(frame(server.coder, w, 0)))(jnp.asarray(messages.payload, jnp.uint32))
    cap_bits = 32 * messages.payload.shape[-1]
    lengths = jnp.where(as_bits(messages.num_bits) >= 0, messages.num_bits, jnp.clip(framed, 0, cap_bits))
    new = server._replace(
        theta=theta,
        coder=cstate,
        relay=Message(messages.payload, lengths.astype(BITS_DTYPE)),
        relay_keys=keys_data,
        has_relay=jnp.asarray(True),
        relay_included=include,
    )
    return new, BiServerInfo(jnp.mean(theta), _kl_bits(theta, server.theta)), errors


def bicompfl_gr(
    loss_fn: Callable,
    local: LocalTraining,
    *,
    num_clients: int,
    coder: Coder,
    num_uplink_samples: int = 1,
    estimator: str = "fedpm",
    eval_mask: str = "sample",
) -> Algorithm:
    """BICompFL-GR (Alg. 2): global shared randomness; the federator relays the clients' uplink streams.

    Every party decodes every client's samples (their candidates come from the global seed) against the
    common prior :math:`\\theta_t` and sets :math:`\\theta_{t+1} = c(\\text{mean})`, so the clients' models
    equal the federator's bit for bit (docs/papers/bicompfl.md#s7-9; client ``j`` uses its *own* decoded
    samples, not :math:`q_j`). Downlink: the other ``n - 1`` clients' streams back to back, ``(n - 1)`` times
    the uplink. Requires full participation [P] (every client must hear every round).

    Args:
      loss_fn: ``loss_fn(params, batch, key)`` of the masked network.
      local: the mask training (:class:`sidejax.fl.LocalTraining`; [P] Adam lr 0.1, 3 epochs, batch 128;
        ``optimizer=sidejax.algorithms.mirror.mirror_descent(lr)`` for App. B's mirror-descent reading).
      num_clients: ``n`` (all of them take part every round).
      coder: the uplink coder, a self-delimiting one (``frame``): ``klms_coder(KLMSConfig(adaptive=False,
        ...))`` (GR-Fixed), ``klms_coder(KLMSConfig(...))`` (GR-Adaptive) or ``klms_avg_coder(...)``
        (GR-Adaptive-Avg).
      num_uplink_samples: ``n_UL`` IS samples per client per round ([P] 1).
      estimator: the mask gradient (``"fedpm"`` [C] or ``"ste"``).
      eval_mask: ``"sample"`` or ``"threshold"`` (:func:`sidejax.algorithms.fedpm.fedpm_eval_params`).
    """
    _check_common("bicompfl_gr", coder, estimator, num_uplink_samples, num_clients)
    if coder.frame is None:
        raise ValueError(
            f"BICompFL-GR relays the uplink streams back to back, which needs a self-delimiting coder "
            f"(Coder.frame, e.g. klms_coder); {coder.name!r} has none"
        )
    n_ul = num_uplink_samples
    return Algorithm(
        init=functools.partial(_gr_init, coder, n_ul, num_clients),
        broadcast=_gr_broadcast,
        receive=functools.partial(_gr_receive, coder, n_ul),
        client_update=functools.partial(_gr_client_update, loss_fn, local, estimator, coder, n_ul),
        server_update=functools.partial(_gr_server_update, coder, n_ul),
        evaluation=Evaluation(functools.partial(fedpm_eval_params, eval_mask)),
        clients_per_round=num_clients,
        metrics=_metrics,
        track_server=_gr_track,
    )


# --------------------------------------------------------------------------------------------------
# the importance-sampled downlink (GR-Reconst, PR, SplitDL)


class _Group(NamedTuple):
    """One downlink group: the static ``width`` of the buffer every group is coded in (the largest group),
    and the group's ``start`` and ``length`` (its live coordinates, traced)."""

    width: int
    start: jax.Array
    length: jax.Array


def _group_of(downlink: Coder, dim: int, num_groups: int, group) -> _Group:
    """Group ``group`` of ``num_groups`` contiguous groups aligned to the downlink coder's blocks
    (:attr:`sidejax.coding.LivePrefix.block`, :func:`split_groups`); one group is the whole model."""
    b = downlink.live_prefix.block
    bounds = split_groups(-(-dim // b), num_groups)
    width = int(np.max(np.diff(bounds))) * b if num_groups > 1 else dim
    bounds = jnp.asarray(bounds)
    start = bounds[group] * b
    return _Group(width, start, jnp.minimum(bounds[group + 1] * b, dim) - start)


def _sub(vec, g: _Group):
    """``vec[g.start : g.start + g.width]`` from ``vec`` padded with 1/2 past ``d``. In a SplitDL group
    narrower than ``g.width`` the coordinates past ``g.length`` are the next group's; the downlink coder
    carries them in the group's last live block (:attr:`sidejax.coding.LivePrefix.init`), so
    :func:`_downlink_encode` sets the target to the prior there (q = p adds exactly 0 to every log-weight,
    docs/papers/bicompfl.md#s2-1) and the receiver drops their decoded values."""
    padded = jnp.concatenate([vec, jnp.full((g.width,), 0.5, vec.dtype)])
    return jax.lax.dynamic_slice(padded, (g.start,), (g.width,))


def _downlink_encode(downlink: Coder, num_samples: int, keys: ClientKeys, target, prior, g: _Group):
    """``num_samples`` IS samples of ``Bern(target)`` against ``Bern(prior)`` on group ``g``, and what the
    receiver will decode from them (the sender knows its choice): ``(message, new_prior, errors)``."""
    state = downlink.live_prefix.init(g.width, g.length)
    p = _sub(prior, g)
    mine = jnp.arange(g.width) < g.length  # the group's own coordinates; q = p on the rest
    q, p = Bernoulli(jnp.where(mine, _sub(target, g), p)), Bernoulli(p)
    message, _ = encode_samples(downlink, keys, q, p, state, num_samples)
    new_prior, errors = _downlink_decode(downlink, num_samples, keys.shared, prior, g, state, message)
    return message, new_prior, errors


def _downlink_decode(downlink: Coder, num_samples: int, shared_key, prior, g: _Group, state, message):
    """The receiver: decode the samples (coded with the downlink coder's ``state`` for ``g``) against its
    own ``prior`` and refresh exactly the group's coordinates with :math:`c(\\text{mean})`;
    ``(new_prior, errors)``."""
    p = Bernoulli(_sub(prior, g))
    cap = downlink.capacity_words(g.width)
    samples, _, errors = decode_samples(downlink, shared_key, p, state, message, num_samples, cap)
    fresh = clipped_mean(_counts(samples, 0), num_samples)
    pos = g.start + jnp.arange(g.width)
    upd = jnp.zeros(prior.shape[0] + g.width, prior.dtype).at[pos].set(fresh)[: prior.shape[0]]
    coords = jnp.arange(prior.shape[0])
    inside = (coords >= g.start) & (coords < g.start + g.length)
    return jnp.where(inside, upd, prior), errors


# --------------------------------------------------------------------------------------------------
# BICompFL-GR-Reconst-Fixed


class ReconstServer(NamedTuple):
    """The federator's state in BICompFL-GR-Reconst.

    Attributes:
      weights, eval_uniforms: as in :class:`GRServer`.
      theta: :math:`\\theta_{t+1}`, the federator's exact aggregate (what the downlink samples target).
      theta_hat: :math:`\\hat\\theta_t`, the common estimate every party holds (the prior both ways).
      coder: the uplink coder's protocol state.
      fresh: a new aggregate waits to be sent (False in round 0).
      downlink_kl_bits: :math:`D_{KL}(\\theta \\| \\hat\\theta)` of the last downlink (diagnostic).
    """

    weights: Params
    theta: jax.Array
    theta_hat: jax.Array
    eval_uniforms: jax.Array
    coder: Any
    fresh: jax.Array
    downlink_kl_bits: jax.Array


class EstimateClient(NamedTuple):
    """A client's memory in BICompFL-PR and GR-Reconst: its id and its estimate
    :math:`\\hat\\theta_{i,t}` of the global model (the prior of both directions)."""

    client_id: jax.Array
    theta_hat: jax.Array


class _Received(NamedTuple):
    weights: Params
    theta_hat: jax.Array
    coder: Any
    errors: jax.Array
    broadcast_bits: jax.Array


def _reconst_init(coder, want_clients, key, params, num_clients):
    _check_init_clients("bicompfl_gr_reconst", want_clients, num_clients)
    weights, theta, u, cstate = _init_common(coder, key, params)
    server = ReconstServer(weights, theta, theta, u, cstate, jnp.asarray(False), jnp.float32(0.0))
    clients = EstimateClient(jnp.arange(num_clients, dtype=jnp.int32), _stack(theta, num_clients))
    return initial_round_state(server, clients, num_clients)


def _reconst_broadcast(coder, downlink, num_dl, num_clients, dkey, server: ReconstServer, client_ids):
    """One broadcast: ``n_DL`` IS samples of :math:`\\theta_{t+1}` against :math:`\\hat\\theta_t`
    (:func:`sidejax.keys.downlink_keys` ``(dkey)``), then the uplink coder's protocol stream; the
    federator sets its own :math:`\\hat\\theta_{t+1}` from the samples it chose."""
    del num_clients, client_ids
    g = _group_of(downlink, server.theta.shape[0], 1, 0)
    keys = downlink_keys(dkey)
    msg, theta_hat, _ = _downlink_encode(downlink, num_dl, keys, server.theta, server.theta_hat, g)
    live = server.fresh
    msg = _unless_live(msg, live)
    message = concat_messages(msg, coder.downlink(server.coder))
    kl = jnp.where(live, _kl_bits(server.theta, server.theta_hat), 0.0)
    new = server._replace(theta_hat=jnp.where(live, theta_hat, server.theta_hat), downlink_kl_bits=kl)
    return new, message


def _reconst_receive(coder, downlink, num_dl, num_clients, dkey, keys, server: ReconstServer, me, message):
    """Every client decodes the same samples against its own (common) estimate."""
    del keys
    g = _group_of(downlink, me.theta_hat.shape[0], 1, 0)
    shared = downlink_keys(dkey).shared
    # one stream heard by all n clients
    return _downlink_receive(
        coder, downlink, num_dl, shared, g, server, me, message, message.num_bits / num_clients
    )


def _cut(message: Message, head_bits, head_words: int) -> tuple[Message, Message]:
    """Cuts ``message`` after its first ``head_bits`` bits (traced): ``(head, rest)``; the head's buffer holds
    ``head_words`` words, the rest's the remaining capacity."""
    words = jnp.asarray(message.payload, jnp.uint32)
    n = words.shape[0]
    words, _ = mask_to_length(words, message.num_bits)
    padded = jnp.pad(words, (0, head_words + 1))
    head = unpack_fixed(padded, head_words, 32)
    head, _ = mask_to_length(head, jnp.minimum(head_bits, 32 * head_words))
    rest = unpack_fixed(padded, n, 32, bit_offset=jnp.asarray(head_bits, jnp.int32))
    return Message(head, as_bits(head_bits)), Message(rest, as_bits(message.num_bits) - head_bits)


def _downlink_receive(
    coder: Coder,
    downlink: Coder,
    num_samples: int,
    shared_key,
    g: _Group,
    server: ReconstServer | PRServer,
    me: EstimateClient,
    message: Message,
    broadcast_bits,
) -> _Received:
    """A receiver's side of one downlink message (:func:`_downlink_encode`'s samples, then the uplink coder's
    protocol stream), for GR-Reconst and PR alike: the samples' length is read with the downlink coder's
    ``frame`` from the state both ends build for ``g`` (none was sent unless ``server.fresh``); they are
    decoded against the client's estimate ``me.theta_hat``, which they replace (it stays, with no error, when
    nothing was sent); the rest is the uplink ``coder``'s protocol stream. ``broadcast_bits`` is the
    message's cost per client, as the variant counts it."""
    prior, live = me.theta_hat, server.fresh
    state = downlink.live_prefix.init(g.width, g.length)
    head_bits = jnp.where(
        live, as_bits(_composite_frame(downlink, num_samples)(state, message.payload, 0)), 0
    )
    head_words = samples_words(downlink.capacity_words(g.width), num_samples)
    head, rest = _cut(message, head_bits, head_words)
    new, errors = _downlink_decode(downlink, num_samples, shared_key, prior, g, state, head)
    return _Received(
        weights=server.weights,
        theta_hat=jnp.where(live, new, prior),
        coder=coder.receive(server.coder, rest),
        errors=jnp.where(live, errors, 0),
        broadcast_bits=broadcast_bits,
    )


# --------------------------------------------------------------------------------------------------
# BICompFL-PR and PR-Fixed-SplitDL


class PRServer(NamedTuple):
    """The federator's state in BICompFL-PR.

    Attributes:
      weights, eval_uniforms: as in :class:`GRServer`.
      theta: :math:`\\theta_{t+1}`, the federator's aggregate (the model evaluated,
        docs/papers/bicompfl.md#s8-9).
      theta_hat: float32 ``[n, d]``: the federator's copy of every client's estimate
        :math:`\\hat\\theta_{i,t}` (decoded from the messages it sent; equal to the client's own bit for bit).
      coder: the uplink coder's protocol state.
      fresh: a new aggregate waits to be sent (False in round 0).
      round: int32, rounds completed (public: picks the SplitDL groups).
      downlink_kl_bits: mean over the last downlink's recipients of :math:`D_{KL}(\\theta \\| \\hat\\theta_i)`
        on the coordinates sent (diagnostic).
    """

    weights: Params
    theta: jax.Array
    theta_hat: jax.Array
    eval_uniforms: jax.Array
    coder: Any
    fresh: jax.Array
    round: jax.Array
    downlink_kl_bits: jax.Array


def _pr_init(coder, want_clients, key, params, num_clients):
    _check_init_clients("bicompfl_pr", want_clients, num_clients)
    weights, theta, u, cstate = _init_common(coder, key, params)
    hats = _stack(theta, num_clients)
    server = PRServer(weights, theta, hats, u, cstate, jnp.asarray(False), jnp.int32(0), jnp.float32(0.0))
    clients = EstimateClient(jnp.arange(num_clients, dtype=jnp.int32), hats)
    return initial_round_state(server, clients, num_clients)


class _Split(NamedTuple):
    """PR's static downlink split: ``groups`` SplitDL groups (1: PR's full downlink) for the downlinks of
    the rounds ``t < rounds`` (``None``: every round); later rounds send the full model (the hybrid)."""

    groups: int
    rounds: int | None = None


def _pr_group(downlink, split: _Split, dim, round_index, client_id) -> _Group:
    """Client ``client_id``'s downlink group in round ``round_index``: group ``(j + t) mod n`` of the
    SplitDL groups, or the whole model (PR, or the hybrid from round ``split.rounds`` on). The hybrid codes
    both phases in one buffer of the whole model's width (a static shape for every round): a split round
    codes the group's blocks as the buffer's live prefix (:attr:`sidejax.coding.Coder.live_prefix`), so its
    message is as long as SplitDL's, and a full round is PR's group exactly."""
    g = _group_of(downlink, dim, split.groups, (client_id + round_index) % split.groups)
    if split.rounds is None:
        return g
    full = round_index >= split.rounds
    return _Group(dim, jnp.where(full, 0, g.start), jnp.where(full, dim, g.length))


def _pr_broadcast(coder, downlink, num_dl, split: _Split, dkey, server: PRServer, client_ids):
    """Per participant ``i``: ``n_DL`` IS samples of :math:`\\theta_{t+1}` (on ``i``'s group for SplitDL)
    against the federator's copy of :math:`\\hat\\theta_{i,t}`, with randomness only the two share
    (:func:`sidejax.keys.downlink_keys` ``(dkey, i)``), then the uplink coder's protocol stream. The
    federator updates its copy from the samples it chose. Participants are coded one at a time
    (``lax.map``: the encoder's memory budget holds for any number of clients)."""
    dim = server.theta.shape[0]
    live = server.fresh
    proto = coder.downlink(server.coder)

    def one(i):
        g = _pr_group(downlink, split, dim, server.round, i)
        hat = server.theta_hat[i]
        msg, new_hat, _ = _downlink_encode(downlink, num_dl, downlink_keys(dkey, i), server.theta, hat, g)
        msg = _unless_live(msg, live)
        coords = jnp.arange(dim)
        inside = (coords >= g.start) & (coords < g.start + g.length)
        kl = jnp.sum(jnp.where(inside, Bernoulli(server.theta).kl_bits(Bernoulli(hat)), 0.0))
        return concat_messages(msg, proto), jnp.where(live, new_hat, hat), kl

    msgs, hats, kls = jax.lax.map(one, client_ids)
    new = server._replace(
        theta_hat=server.theta_hat.at[client_ids].set(hats),
        downlink_kl_bits=jnp.where(live, jnp.mean(kls), 0.0),
    )
    return new, msgs


def _pr_receive(
    coder, downlink, num_dl, split: _Split, dkey, keys, server: PRServer, me: EstimateClient, message
):
    """Client ``i`` decodes its samples against its *own* estimate (the group from the public round index)
    and refreshes exactly the group's coordinates."""
    del keys
    g = _pr_group(downlink, split, me.theta_hat.shape[0], server.round, me.client_id)
    shared = downlink_keys(dkey, me.client_id).shared
    # per-client messages: no broadcast saving
    return _downlink_receive(coder, downlink, num_dl, shared, g, server, me, message, message.num_bits)


def _hat_client_update(loss_fn, local, estimator, coder, num_samples, keys, received: _Received, me, data):
    """GR-Reconst and PR clients: Alg. 1 from the estimate just received, uplink against it."""
    message, info = _train_and_send(
        loss_fn, local, estimator, coder, num_samples, keys, received, received.theta_hat, data
    )
    return me._replace(theta_hat=received.theta_hat), message, info


def _reconst_track(view, received: _Received | None, round_index, rkey, client_ids):
    """A GR-Reconst client's view of the federator's state after a round
    (:attr:`sidejax.fl.Algorithm.track_server`): the uplink coder's protocol state it received (kept when it
    was not a recipient: a stateful uplink coder's protocol is then followed by participants only) and a
    fresh aggregate to come (the federator's ``fresh``, True from its first aggregate on). The view assumes
    that the round aggregated some participant: a round with none included leaves the federator's state as
    it was (a downlink of 0 sample bits), which a client sees as a stream error in the next round, not as a
    wrong sample."""
    del round_index, rkey, client_ids
    coder = view.coder if received is None else received.coder  # None: not a recipient of this round
    return view._replace(coder=coder, fresh=jnp.asarray(True))


def _pr_track(view, received: _Received | None, round_index, rkey, client_ids):
    """A PR client's view: GR-Reconst's (:func:`_reconst_track`) and the rounds completed (``round``, which
    picks the SplitDL groups), under the same assumption."""
    view = _reconst_track(view, received, round_index, rkey, client_ids)
    return view._replace(round=jnp.asarray(round_index + 1, view.round.dtype))


def _reconst_server_update(
    coder, num_samples, rkey, server: ReconstServer, ids, shared_keys, messages, weights
):
    del rkey, weights
    priors = jnp.broadcast_to(server.theta_hat, (ids.shape[0], server.theta_hat.shape[0]))
    theta, cstate, errors, include = _uplink_aggregate(
        coder, num_samples, priors, server.coder, shared_keys, messages
    )
    new = keep_unless_none(
        include, server._replace(theta=theta, coder=cstate, fresh=jnp.asarray(True)), server
    )
    return new, BiServerInfo(jnp.mean(new.theta), server.downlink_kl_bits), errors


def _pr_server_update(coder, num_samples, rkey, server: PRServer, ids, shared_keys, messages, weights):
    """Decode each participant against the federator's copy of its estimate; average over participants."""
    del rkey, weights
    theta, cstate, errors, include = _uplink_aggregate(
        coder, num_samples, server.theta_hat[ids], server.coder, shared_keys, messages
    )
    new = server._replace(theta=theta, coder=cstate, fresh=jnp.asarray(True), round=server.round + 1)
    new = keep_unless_none(include, new, server)
    return new, BiServerInfo(jnp.mean(new.theta), server.downlink_kl_bits), errors


def bicompfl_gr_reconst(
    loss_fn: Callable,
    local: LocalTraining,
    *,
    num_clients: int,
    coder: Coder,
    downlink: Coder,
    num_uplink_samples: int = 1,
    num_downlink_samples: int | None = None,
    estimator: str = "fedpm",
    eval_mask: str = "sample",
) -> Algorithm:
    """BICompFL-GR-Reconst-Fixed (docs/papers/bicompfl.md#s3-4): the uplink as in GR; the federator
    reconstructs :math:`\\theta_{t+1}` and broadcasts ``n_DL`` IS samples of it against the common
    :math:`\\hat\\theta_t` (one stream for every client); every party sets
    :math:`\\hat\\theta_{t+1} = c(\\text{mean})`. The priors stay common (:math:`\\zeta = 0`) but the
    downlink adds sampling noise. Requires full participation [P].

    ``loss_fn``, ``local``, ``estimator`` and ``eval_mask`` are as in :func:`bicompfl_gr`.

    Args:
      num_clients: ``n``.
      coder: the uplink coder (any coder that uses ``p``; ``klms_coder(KLMSConfig(adaptive=False, ...))``).
      downlink: the downlink coder, :func:`bicompfl_downlink` ``(b, log2 n_IS)`` (Fixed-KLMS with the CRC-32
        that keeps the parties' priors in check; ``crc32=False`` for the paper's bit counts). Any coder
        that uses ``p``, frames its streams and declares a :attr:`sidejax.coding.Coder.live_prefix`.
      num_uplink_samples: ``n_UL`` ([P] 1).
      num_downlink_samples: ``n_DL`` (default ``n * n_UL`` [P]).

    The evaluated model is the federator's :math:`\\theta_{t+1}`.
    """
    _check_common("bicompfl_gr_reconst", coder, estimator, num_uplink_samples, num_clients)
    return _downlink_algorithm(
        (_reconst_init, _reconst_broadcast, _reconst_receive, _reconst_server_update, _reconst_track),
        num_clients,  # the downlink kernels' n
        (loss_fn, local, estimator, eval_mask, coder, num_uplink_samples),
        downlink,
        _num_dl(num_downlink_samples, num_clients, num_uplink_samples),
        num_clients=num_clients,
        clients_per_round=num_clients,
    )


def _num_dl(num_downlink_samples, num_clients, num_uplink_samples) -> int:
    if num_downlink_samples is None:
        return num_clients * num_uplink_samples
    return check_count(num_downlink_samples, "num_downlink_samples")


def _downlink_algorithm(
    kernels, arg, client, downlink, num_dl, *, num_clients, clients_per_round
) -> Algorithm:
    """The :class:`sidejax.fl.Algorithm` of a variant with an importance-sampled downlink (GR-Reconst, PR):
    its ``kernels`` ``(init, broadcast, receive, server_update, track_server)`` bound to the uplink coder, the
    checked ``downlink`` coder and its ``num_dl`` samples; ``arg`` is the downlink kernels' own static
    argument (GR-Reconst: ``n``, PR: its :class:`_Split`). ``client`` is the builder's
    ``(loss_fn, local, estimator, eval_mask, coder, num_uplink_samples)``; the clients' work is
    :func:`_hat_client_update`."""
    _check_downlink(downlink)
    init, broadcast, receive, server_update, track_server = kernels
    loss_fn, local, estimator, eval_mask, coder, num_ul = client
    return Algorithm(
        init=functools.partial(init, coder, num_clients),
        broadcast=functools.partial(broadcast, coder, downlink, num_dl, arg),
        receive=functools.partial(receive, coder, downlink, num_dl, arg),
        client_update=functools.partial(_hat_client_update, loss_fn, local, estimator, coder, num_ul),
        server_update=functools.partial(server_update, coder, num_ul),
        evaluation=Evaluation(functools.partial(fedpm_eval_params, eval_mask)),
        clients_per_round=clients_per_round,
        metrics=_metrics,
        track_server=track_server,
    )


def bicompfl_pr(
    loss_fn: Callable,
    local: LocalTraining,
    *,
    num_clients: int,
    coder: Coder,
    downlink: Coder,
    clients_per_round: int | None = None,
    num_uplink_samples: int = 1,
    num_downlink_samples: int | None = None,
    split_downlink: bool = False,
    split_rounds: int | None = None,
    estimator: str = "fedpm",
    eval_mask: str = "sample",
) -> Algorithm:
    """BICompFL-PR (Alg. 3) and PR-Fixed-SplitDL (docs/papers/bicompfl.md#s3-5): private shared randomness per
    client.

    Client ``i`` codes its uplink against its own estimate :math:`\\hat\\theta_{i,t}`; the federator
    decodes it with its copy, aggregates :math:`\\theta_{t+1}` over the participants, and sends each
    participant ``n_DL`` IS samples of :math:`\\theta_{t+1}` against that client's estimate, with randomness
    only the two share. Estimates differ across clients (:math:`\\zeta > 0`); the federator's copies equal
    the clients' own bit for bit (docs/papers/bicompfl.md#s7-10). Partial participation is allowed [P]: a
    client that sits a round out keeps its estimate, and so does the federator's copy.

    With ``split_downlink=True`` (PR-Fixed-SplitDL) the downlink blocks are split into ``n`` contiguous
    block-aligned groups and client ``j`` receives only group :math:`(j + t) \\bmod n` in round ``t``: the
    other coordinates keep :math:`\\hat\\theta_{j,t}`, every coordinate is refreshed within ``n`` rounds, and
    the downlink costs ``1/n`` of PR's (docs/papers/bicompfl.md#s3-6 [A]: the paper does not give the rule).

    With ``split_rounds=S`` as well, the paper's suggested hybrid (split early, full later; it gives no
    switch rule and did not run it, docs/papers/bicompfl.md#splitdl-hybrid): the downlink carrying
    :math:`\\theta_t` is SplitDL's for :math:`t < S` and PR's for :math:`t \\ge S`. Both phases are coded in
    one buffer of the whole model (a split round's group is its live prefix), so a split round equals
    SplitDL's round bit for bit and a full round equals PR's from the same state; the encoder works on the
    whole model in both phases. The presets' ``S = n + 1`` is one rotation: the downlinks of
    :math:`\\theta_1 .. \\theta_n` refresh every coordinate once against :math:`\\theta_0`; from the second
    rotation on a split refresh is coded against an ``n``-round-old estimate and measurably cannot close the
    gap (docs/papers/bicompfl.md#splitdl-why).

    ``loss_fn``, ``local``, ``estimator`` and ``eval_mask`` are as in :func:`bicompfl_gr`.

    Args:
      num_clients: ``n``.
      coder: the uplink coder (``klms_coder(KLMSConfig(adaptive=False, ...))`` [P]).
      downlink: the downlink coder, as :func:`bicompfl_gr_reconst`; SplitDL's groups are aligned to its
        blocks (:attr:`sidejax.coding.LivePrefix.block`).
      clients_per_round: participants per round (default ``n``).
      num_uplink_samples: ``n_UL`` ([P] 1).
      num_downlink_samples: ``n_DL`` (default ``n * n_UL`` [P]).
      split_downlink: PR-Fixed-SplitDL.
      split_rounds: with ``split_downlink``, the hybrid: only the downlinks of the rounds
        :math:`t <` ``split_rounds`` are split, every later one is PR's full downlink (``None``: every
        round is split). ``t`` is the public count of aggregates made (``PRServer.round``), so the downlink
        carrying :math:`\\theta_t` is split for :math:`t <` ``split_rounds``.

    The evaluated model is the federator's :math:`\\theta_{t+1}` (docs/papers/bicompfl.md#s8-9).
    """
    _check_common("bicompfl_pr", coder, estimator, num_uplink_samples, num_clients)
    cpr = num_clients if clients_per_round is None else clients_per_round
    if split_rounds is not None:
        if not split_downlink:
            raise ValueError(
                f"split_rounds={split_rounds!r} sets the rounds of a split downlink, which needs "
                "split_downlink=True"
            )
        split_rounds = check_count(split_rounds, "split_rounds")
    return _downlink_algorithm(
        (_pr_init, _pr_broadcast, _pr_receive, _pr_server_update, _pr_track),
        _Split(num_clients, split_rounds) if split_downlink else _Split(1),  # SplitDL's groups
        (loss_fn, local, estimator, eval_mask, coder, num_uplink_samples),
        downlink,
        _num_dl(num_downlink_samples, num_clients, num_uplink_samples),
        num_clients=num_clients,
        clients_per_round=check_count(cpr, "clients_per_round", 1, num_clients),
    )
