"""Sampling ops, the last step of a decode: from each row of logits to a token id. For now the
greedy one, ``argmax_rows`` (each row's first largest value, as ``torch.argmax(dim=-1)``).
``ops`` is the entry; see ``pagedattn_kernels.ops`` for the files every op folder has.
"""
