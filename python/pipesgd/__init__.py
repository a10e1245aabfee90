"""pipesgd from Python. `import pipesgd.torch` registers the "pipesgd" torch.distributed
backend and provides pipesgd's codecs and PowerSGD as DDP communication hooks (docs/torch.md)."""
