"""Type stubs for numapin's Rust extension (numapin._numapin)."""

from collections.abc import Callable, Sequence
from typing import Any, Literal

from typing_extensions import Buffer
import os

class NumapinError(Exception):
    """Every numapin error; the message names the call, the errno and the arguments."""

class CheckpointError(NumapinError):
    """A checkpoint is truncated, malformed, or its experts are incomplete."""

class CacheFull(NumapinError):
    """Every slot of the cache's chosen node is pinned by live entries or views."""

class NodeNotAllowed(NumapinError):
    """A node this process may not use."""

class MissingCapability(NumapinError):
    """The kernel's capability check refused a call the probe found allowed (CAP_SYS_NICE)."""

class InvalidArgument(NumapinError):
    """A bad argument: misaligned, out of bounds, overflowing, empty, unparsable."""

class NotPacked(NumapinError):
    """A layer that is not packed, or a released slot, was asked for."""

class NotHeld(NumapinError):
    """An expert this rank's share does not hold (the message names the id and those held)."""

class MapBudget(NumapinError):
    """The mappings would cross vm.max_map_count."""

class ViewsAlive(NumapinError):
    """Release refused: views into the layer are alive."""

class Cancelled(NumapinError):
    """A load stopped by its progress callback."""

def probe() -> dict[str, Any]:
    """What this process may do here: the probe's facts, its verdict and a summary."""

def attach(name: str, *, timeout: float = 30.0) -> WholeModel:
    """The whole model another process of this uid serves as `name`
    (Checkpoint.place(..., serve_as=name)): fetched over a Unix socket and mapped
    read-only, the same pages, no copy (GIL released). NumapinError naming the fault
    when no process serves it, or the wait exceeds `timeout` seconds."""

def main(argv: Sequence[str]) -> int:
    """The `numapin` command on `argv` (the program name first): its exit status."""

class Progress:
    """Where one layer's load stands. `store` tells apart the stores of a whole-model
    placement, which share one callback and each number their layers from 0."""

    store: int
    layer: int
    bytes_done: int
    bytes_total: int
    slots_done: int
    slots_total: int

ProgressCallback = Callable[[Progress], object]

