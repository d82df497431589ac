"""The core: a graph's life from signature to replay, and the guards around it.

Other packages import from here only (this module's ``__all__`` is the core's surface); the
modules inside follow a graph's life, lower layers first:

- ``compat``: the one doorway to PyTorch's private names;
- ``signature``: the call's pytree layout and the per-call input check;
- ``frames``: where in the user's code something happened, and why captures fail;
- ``active_capture``, ``collectives``: the capture this thread is recording, and collectives;
- ``writes``: tensors a function writes outside its inputs (found, restored, refused);
- ``guards``: what a replay checks first: tensors read by address, module slots and hooks;
- ``modes``: the modes and math settings a recording froze; gradients;
- ``frozen_state``: what a recording would freeze or repeat (plain values the function
  changes, host draws, random ops in a loop body), refused at capture;
- ``python_values``: the Python values a capture read, guarded before each replay;
- ``launch``: launching a recording, and the input copies recorded into it;
- ``segments``: recordings split around eager steps;
- ``outputs``: the output policies (what a replay hands back);
- ``replay``: the one replay path;
- ``side_stream``: eager runs on the capture's side stream (warm-up);
- ``recording``: recording one call into a graph, and the error a failed one raises;
- ``capture``: a capture as one object in phases, to a ready replay path;
- ``pool``, ``diagnostics``: the shared memory pool; the diagnostics a graph calls;
- ``stats``, ``graphed``: the graphed callable's numbers and its state machine.

Nothing here imports the diagnostics, the shapes layer, training or the tools.
"""

from . import compat
from .active_capture import active_capture
from .diagnostics import Diagnostics, install_diagnostics
from .frames import (
    LIBRARY_SETTING,
    callable_name,
    is_torch_file,
    library_setting,
    user_frame,
    user_location,
    user_stacklevel,
)
from .frozen_state import PythonSnapshot, RandomDraws
from .graphed import Graphed, State
from .guards import AddressGuard, closure_tensors, modules_of
from .host_draws import HostDraws
from .modes import math_settings
from .pool import Pool
from .python_values import READS_LIKE, Reader, ValueWatch, read_values
from .recording import RecordingSetup, capture_call
from .replay import OutputsInUse, StreamOrder
from .segments import Segments, current_eager_step, eager
from .side_stream import default_stream, warm_up
from .signature import NAMESPACE, Signature, flatten, is_plain, leaf_paths, same_value
from .stats import Stats
from .writes import (
    RngState,
    SideEffects,
    TensorSnapshot,
    Written,
    named_roots,
    reachable_tensors,
    storage_key,
    written_arguments,
)

__all__ = [
    "LIBRARY_SETTING",
    "NAMESPACE",
    "READS_LIKE",
    "AddressGuard",
    "Diagnostics",
    "Graphed",
    "HostDraws",
    "OutputsInUse",
    "Pool",
    "PythonSnapshot",
    "RandomDraws",
    "Reader",
    "RngState",
    "Segments",
    "SideEffects",
    "Signature",
    "State",
    "StreamOrder",
    "Stats",
    "TensorSnapshot",
    "ValueWatch",
    "Written",
    "active_capture",
    "callable_name",
    "RecordingSetup",
    "capture_call",
    "closure_tensors",
    "compat",
    "current_eager_step",
    "default_stream",
    "eager",
    "flatten",
    "install_diagnostics",
    "is_torch_file",
    "leaf_paths",
    "library_setting",
    "math_settings",
    "modules_of",
    "named_roots",
    "reachable_tensors",
    "is_plain",
    "read_values",
    "same_value",
    "storage_key",
    "user_frame",
    "user_location",
    "user_stacklevel",
    "warm_up",
    "written_arguments",
]
