"""Paged attention: causal attention over mixed batches of prefill chunks and decode tokens
(``paged_attention``) and flash-decoding (``paged_decode_attention``), reading K/V through block
tables. ``ops`` is the entry; see ``pagedattn_kernels.ops`` for the files every op folder has.
"""
