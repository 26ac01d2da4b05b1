"""The draft algorithms, one package each (``eagle3/``, ``eagle31/``, ``peagle/``, ``mtp/``, ``dflash/``,
``dspark/``, ``dflash2/``, ``xpress/``), each exposing ``ALGORITHM``: an object playing the roles of
``specforge/seam.py``, registered by name in ``specforge/registry.py`` (checked there: every member of
every role). Nothing else lives here."""
