"""Draft algorithms, one package each (``dflash/`` today; EAGLE-3 still lives in ``models/``)."""
