"""Coders: every message a client or the server sends is built here, with its real length in bits.

The contract is :class:`Coder` (:mod:`sidejax.coding.base`): transmit one sample of ``q`` using side
information ``p`` that both ends know. Coders: :func:`klms_coder` (KLMS channel simulation, Fixed and
Adaptive blocks), :func:`klms_avg_coder` (BICompFL's Adaptive-Avg: equal blocks of one adaptive size),
:func:`float32_coder`, :func:`fixed_width_coder`, :func:`elias_coder`, :func:`mask_coder` (sample-then-code
baselines), :func:`pseudocoreset_coder` (BPC-FL's one-shot uplink of a pseudocoreset and its example
count), :func:`scaled_sign_coder` (the deterministic scaled-sign compressor of the error-feedback
baselines), and the combinator :func:`with_side_info`. CEPAM's mechanisms: :func:`lrsuq_coder` (quantization
noise that is exactly Gaussian or Laplace), :func:`sdq_coder`, :func:`additive_noise_coder` and the update
normalisation :func:`clip_update` (:mod:`sidejax.coding.lattice`, per-block quantizers in
:mod:`sidejax.coding.lrsuq`). :mod:`sidejax.coding.importance_law` holds the exact
law of the importance-sampled Bernoulli (block size 1) and BICompFL's bounds on its bias.
:mod:`sidejax.coding.counter` generates the importance-sampling candidates and CEPAM's lattice latents and
dithers (a counter hash, stream format 3), and :mod:`sidejax.coding.wire` writes and reads a message as
bytes with a header that names the format.
"""

from sidejax.coding import (
    base,
    bitstream,
    compress,
    counter,
    importance,
    importance_law,
    klms,
    klms_avg,
    lattice,
    lossless,
    lrsuq,
    pseudocoreset,
    sample,
    wire,
)
from sidejax.coding.base import *
from sidejax.coding.bitstream import *
from sidejax.coding.compress import *
from sidejax.coding.counter import *
from sidejax.coding.importance import *
from sidejax.coding.importance_law import *
from sidejax.coding.klms import *
from sidejax.coding.klms_avg import *
from sidejax.coding.lattice import *
from sidejax.coding.lossless import *
from sidejax.coding.lrsuq import *
from sidejax.coding.pseudocoreset import *
from sidejax.coding.sample import *
from sidejax.coding.wire import *

# every submodule's public names (its __all__), declared once there
__all__ = [
    *base.__all__,
    *bitstream.__all__,
    *compress.__all__,
    *counter.__all__,
    *importance.__all__,
    *importance_law.__all__,
    *klms.__all__,
    *klms_avg.__all__,
    *lattice.__all__,
    *lossless.__all__,
    *lrsuq.__all__,
    *pseudocoreset.__all__,
    *sample.__all__,
    *wire.__all__,
]
