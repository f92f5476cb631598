"""The torch layer: pure PyTorch, no Lightning. One subpackage per technique, each a function that
takes a module and a device mesh and returns it parallelised:

* :mod:`.data` — DDP, FSDP2 (ZeRO-2/3), HSDP, CPU offload, ZeRO-1, synchronised BatchNorm;
* :mod:`.tensor` — Megatron-style tensor parallelism on DTensor, and the plans it reads;
* :mod:`.pipeline` — stage planning, tracing, schedules, and tp / FSDP2 / MoE inside stages;
* :mod:`.experts` — expert parallelism (MoE dispatch by all-to-all).

Shared by all of them, at this level: :mod:`.dims` (degrees and the named ``DeviceMesh``),
:mod:`.materialize` (meta-device models), :mod:`.activation_checkpointing`, :mod:`.compile`,
:mod:`.blocks` (repeated-block discovery), :mod:`.clip` (global-norm clipping over every axis) and
:mod:`.errors`. Nothing here imports Lightning or :mod:`lightning_parallel.planner`.
"""
