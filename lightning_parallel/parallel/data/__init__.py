"""Data parallelism: DDP, FSDP2 (ZeRO-2/3, HSDP, offload) in :mod:`.apply`, ZeRO-1 optimizer
sharding in :mod:`.zero1`, FSDP2 without stream buffers on the CPU in :mod:`.fsdp_host`,
BatchNorm statistics over the data-parallel group in :mod:`.sync_batchnorm`, and the data-parallel
rank that datasets sharding themselves (litdata's ``StreamingDataset``) are given in :mod:`.loader_view`."""
