"""rfsdp.dcp: torch's state formats for sharded tensors, in one place: the
pieces a rank holds of global tensors and the tensors DCP is handed for them
(pieces), where a model's and an optimizer's states lie (layout), the one
gatherer of pieces (gather), an optimizer's state in torch's state-dict format
(optim_state), what a state dict holds, sharded or full (state_dict_type), and
reading a DCP checkpoint without running code from it (reader)."""
from .pieces import Placed, ShardedRows
from .reader import (CheckpointError, SafeFileSystemReader, SafeLoadPlanner, UnsafeCheckpointError,
                     load, read_metadata)
from .state_dict_type import get_state_dict_type, set_state_dict_type

__all__ = ["Placed", "ShardedRows", "CheckpointError", "SafeFileSystemReader", "SafeLoadPlanner",
           "UnsafeCheckpointError", "load", "read_metadata", "get_state_dict_type",
           "set_state_dict_type"]
