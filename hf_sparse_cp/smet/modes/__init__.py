"""SMET's modes, registered here by name (`SMETConfig.mode`, `--smet_mode`): how a sparse weight starts, what its
inactive weights hold, which blocks are pruned. One module per mode behind one interface (`base.SMETMode`).

* `sparse_weights.py`: dynamic sparse training from scratch (inactive weights zero, pruning by weight magnitude);
* `sparse_update.py`: sparse fine-tuning (every weight keeps its value, pruning by the updates' magnitude).
"""

from .base import SMETMode, register_smet_mode, smet_mode_named, smet_modes
from .sparse_update import SPARSE_UPDATE
from .sparse_weights import SPARSE_WEIGHTS

for _mode in (SPARSE_WEIGHTS, SPARSE_UPDATE):  # (the order of the --smet_mode help; the first is the default)
    register_smet_mode(_mode)

__all__ = ["SPARSE_UPDATE", "SPARSE_WEIGHTS", "SMETMode", "register_smet_mode", "smet_mode_named", "smet_modes"]
