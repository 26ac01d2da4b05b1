"""XPress: DFlash's block draft plus a small causal refiner over each block's rows, trained
teacher-forced and in free-running (Jacobi) passes, drafted by Jacobi decoding (speculators 0.9.0
``models/xpress``).

``model`` (the draft: the refiner, Jacobi decoding), ``loss`` (teacher-forced, consistency and
anchor terms, metrics), ``propose`` (one block, Jacobi passes), ``export`` (our saved folder,
``XPressDraftModel``), ``memory`` (its memory terms), ``algorithm`` (the hooks).
"""

from .algorithm import ALGORITHM

__all__ = ["ALGORITHM"]
