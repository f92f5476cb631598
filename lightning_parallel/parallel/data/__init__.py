"""Data parallelism: DDP, FSDP2 (ZeRO-2/3, HSDP, offload) in :mod:`.apply`, ZeRO-1 optimizer
sharding in :mod:`.zero1`, FSDP2 without stream buffers on the CPU in :mod:`.fsdp_host`, and
BatchNorm statistics over the data-parallel group in :mod:`.sync_batchnorm`."""
