"""Pipeline parallelism for an unchanged module: where to cut (:mod:`.plan`), tracing and stage
building (:mod:`.runtime`, :mod:`.meta` for meta-built models, :mod:`.codegen` for lean stage
code), schedules (:mod:`.schedules`), and the other techniques inside stages (:mod:`.tensor`,
:mod:`.fsdp`, :mod:`.moe`)."""
