"""Model families pagedkv implements: one module per family, one entry per Hugging Face
``model_type`` in :mod:`pagedkv.engine.models.registry`.

Every model class has the same interface: ``__init__(hf_config, tp=None)`` (``tp`` only for
families that support tensor parallelism), ``forward(input_ids, positions, kv_caches, meta) ->
hidden``, ``compute_logits(hidden, float32=True)`` and ``load_weights(iterable of (Hugging Face
name, tensor))``. ``compute_logits`` gives float32 logits for sampling, or with ``float32=False``
the lm_head product's own dtype: an argmax needs no more (converting to float32 is exact and
keeps the order, ties included), and the conversion is a kernel that writes twice the bytes
of the logits it reads (``ModelRunner.greedy_tokens``).

This ``__init__`` imports nothing: it runs before any module under it, so whatever it imported
would become a dependency of every model module and of the registry.
"""
