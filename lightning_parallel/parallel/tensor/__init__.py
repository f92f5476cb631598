"""Tensor parallelism on DTensor: the plan (:mod:`.plan`, inferred by :mod:`.infer` or declared),
its application (:mod:`.apply`), attention under split heads (:mod:`.attention`), fused
projections (:mod:`.fused`), experts split by features (:mod:`.experts`) and the loss on
vocabulary-sharded logits (:mod:`.loss`)."""
