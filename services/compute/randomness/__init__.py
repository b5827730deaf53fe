"""Randomness that survives the cut: keyed random draws (dropout and the rest) in a model's forward.

See [Note: randomness that survives the cut] in ``services/compute/randomness/mode.py``.
"""

from services.compute.randomness.mode import Drawn, ModelRandomness, check_draws, replaying, reproducible

__all__ = ["Drawn", "ModelRandomness", "check_draws", "replaying", "reproducible"]
