"""Adapting a served draft to its traffic: ``python -m specforge.adapt`` (see ``rounds.py``).

``proxy.py`` records what a server answers; ``traffic.py`` turns the record into training rows and
a held-out slice; ``rounds.py`` runs capture, a bounded fine-tune, the gate and the swap.
"""
