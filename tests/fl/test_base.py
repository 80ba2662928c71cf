"""The engine's contracts (sidejax.fl.base): the initial round state and its validation."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from sidejax.fl import ClientInfo, EmptyState, RoundState, initial_round_state


def test_initial_round_state_records_round_zero_and_the_federation():
    server = {"w": jnp.arange(3.0)}
    state = initial_round_state(server, EmptyState(), 7)
    assert isinstance(state, RoundState) and state.server is server and state.clients == EmptyState()
    assert state.round_index.dtype == jnp.int32 and int(state.round_index) == 0
    assert state.num_clients.dtype == jnp.int32 and int(state.num_clients) == 7
    assert int(initial_round_state(server, EmptyState(), np.int64(3)).num_clients) == 3
    assert RoundState(jnp.int32(0), server, EmptyState()).num_clients is None  # hand-built: no check


@pytest.mark.parametrize("bad", [0, -2, 2.0, True, None])
def test_initial_round_state_refuses_a_bad_number_of_clients(bad):
    with pytest.raises(ValueError, match=f"num_clients must be an integer >= 1 .*got {bad!r}"):
        initial_round_state({}, EmptyState(), bad)


def test_client_info_defaults_to_no_extra_and_a_valid_stream():
    info = ClientInfo(loss=jnp.float32(0.5), finite=jnp.asarray(True))
    assert info.extra == () and info.valid is True
