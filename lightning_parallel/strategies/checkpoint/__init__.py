"""Checkpoints: layout-independent save and load (:mod:`.files`), pipeline stages' parts
(:mod:`.pipeline`), background saves (:mod:`.async_save`) and mid-epoch resume (:mod:`.resume`)."""
