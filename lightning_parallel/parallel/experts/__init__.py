"""Expert parallelism: experts sharded over the ``ep`` axis, tokens moved to them by all-to-all
(:mod:`.apply`)."""
