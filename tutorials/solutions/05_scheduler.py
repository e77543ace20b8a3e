"""Solutions of the exercises in 05_scheduler.ipynb (see 01_paging.py for how they are used)."""


# %% exercise 5.1
def plan_step(running, waiting, budget):
    """{request id: tokens to compute now}, under the token budget, FCFS."""
    plan = {}
    for rid, pending in [*running, *waiting]:  # running first, then waiting, each in arrival order
        if budget == 0:
            break
        plan[rid] = min(pending, budget)  # a prompt longer than what is left: a chunk of it
        budget -= plan[rid]
    return plan


# %% exercise 5.2
def victims(running, free):
    """Request ids preempted, in order, when the running requests reserve their blocks."""
    running = list(running)
    preempted = []
    i = 0
    while i < len(running):
        rid, need, _held = running[i]
        while need > free:
            victim, _, held = running.pop()  # the most recently arrived
            preempted.append(victim)
            free += held
            if victim == rid:  # it was the asking request itself: the step goes on without it
                return preempted
        free -= need
        i += 1
    return preempted
