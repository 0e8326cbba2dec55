"""The CP modes, registered here by name (`--cp_mode`): how the ranks of a CP group share attention. One module
per mode behind one interface (`base.CPMode`); `context_parallel_attention` is the one CP attention entry point.

* `ring.py`: the sequence split, K/V blocks travel the balanced sparse ring;
* `ulysses.py`: head parallelism over the whole CP group;
* `hybrid.py`: head groups inside a node, the ring across them (`heads.py`: what both head modes share).
"""

from .base import CPAttention, CPMode, context_parallel_attention, cp_mode_named, cp_modes, register_cp_mode
from .hybrid import HYBRID
from .ring import RING
from .ulysses import ULYSSES

for _mode in (RING, ULYSSES, HYBRID):  # (the order of the --cp_mode help)
    register_cp_mode(_mode)

__all__ = ["HYBRID", "RING", "ULYSSES", "CPAttention", "CPMode", "context_parallel_attention", "cp_mode_named",
           "cp_modes", "register_cp_mode"]
