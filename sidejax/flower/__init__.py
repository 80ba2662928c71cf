"""sidejax between real processes: the round engine's parties apart, exchanging sidejax's packed streams.

- :mod:`sidejax.flower.envelope`: the bytes a message travels in (header: kind, round, client, capacity,
  error bits, CRC-32, configuration fingerprint; then the stream);
- :mod:`sidejax.flower.party`: :class:`ServerParty` and :class:`ClientParty`, transport-free (bytes in,
  bytes out), and :func:`loopback_round`, the in-process reference transport;
- :mod:`sidejax.flower.apps`: the Flower ``ServerApp`` / ``ClientApp`` around them (needs the optional
  extra: ``pip install "sidejax[flower]"``).

See ``docs/deploying.md``.
"""

from sidejax.flower import envelope, party
from sidejax.flower.envelope import *
from sidejax.flower.party import *

__all__ = [*envelope.__all__, *party.__all__]
