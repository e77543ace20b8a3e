"""Solutions of the exercises in 02_copy_on_write.ipynb (see 01_paging.py for how they are used)."""

# ruff: noqa: F821 (tables, ref, num_tokens, new_block, BLOCK_SIZE are the notebook's)


# %% exercise 2.1
def append_token(seq):
    """Reserve the slot of seq's next token; the copy-on-write pair (src, dst) or None."""
    table, n = tables[seq], num_tokens[seq]
    copy = None
    if n % BLOCK_SIZE == 0:  # notebook 1's rule: no block yet, or the last one is full
        table.append(new_block())
    elif ref[table[-1]] > 1:  # shared and partly filled: copy on write
        src = table[-1]
        ref[src] -= 1  # was > 1: the other sequences keep it
        table[-1] = new_block()
        copy = (src, table[-1])
    num_tokens[seq] = n + 1
    return copy


# %% exercise 2.2
predicted_copies = 3  # 13 tokens = 1 full block + 5 in a shared last block: 3 of 4 copy it

# %% exercise 2.3
predicted_copies_16 = 0  # 16 tokens fill 2 blocks: nobody writes into a shared block
