"""A decoder layer's fused elementwise ops: RMSNorm (``rms_norm``, ``fused_add_rms_norm``),
SiLU-and-multiply (``silu_and_mul``), rotary embedding (``rotary_embedding``), each one kernel
that repeats the roundings of the torch code it replaces. ``ops`` is the entry; see
``pagedattn_kernels.ops`` for the files every op folder has.
"""
