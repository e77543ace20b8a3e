"""Memory hints: ``prefetch_l2`` asks the GPU's L2 cache to fetch a tensor's bytes from HBM
ahead of the kernel that will read them, so that they stream in while the memory bus is
otherwise idle. ``ops`` is the entry; see ``pagedattn_kernels.ops`` for the files every op
folder has.
"""
