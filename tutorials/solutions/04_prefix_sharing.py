"""Solutions of the exercises in 04_prefix_sharing.ipynb (see 01_paging.py for how they are used)."""


# %% exercise 4.1
def block_hashes(token_ids, block_size):
    """The hash chain of the full blocks of token_ids."""
    hashes, parent = [], None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        # the block's token ids as a tuple: a list cannot be hashed
        parent = hash((parent, tuple(token_ids[start : start + block_size]), None))
        hashes.append(parent)
    return hashes


# %% exercise 4.2
predicted_cached_tokens = 80  # 88 shared tokens: 5 full blocks of 16 (the 6th differs)
