"""``torch_xla.distributed.fsdp`` (``XlaFullyShardedDataParallel``, its ``wrap`` helpers):
not provided. Importing it raises ImportError, which says what to use instead: FSDP2,
``torch.distributed.fsdp.fully_shard``, over the ``"xla"`` backend (gloo on the device's
host memory), which trains on kiln's device as one process does (``clip_grad_norm_``
included). torch_xla's FSDP is its own implementation over XLA's collectives and graph
rewrites; an alias to PyTorch's FSDP1 would not be it, and FSDP1 does not run on kiln's
device either (:mod:`kiln.device.process_group`). An ImportError, not a module whose
calls fail, so that libraries that try the import to see whether XLA's FSDP exists take
their other road."""
raise ImportError("torch_xla.distributed.fsdp (XlaFullyShardedDataParallel) is not available on kiln's device: use "
                  "FSDP2 instead, torch.distributed.fsdp.fully_shard(model) after "
                  "torch.distributed.init_process_group('xla'), which kiln supports (see kiln's docs/device.md, "
                  "Distributed training)")
