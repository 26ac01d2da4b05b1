"""specforge: EAGLE-3 draft-model training."""
__version__ = "0.1.0"
