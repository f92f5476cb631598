"""The layout planner: a search over layouts, not a technique. It reads the torch layer's plans
(:mod:`lightning_parallel.parallel`), predicts step time and memory per layout (:mod:`.model`,
:mod:`.cost`, with context parallelism in :mod:`.context_cost` and collectives priced by
:mod:`.collectives`) on a cluster (:mod:`.hardware`, measured by :mod:`.calibrate`), ranks them
(:mod:`.search`), and chooses the ``3d`` strategy's automatic degrees (:mod:`.auto_degrees`).
The strategies call it; the torch layer never imports it."""
