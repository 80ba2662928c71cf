"""The dense skeleton (sidejax.algorithms.dense) shared by QSGD, SignSGD, QLSD and SGLD: its downlink is one
real message (float32 parameters, the prior's side information when the coder decodes with ``p``, the coder's
protocol stream) whose length is the round's ``downlink_bits``, and which the clients decode into the server's
state."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import SMALL_KLMS, assert_clients_rebuild_the_server

from sidejax.algorithms import dense_algorithm
from sidejax.layout import flat_layout


def test_downlink_bits_are_the_broadcast_lengths(algorithm_run, small_model):
    """32 d bits of parameters; with QSGD-KLMS (whose coder decodes with ``p``) the last round's symbol
    counts, 2 ceil(log2(C + 1)) d bits, and the 1-bit history flag; then the KLMS protocol: 1 + M
    log2(max_block_size) bits in the round after an update round (M the new partition's blocks), else the
    1-bit flag. Coders without ``p`` or protocol state (QSGD's Elias coder, SignSGD's fixed-width signs,
    QLSD) send the parameters only."""
    d = flat_layout(small_model[1]).dim
    for name in ("qsgd", "signsgd", "qlsd"):
        np.testing.assert_array_equal(algorithm_run(name)[3].downlink_bits, 32.0 * d, err_msg=name)
    counts_bits = 2 * math.ceil(math.log2(5 + 1)) * d + 1  # the counts, then the 1-bit history flag
    for name, prior_bits in (("qsgd_klms", counts_bits), ("signsgd_klms", 0), ("sgld_klms", 0)):
        infos = algorithm_run(name)[3]
        kinfo = infos.server.coder
        # round t's downlink carries the partition made by round t - 1 when that was an update round
        changed = np.concatenate([[False], np.asarray(kinfo.updated)[:-1]])
        blocks = np.concatenate([[0], np.asarray(kinfo.num_blocks)[:-1]])
        assert changed.any(), name  # round 0 is an update round: round 1 sends its partition
        protocol = 1 + np.where(changed, blocks * SMALL_KLMS.length_bits, 0)
        want = np.broadcast_to((32 * d + prior_bits + protocol)[:, None], infos.downlink_bits.shape)
        np.testing.assert_array_equal(infos.downlink_bits, want.astype(np.float32), err_msg=name)


@pytest.mark.parametrize("name", ["qsgd_klms", "sgld_klms"])
def test_clients_decode_the_broadcast_into_the_servers_state(algorithm_run, name):
    """A client that knows the parameters' shapes and the protocol's earlier flags rebuilds from the message
    alone the parameters (bit for bit), the prior's symbol counts and history flag, and the KLMS state: after
    an update round the partition is parsed from the stream (the client may know only the initial one),
    otherwise it keeps its own."""
    algo, _, final, _ = algorithm_run(name)
    server = final.server

    def client_view(sent, coder):  # zero parameters, no counts, no history
        zero_counts = jax.tree.map(jnp.zeros_like, sent.prior)
        return sent._replace(params=jax.tree.map(jnp.zeros_like, sent.params), prior=zero_counts, coder=coder)

    assert_clients_rebuild_the_server(algo, server, flat_layout(server.params).dim, client_view)
    if name == "qsgd_klms":
        assert int(np.asarray(server.prior.counts).sum()) > 0  # the counts really travelled


def test_dense_algorithm_needs_a_coder(small_model):
    from sidejax.algorithms.dense import DenseMethod

    method = DenseMethod(None, None, None, None, None)
    with pytest.raises(TypeError, match="coder must be a sidejax.coding.Coder, got KLMSConfig"):
        dense_algorithm(method, SMALL_KLMS, clients_per_round=2)
