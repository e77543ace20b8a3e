"""Drawing and widget plumbing of the pagedkv tutorials (the notebooks beside it import it).

Every teaching step (slot mapping, the paged-attention gather, copy-on-write, the cost model,
the hash chain, the scheduling rule) is written in the notebooks' cells. This package only
draws what the notebooks computed and wires controls to the functions the notebooks define:

- ``env``: which device, the test suite's small-size switch;
- ``timing``: warm-up, repeats, median and spread (CUDA events on a GPU);
- ``panel``: the device panel (KV cache tensor, bytes, blocks, memory, kernel times);
- ``tables``: HTML views of block tables, physical blocks, engine steps, hash chains;
- ``plots``: matplotlib figures;
- ``widgets``: ``Rerun`` (controls that call a notebook function again) and ``Player`` (a step
  slider over recorded results);
- ``exercises``: the "your turn" checks;
- ``server``: ``pagedkv serve`` in a subprocess and a /metrics poller.
"""

from pagedkv_tutorial_helpers.env import describe_device, small, synchronize
from pagedkv_tutorial_helpers.exercises import NotSolved, checking
from pagedkv_tutorial_helpers.panel import device_panel, engine_panel
from pagedkv_tutorial_helpers.plots import (
    figure_html,
    plot_metrics,
    plot_simulation,
    plot_states,
    plot_timeline,
    plot_waste,
)
from pagedkv_tutorial_helpers.server import MetricsPoller, ServerProcess, scrape
from pagedkv_tutorial_helpers.tables import (
    block_tables_html,
    engine_step_html,
    pool_html,
    table_html,
)
from pagedkv_tutorial_helpers.timing import Timing, time_interleaved, time_it
from pagedkv_tutorial_helpers.widgets import Player, Rerun, to_html

__all__ = [
    "MetricsPoller",
    "NotSolved",
    "Player",
    "Rerun",
    "ServerProcess",
    "Timing",
    "block_tables_html",
    "checking",
    "describe_device",
    "device_panel",
    "engine_panel",
    "engine_step_html",
    "figure_html",
    "plot_metrics",
    "plot_simulation",
    "plot_states",
    "plot_timeline",
    "plot_waste",
    "pool_html",
    "scrape",
    "small",
    "synchronize",
    "table_html",
    "time_interleaved",
    "time_it",
    "to_html",
]
