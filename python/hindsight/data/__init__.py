"""Exactly-once, reproducible input processing across failing workers
(``hs.data``); see docs/data.md."""

from hindsight.data._loader import Loader
from hindsight.data._worker import current_example_seed, example_generator

__all__ = ["Loader", "current_example_seed", "example_generator"]
