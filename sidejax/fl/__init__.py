"""The federated round engine, local training and evaluation (the algorithms are in
:mod:`sidejax.algorithms`)."""

from sidejax.fl import base, evaluate, local, roles, rounds
from sidejax.fl.base import *
from sidejax.fl.evaluate import *
from sidejax.fl.local import *
from sidejax.fl.roles import *
from sidejax.fl.rounds import *

# every submodule's public names (its __all__), declared once there
__all__ = [*base.__all__, *evaluate.__all__, *local.__all__, *rounds.__all__, *roles.__all__]
