"""The KV cache's blocks: writing new K/V into their slots (``reshape_and_cache``), copying blocks
for copy-on-write (``copy_blocks``), swapping blocks between GPU and CPU memory
(``swap_blocks`` on the ``swap_stream``). ``ops`` is the entry; see ``pagedattn_kernels.ops``
for the files every op folder has.
"""
