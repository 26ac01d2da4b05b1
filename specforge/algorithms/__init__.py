"""The draft algorithms, one package each (``eagle3/``, ``eagle31/``, ``peagle/``, ``dflash/``,
``dspark/``), each exposing ``ALGORITHM``: an object playing the roles of ``specforge/seam.py``,
registered by name in ``specforge/registry.py``. Nothing else lives here."""