class View:
    """A read-only, zero-copy array over placed memory (buffer protocol and DLPack).

    Keeps its store alive. numpy honours the read-only flag; torch.from_dlpack ignores
    it, but the memory itself is read-only (PROT_READ) once placed: a write through such
    a tensor faults (SIGSEGV) unless the store was made with writable=True.
    """

    @property
    def dtype(self) -> str: ...
    @property
    def shape(self) -> list[int]: ...
    @property
    def strides(self) -> list[int]:
        """Bytes between consecutive elements of each dimension."""
    @property
    def address(self) -> int:
        """The address of the first byte, inside the store's region."""
    @property
    def nbytes(self) -> int:
        """Bytes of the elements: elements x itemsize (numpy's meaning), not counting the
        gaps of a strided view."""
    @property
    def span_bytes(self) -> int:
        """Bytes from the first byte the view reaches to one past the last: `address +
        span_bytes` ends the range it reads (nbytes plus a strided view's gaps)."""
    @property
    def readonly(self) -> Literal[True]: ...
    def __dlpack__(
        self,
        *,
        stream: Any = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> Any: ...
    def __dlpack_device__(self) -> tuple[int, int]: ...
    def __buffer__(self, flags: int, /) -> memoryview: ...

class PinStore:
    """Per-layer arenas for callers with their own sources.

    layout: "interleave:all", "layer-per-node:0-3", "replicate:all", "split:0,2",
    "unplaced" (node sets in numactl's syntax).
    """

    def __init__(
        self,
        layout: str = "interleave:all",
        *,
        huge_pages: bool = True,
        populate: bool = True,
        loader_threads: int | None = None,
        writable: bool = False,
    ) -> None: ...
    @property
    def layout(self) -> str: ...
    def pack_layer(
        self,
        layer: int,
        weights: Sequence[Buffer],
        scales: Sequence[Buffer] | None = None,
        *,
        progress: ProgressCallback | None = None,
    ) -> dict[str, Any]:
        """Packs a layer (GIL released); a raising progress callback aborts it."""
    def weights(self, layer: int, expert: int) -> View: ...
    def scales(self, layer: int, expert: int) -> View: ...
    def layer(self, layer: int, kind: Literal["weights", "scales"] = "weights") -> View:
        """[experts, stride] view over the layer's region."""
    def release(self, layer: int, expert: int) -> None:
        """Raises ViewsAlive while views into the layer are alive."""
    def ensure(
        self, layer: int, expert: int, weights: Buffer, scales: Buffer | None = None
    ) -> None: ...
    def stats(self) -> dict[str, Any]: ...
    @property
    def degraded(self) -> str | None: ...

class Checkpoint:
    """A checkpoint's headers (safetensors, sharded or not; GGUF, split or not)."""

    def __init__(self, path: str | "os.PathLike[str]") -> None: ...
    @property
    def format(self) -> Literal["safetensors", "gguf"]: ...
    def tensors(self) -> list[tuple[str, str, list[int]]]:
        """(name, dtype, shape outermost first) for every tensor."""
    @property
    def experts(self) -> dict[int, int]:
        """{MoE layer: experts}."""
    def pack(
        self,
        layout: str = "interleave:all",
        *,
        huge_pages: bool = True,
        populate: bool = True,
        loader_threads: int | None = None,
        read_mode: Literal["auto", "buffered", "direct", "drop-behind"] = "auto",
        progress: ProgressCallback | Literal[False] | None = None,
        writable: bool = False,
    ) -> PlacedModel:
        """Packs every MoE layer's experts (GIL released). progress=None: a tqdm bar when
        tqdm is installed and stderr is a terminal. A raising callback aborts the load;
        a progress that is not callable, False or None is a TypeError before loading."""

    def place(
        self,
        experts: str = "split:all",
        dense: str = "replicate:all",
        *,
        plan: str | None = None,
        experts_held: str | None = None,
        expert_slice: str | None = None,
        dense_slice: str | None = None,
        whole: list[str] | None = None,
        tensor_parallel: str | None = None,
        slice_class: dict[str, str | slice] | None = None,
        slice_pattern: dict[str, str | slice] | None = None,
        framework_plan: dict[str, str] | None = None,
        rank: str | None = None,
        convert_class: dict[str, Any] | None = None,
        convert_pattern: dict[str, Any] | None = None,
        huge_pages: bool = True,
        populate: bool = True,
        loader_threads: int | None = None,
        read_mode: Literal["auto", "buffered", "direct", "drop-behind"] = "auto",
        progress: ProgressCallback | Literal[False] | None = None,
        writable: bool = False,
        serve_as: str | None = None,
        role_major: bool | int | Literal["auto"] | None = None,
        **classes: str,
    ) -> WholeModel:
        """Places every tensor (GIL released): routed experts under `experts`
        (split/interleave/replicate/layer-per-node:NODES, unplaced), every dense class
        under `dense` (replicate/interleave:NODES, bind:NODE, unplaced). `plan` is the
        text form ("experts=split:all,dense=replicate:all,*.self_attn.*=interleave:all"),
        overriding experts/dense ("default" is the checkpoint's default plan over every
        node, "default;norms=unplaced" items over it); keywords named after a class (shared, attention,
        dense_mlp, norms, embeddings, head, global) override last. Map budget and node
        memory are checked before anything is reserved. A bad plan (unknown layout,
        class, a keyword value that is not one layout for its keyword, such as
        "bind:0;experts=unplaced" — items go in `plan` —
        or a pattern matching no dense tensor) raises InvalidArgument; a progress that
        is not callable, False or None raises TypeError before loading.

        A rank's share: `experts_held` the routed experts held ("0-63", "0-3,8", "1/4"),
        looked up by global id (another id raises NotHeld); `expert_slice` a slice of
        each held expert's tensors ("rows:0/2", "columns:128:256"); `dense_slice` the
        rows of every sliceable dense tensor ("rows:1/2"; norms and 1-D tensors stay
        whole); `whole` classes kept whole under `dense_slice` (["embeddings"]);
        `tensor_parallel="k/n"` rank k of a tensor-parallel group of n (column-parallel
        linears, embeddings and head by rows; o_proj/down_proj by columns; expert gate/up
        their output dimension, down its input dimension, on the axes each family stores
        them (DBRX's w2 by rows); norms and routers whole). `expert_slice` with
        `tensor_parallel` raises InvalidArgument naming both. `slice_class` ({class:
        slice}) and `slice_pattern` ({glob: slice}, the last matching pattern wins) cut
        chosen tensors over dense_slice and tensor_parallel; a slice is its text
        ("rows:0/2", "columns:1/4", "rows:START:LEN") or slice(start, stop), the rows
        numpy's t[start:stop] holds. `framework_plan` ({module glob: style}, transformers'
        tp_plan: colwise, rowwise, embedding_rowwise, replicate) with `rank="k/n"` is this
        rank's share of the dense tensors as the framework cuts them, the routed experts
        whole under `experts_held`, or, without it, cut when the plan names every expert
        role (gate and up colwise/packed_colwise by rows, down rowwise by columns); an
        unknown style, a cut that does not divide its axis, splits an attention head or
        cuts an expert role on another axis raises InvalidArgument naming the tensor.
        `convert_class` ({class: dtype}) and `convert_pattern` ({glob: dtype}, the last
        matching pattern wins) place those tensors in that dtype (a str such as
        "float32" or "F32", a numpy.dtype or a torch.dtype): BF16 and F16 become F32
        once, at placement (views F32, verify() compares with the converted file
        bytes, report()["converted"] lists them); an unknown dtype, a conversion not
        implemented (an integer or quantised tensor), a converted tensor that is also
        sliced or a pattern matching no dense tensor raises InvalidArgument naming it
        before anything is reserved.

        `serve_as=name` places memfd-backed stores and serves the model under `name`
        (an abstract Unix socket, this uid only) as long as the returned WholeModel
        lives: numapin.attach(name) in another process maps the same pages.

        `role_major`: None or "auto" (default) gives role-major expert slots where a
        layer's experts are one tensor per role (DBRX's w1/v1/w2 [E*I, H]): each is
        one view, under an expert share the held experts' rows (consecutive ids); a
        tensor-parallel share that cuts the roles stays a slot per expert. True asks it
        of any naming (each role's experts back to back), an int R asks it with R the
        weight roles; False, 0, a wrong R, a negative or too large int, another string
        raise InvalidArgument naming role_major (a float or list TypeError), as does
        asking it under a cutting share, an assignment or serve_as."""

class PlacedModel:
    """A checkpoint's experts placed in a store."""

    @property
    def layers(self) -> list[int]: ...
    @property
    def layout(self) -> str: ...
    def roles(self, layer: int) -> list[str]: ...
    def expert(self, layer: int, expert: int) -> dict[str, View]:
        """{role: view} with each tensor's dtype and shape."""
    def layer(self, layer: int, role: str, *, through: str | None = None) -> View:
        """[experts, ...] view of one role, the slot stride as the outer stride; with
        `through`, the roles role..through joined along their first dimension (e.g.
        gate_proj through up_proj: transformers' fused [E, 2I, H] gate_up_proj)."""
    def slot(
        self, layer: int, expert: int, kind: Literal["weights", "scales"] = "weights"
    ) -> View: ...
    def release(self, layer: int, expert: int) -> None: ...
    def stats(self) -> dict[str, Any]: ...
    def report(self) -> str: ...
    def report_dict(self) -> dict[str, Any]: ...
    def verify(self) -> dict[str, Any]: ...
    @property
    def degraded(self) -> str | None: ...

class WholeModel:
    """A checkpoint placed whole by Checkpoint.place. Views keep the placed memory alive
    (also after `del model`); a placed model has no call that releases memory."""

    @property
    def plan(self) -> str | None:
        """The plan's text form (node sets spelled out)."""
    @property
    def share(self) -> str | None:
        """The share placed, in words ("experts 0-63; dense rows:0/2"), or None."""
    def tensor(self, name: str) -> View:
        """Tensor `name`: dtype, shape in numpy's order (GGUF's ne reversed), raw uint8
        for GGML quant blocks; this thread's node's copy where the class is replicated.
        A per-expert tensor is the part of it held (sliced under expert_slice= or
        tensor_parallel=, as expert() gives it); one of an expert outside the share
        raises NotHeld. A tensor holding every expert of a layer (experts.gate_up_proj)
        is one view with the file's shape, strided by the slot, where the layout keeps it
        whole (every expert held unsliced, at one stride; DBRX's flattened w1/v1/w2 one
        contiguous run, its experts in role-major slots); elsewhere InvalidArgument
        naming the layer: use expert() or layer()."""
    def tensors(self) -> list[str]:
        """Every tensor's name, in checkpoint order."""
    def classes(self) -> list[tuple[str, str, int | None]]:
        """(name, class, layer) of every tensor."""
    @property
    def layers(self) -> list[int]:
        """The MoE layers whose routed experts were placed, ascending."""
    def roles(self, layer: int) -> list[str]:
        """The layer's roles in slot order under their canonical names, the same for
        every naming: gate, up, gate_up, down, with .scale/.bias ("gate_up.bias")."""
    def role_names(self, layer: int) -> dict[str, str]:
        """{canonical role: the file's name for it} ({"up": "w3"})."""
    def expert_ids(self, layer: int) -> list[int]:
        """The global ids of the layer's experts this model holds, ascending."""
    def locate(self, name: str) -> tuple[int, int | None, str] | None:
        """(layer, expert, canonical role) of a routed expert's tensor (expert None for
        a tensor holding every expert of the layer); None for any other tensor;
        InvalidArgument for a name the checkpoint lacks."""
    def expert(self, layer: int, expert: int) -> dict[str, View]:
        """{role: view} with each piece's dtype and per-expert shape (keyed by the
        file's role names; role_names(layer) maps the canonical ones to them)."""
    def layer(self, layer: int, role: str, *, through: str | None = None) -> View:
        """[experts, ...] view of one role of every expert the model holds, the slot
        stride as the outer stride (this thread's node's copy where replicated); with
        `through`, roles role..through joined along their first dimension. NumapinError
        where the pieces are not at one stride (an expert assignment's slot order, or
        pieces congruent to their file offsets for direct reads); a layer split over
        nodes is one range bound node block by node block: one view."""
    def stats(self) -> dict[str, Any]:
        """{"experts": store stats or None, "dense": [store stats + "class"]}."""
    def report(self) -> str: ...
    def report_dict(self) -> dict[str, Any] | None:
        """WholeReport as a dict; each "measured" class also has in_place_bytes,
        bounced_bytes, uring_reads, blocking_reads, uring_depth, blocking_depth (the
        CLI JSON's names), and "direct_io" says how the experts' direct reads were
        issued (io_uring or read threads and why; None). None for a model made by
        numapin.attach (it read nothing: no report)."""
    def verify(self) -> dict[str, Any]:
        """Every copy of every tensor re-read from the files: "verified", "mismatched".
        InvalidArgument for a model attached by name (no checkpoint)."""
    @property
    def served_as(self) -> str | None:
        """The name given as place(..., serve_as=name): served while this model lives."""
    @property
    def attached(self) -> bool:
        """Whether numapin.attach(name) made this model (read-only, the placer's pages)."""
    def __len__(self) -> int: ...

class CacheEntry:
    """One cached expert; its slot stays pinned while this or a view of it lives."""

    @property
    def key(self) -> tuple[int, int]: ...
    @property
    def node(self) -> int: ...
    @property
    def weights(self) -> View: ...
    @property
    def scales(self) -> View: ...

class ExpertCache:
    """An LRU of experts in fixed slots per node, each node's regions bound once."""

    def __init__(
        self,
        slots_per_node: int,
        weight_bytes: int,
        scale_bytes: int = 0,
        *,
        nodes: str = "all",
        populate: bool = False,
        huge_pages: bool = False,
        writable: bool = False,
    ) -> None: ...
    def get(self, layer: int, expert: int) -> CacheEntry | None: ...
    def get_or_load(
        self,
        layer: int,
        expert: int,
        weights: Buffer,
        scales: Buffer | None = None,
        *,
        hint: int | None = None,
    ) -> CacheEntry: ...
    def shrink(self, keep_per_node: int) -> int: ...
    @property
    def slots_per_node(self) -> int: ...
    def stats(self) -> dict[str, Any]: ...
