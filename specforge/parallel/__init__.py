"""Process groups/meshes (``dims``), FSDP2 (``fsdp``), Ulysses/ring sequence parallelism (``sp``)
and the one ordered ``parallelize_draft`` (``parallelize``; its docstring is the API)."""
