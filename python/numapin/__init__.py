"""numapin for Python: place a checkpoint on NUMA nodes and read it without a copy.

>>> import numapin, numpy
>>> ckpt = numapin.Checkpoint("model.safetensors")        # headers only
>>> model = ckpt.place(experts="split:all", dense="replicate:all")  # every tensor
>>> q = numpy.from_dlpack(model.tensor("model.layers.0.self_attn.q_proj.weight"))
>>> gate = numpy.from_dlpack(model.expert(3, 0)["gate_proj"])  # read-only, zero-copy

Views (`View`) export the buffer protocol and DLPack; they are read-only and keep their
store alive. `torch.from_dlpack` ignores DLPack's read-only flag: never write to a tensor
made from a view (it faults on a frozen store, and otherwise changes bytes every reader
shares). See docs/python.md.
"""

from ._numapin import (
    CacheEntry,
    CacheFull,
    Cancelled,
    Checkpoint,
    CheckpointError,
    ExpertCache,
    InvalidArgument,
    MapBudget,
    MissingCapability,
    NodeNotAllowed,
    NotHeld,
    NotPacked,
    NumapinError,
    PinStore,
    PlacedModel,
    Progress,
    View,
    ViewsAlive,
    WholeModel,
    attach,
    probe,
)

__all__ = [
    "CacheEntry",
    "CacheFull",
    "Cancelled",
    "Checkpoint",
    "CheckpointError",
    "ExpertCache",
    "InvalidArgument",
    "MapBudget",
    "MissingCapability",
    "NodeNotAllowed",
    "NotHeld",
    "NotPacked",
    "NumapinError",
    "PinStore",
    "PlacedModel",
    "Progress",
    "View",
    "ViewsAlive",
    "WholeModel",
    "attach",
    "probe",
]
