"""One code path for one or many processes: the process group from torchrun's environment, DDP
and FSDP wrapping, and the reductions over ranks.
"""
