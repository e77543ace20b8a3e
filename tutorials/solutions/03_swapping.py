"""Solutions of the exercises in 03_swapping.ipynb (see 01_paging.py for how they are used)."""


# %% exercise 3.1
def block_bytes(num_layers, block_size, num_kv_heads, head_dim, dtype_bytes):
    """Bytes of K and V that one block holds over all layers."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype_bytes


# %% exercise 3.2
def tokens_to_recompute(prompt_len, num_generated):
    # Every known token's keys and values are gone: the prompt and all generated tokens
    # (the last generated one had not been computed yet anyway).
    return prompt_len + num_generated
