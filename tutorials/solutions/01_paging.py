"""Solutions of the exercises in 01_paging.ipynb.

Each ``# %% exercise <id>`` section replaces that exercise's cell: the test suite runs the
notebook with them (``scripts/run_tutorials.py``), after checking that each check fails on the
blank cell. Try the exercises before reading on.
"""

# %% exercise 1.1
def kv_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype_bytes):
    """Bytes of K and V cache that one token takes, over all layers."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


# %% exercise 1.2
def slot_of_token(block_table, position, block_size):
    """The slot of the token at `position` of a sequence with this block table."""
    return block_table[position // block_size] * block_size + position % block_size


# %% exercise 1.3
predicted_blocks = 3  # ceil(37 / 16)
predicted_empty_slots = 11  # 3 * 16 - 37: only the last block is partly filled
