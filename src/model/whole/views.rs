//! [`PlacedModel`]: a whole checkpoint in its stores, and typed views of it — a tensor by
//! its checkpoint name (dtype, shape row-major outermost first in elements, bytes from
//! the reading thread's node's copy), every tensor, every copy of one (an expert by its
//! pieces' roles: `expert_views`).

use std::collections::HashMap;

use super::classes::TensorClass;
use super::report::WholeReport;
use super::shape::{Block, DenseSlice};
use crate::error::{Error, Result};
use crate::model::{Dtype, ExpertPlan, LayerPlan, Naming};
use crate::store::{Kind, PinStore};

/// What a byte view of a tensor needs ([`Invalid::WrongBacking`](crate::Invalid::WrongBacking)):
/// one run of bytes, which a tensor holding every expert of a layer is not.
const ONE_RUN: &str = "a tensor held in one run of bytes: read its experts with expert(layer, e)";
/// What a view of a sliced expert tensor needs: its rows back to back in the slot.
pub(super) const BACK_TO_BACK: &str =
    "rows back to back in the slot: read them through the expert store's slot_map";

/// Where a placed tensor's bytes are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Place {
    /// In a dense store: `layer`'s single slot, at `offset`.
    Dense {
        store: usize,
        layer: usize,
        offset: usize,
        len: usize,
    },
    /// A per-expert tensor: one piece of one expert's slot.
    ExpertPiece {
        layer: usize,
        expert: usize,
        kind: Kind,
        offset: usize,
        len: usize,
    },
    /// A tensor holding every expert of a layer: its experts are in the expert store
    /// (see [`PlacedModel::expert`]), not in one run of bytes.
    Experts,
    /// A tensor holding one role of every expert of a layer in role-major slots
    /// (DBRX's `w1`): weight slots `first..first + count`, back to back, in the file's
    /// layout.
    ExpertRun {
        layer: usize,
        first: usize,
        count: usize,
    },
    /// A per-expert tensor of an expert outside the share: [`Error::NotHeld`].
    NotHeld { layer: usize, expert: usize },
    /// A per-expert tensor whose sliced rows are not back to back in its slot
    /// (`piece_align` padded them): no one byte slice holds it.
    Padded { layer: usize, expert: usize },
    /// No bytes.
    Empty,
}

/// One placed tensor's metadata.
#[derive(Debug, Clone)]
pub(crate) struct PlacedTensor {
    pub(crate) name: String,
    pub(crate) class: TensorClass,
    pub(crate) layer: Option<usize>,
    pub(crate) dtype: Dtype,
    pub(crate) shape: Vec<u64>,
    pub(crate) file: usize,
    pub(crate) offset: u64,
    pub(crate) len: u64,
    /// Pieces in the file and the bytes from one to the next (a column slice: one per
    /// row; else `(1, 0)`); `len` is their sum.
    pub(crate) rows: (u64, u64),
    pub(crate) place: Place,
    /// The slice held under a dense slice; `shape` is then the sliced shape, `offset`
    /// and `len` the sliced bytes in the file.
    pub(crate) slice: Option<DenseSlice>,
    /// Converted at placement: `dtype` is the placed one, `len` the file's bytes.
    pub(crate) converted: Option<super::convert::Conversion>,
}

/// One dense store: a class under one layout.
#[derive(Debug)]
pub(crate) struct DenseStore {
    pub(crate) class: TensorClass,
    pub(crate) store: PinStore,
    pub(crate) reads: usize,
    pub(crate) bounced: u64,
    /// What its direct reads did.
    pub(crate) direct: crate::source::DirectReads,
    /// Wall nanoseconds its `pack_layer` calls took.
    pub(crate) load_nanos: u64,
    /// How its loads read each file, and why (the first load that read it).
    pub(crate) files: Vec<crate::store::FileRead>,
}

/// A checkpoint placed whole by [`Checkpoint::place`](crate::model::Checkpoint::place): its stores and a view of every
/// tensor. Owns its memory; does not borrow the checkpoint.
#[derive(Debug)]
pub struct PlacedModel {
    pub(crate) tensors: Vec<PlacedTensor>,
    pub(crate) by_name: HashMap<String, usize>,
    pub(crate) stores: Vec<DenseStore>,
    pub(crate) experts: Option<PinStore>,
    /// Wall nanoseconds the experts' pack took.
    pub(crate) expert_load_nanos: u64,
    /// How the experts' pack read each file, and why (the first layer that read it).
    pub(crate) expert_files: Vec<crate::store::FileRead>,
    /// What the experts' direct reads did (all layers).
    pub(crate) expert_reads: crate::source::DirectReads,
    pub(crate) expert_plan: Option<ExpertPlan>,
    /// The experts' role-major runs ([`StoreOptions::role_major`](crate::store::StoreOptions::role_major); 1: a
    /// slot per expert): weight piece `r` of expert `e` is slot `r × E + e`.
    pub(crate) roles: usize,
    pub(crate) naming: Option<Naming>,
    pub(crate) report: Option<WholeReport>,
    /// The checkpoint's identity, for an export's manifest.
    pub(crate) identity: Option<super::identity::Identity>,
}

/// A tensor looked up by its checkpoint name.
#[derive(Debug, Clone, Copy)]
pub struct TensorView<'a> {
    name: &'a str,
    class: TensorClass,
    layer: Option<usize>,
    dtype: Dtype,
    shape: &'a [u64],
    bytes: Option<&'a [u8]>,
    slice: Option<DenseSlice>,
}

impl<'a> TensorView<'a> {
    /// Its checkpoint name.
    pub fn name(&self) -> &'a str {
        self.name
    }

    /// Its class.
    pub fn class(&self) -> TensorClass {
        self.class
    }

    /// Its model layer, if its name has one.
    pub fn layer(&self) -> Option<usize> {
        self.layer
    }

    /// Its element type.
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    /// Elements and bytes per block of its type ([`Block`]).
    pub fn block(&self) -> Block {
        Block::of(self.dtype)
    }

    /// Its shape, row-major, outermost first, in elements (numpy's and torch's order;
    /// GGUF's `ne` reversed): the shape of the part held, so under a dense slice the
    /// sliced axis has [`DenseSlice::len`] entries.
    pub fn shape(&self) -> &'a [u64] {
        self.shape
    }

    /// The slice of the tensor held, under a dense slice; `None` for a tensor placed
    /// whole (a 1-D tensor, a class kept whole, no slice).
    pub fn slice(&self) -> Option<DenseSlice> {
        self.slice
    }

    /// Its bytes: for a replicated class, the copy on the calling thread's node (or the
    /// nearest); for a per-expert tensor, the part of it the share holds (its
    /// [`TensorView::slice`] under a slice); for one role of every expert in role-major
    /// slots (DBRX's `w1`, [`StoreOptions::role_major`](crate::store::StoreOptions::role_major)),
    /// the run of the experts' pieces, the file's bytes; `None` for any other tensor
    /// holding every expert of a layer, whose experts are read with [`PlacedModel::expert`] (and, seen through
    /// [`PlacedModel::tensors`], for a per-expert tensor outside the share).
    pub fn bytes(&self) -> Option<&'a [u8]> {
        self.bytes
    }

    /// [`TensorView::bytes`], or an error saying why there are none.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a tensor holding every expert of a layer (naming
    /// the layer and [`PlacedModel::expert`]).
    pub fn held_bytes(&self) -> Result<&'a [u8]> {
        self.bytes.ok_or_else(|| {
            let layer = self
                .layer
                .map_or_else(|| "its layer".to_owned(), |l| format!("layer {l}"));
            Error::wrong_backing(
                "PlacedModel::tensor",
                format!(
                    "tensor {} holds every expert of {layer}, each in its own slot",
                    crate::error::quote(self.name)
                ),
                ONE_RUN,
            )
        })
    }
}

impl PlacedModel {
    /// The tensor called `name`. A per-expert tensor
    /// (`model.layers.L.mlp.experts.E.gate_proj.weight`) is its part of expert `E`'s
    /// slot: under a tensor slice, the part held, with the sliced shape and
    /// [`TensorView::slice`] saying which (as [`PlacedModel::expert`] gives it).
    ///
    /// # Errors
    /// No such tensor ([`Error::InvalidArgument`] naming it); a per-expert tensor of an
    /// expert outside the share ([`Error::NotHeld`]); a sliced per-expert tensor whose
    /// rows `piece_align` padded apart in the slot ([`Error::InvalidArgument`]); a store
    /// read fails (a released slot, the topology cannot be read).
    pub fn tensor(&self, name: &str) -> Result<TensorView<'_>> {
        let index = self.by_name.get(name).copied().ok_or_else(|| {
            Error::bad_value(
                "PlacedModel::tensor",
                "tensor name",
                crate::error::quote(name),
                "no tensor of the checkpoint has this name",
            )
        })?;
        let t = &self.tensors[index];
        match t.place {
            Place::NotHeld { layer, expert } => {
                let plan = self.layer_plan("PlacedModel::tensor", layer)?;
                return Err(match plan.expert(expert) {
                    Err(Error::NotHeld {
                        layer,
                        expert,
                        held,
                        ..
                    }) => Error::NotHeld {
                        op: "PlacedModel::tensor",
                        layer,
                        expert,
                        held,
                    },
                    Err(e) => e,
                    Ok(_) => Error::invalid(
                        "PlacedModel::tensor",
                        format!("layer {layer} expert {expert} is held but was not placed"),
                    ),
                });
            }
            Place::Padded { layer, expert } => {
                return Err(Error::wrong_backing(
                    "PlacedModel::tensor",
                    format!(
                        "{} (layer {layer} expert {expert}): its sliced rows are not back to \
                         back in the slot (piece_align or piece_congruence padded them)",
                        crate::error::quote(name)
                    ),
                    BACK_TO_BACK,
                ));
            }
            _ => {}
        }
        self.view(t)
    }

    fn view<'a>(&'a self, t: &'a PlacedTensor) -> Result<TensorView<'a>> {
        let bytes = match t.place {
            Place::Dense {
                store,
                layer,
                offset,
                len,
            } => Some(piece(
                self.stores[store].store.weights_local(layer, 0)?,
                offset,
                len,
            )),
            Place::ExpertPiece {
                layer,
                expert,
                kind,
                offset,
                len,
            } => {
                let store = self.expert_store()?;
                let slot = match kind {
                    Kind::Weights => store.weights_local(layer, expert)?,
                    Kind::Scales => store.scales_local(layer, expert)?,
                };
                Some(piece(slot, offset, len))
            }
            Place::ExpertRun {
                layer,
                first,
                count,
            } => self
                .expert_store()?
                .run_local(layer, (first, count), Kind::Weights)?
                // An attached run is the tensor's length (a forged region is not).
                .filter(|b| b.len() as u64 == t.len),
            Place::Experts | Place::NotHeld { .. } | Place::Padded { .. } => None,
            Place::Empty => Some(&[][..]),
        };
        Ok(TensorView {
            name: &t.name,
            class: t.class,
            layer: t.layer,
            dtype: t.dtype,
            shape: &t.shape,
            bytes,
            slice: t.slice,
        })
    }

    /// Every tensor, in checkpoint order.
    ///
    /// # Errors
    /// As [`PlacedModel::tensor`].
    pub fn tensors(&self) -> impl Iterator<Item = Result<TensorView<'_>>> + '_ {
        self.tensors.iter().map(|t| self.view(t))
    }

    /// Tensors placed.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// Whether the checkpoint had no tensors.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// MoE layer `layer`'s plan; [`Error::NotPacked`] naming `op` where there is none.
    pub(super) fn layer_plan(&self, op: &'static str, layer: usize) -> Result<&LayerPlan> {
        self.expert_plan
            .as_ref()
            .and_then(|p| p.layer(layer))
            .ok_or(Error::NotPacked { op, layer })
    }

    /// The routed experts' store (the slot map stays there for callers who want
    /// offsets: [`PinStore::slot_map`]).
    ///
    /// # Errors
    /// The checkpoint has no routed experts.
    pub fn expert_store(&self) -> Result<&PinStore> {
        self.experts
            .as_ref()
            .ok_or_else(|| Error::empty("PlacedModel", "routed experts in the checkpoint"))
    }

    /// The expert naming used, if the checkpoint has experts.
    pub fn naming(&self) -> Option<&Naming> {
        self.naming.as_ref()
    }

    /// What [`Checkpoint::place`](crate::model::Checkpoint::place) did.
    pub fn report(&self) -> Option<&WholeReport> {
        self.report.as_ref()
    }

    /// The dense store holding `class` (several where patterns gave some of its tensors
    /// other layouts), for callers who want its stats or slot maps.
    pub fn class_stores(&self, class: TensorClass) -> impl Iterator<Item = &PinStore> + '_ {
        self.stores
            .iter()
            .filter(move |s| s.class == class)
            .map(|s| &s.store)
    }

    /// Every copy of tensor `name`'s bytes with its node: each replica of a replicated
    /// dense class; each copy of a per-expert tensor's slot (per node or per domain
    /// replica, a hybrid layer's home copy by its home node and its hot copies); one
    /// entry with no node where there is one copy.
    ///
    /// # Errors
    /// No tensor has this name; a tensor holding every expert of a layer (`[E, …]`, no
    /// one run of bytes: read it with [`PlacedModel::expert`]); an expert outside the
    /// placed share ([`Error::NotHeld`]); a released slot.
    pub fn tensor_copies(&self, name: &str) -> Result<Vec<(Option<crate::node::Node>, &[u8])>> {
        let index = self.by_name.get(name).copied().ok_or_else(|| {
            Error::bad_value(
                "PlacedModel::tensor_copies",
                "tensor name",
                crate::error::quote(name),
                "no tensor of the checkpoint has this name",
            )
        })?;
        let t = &self.tensors[index];
        let (store, layer, offset, len) = match t.place {
            Place::Dense {
                store,
                layer,
                offset,
                len,
            } => (store, layer, offset, len),
            Place::ExpertPiece {
                layer,
                expert,
                kind,
                offset,
                len,
            } => {
                let copies = self.expert_store()?.copies_of(layer, expert, kind)?;
                return Ok(copies
                    .into_iter()
                    .map(|(node, slot)| (node, piece(slot, offset, len)))
                    .collect());
            }
            Place::Experts => {
                return Err(Error::wrong_backing(
                    "PlacedModel::tensor_copies",
                    format!(
                        "{} holds every expert of its layer, in the expert store's slots",
                        crate::error::quote(&t.name)
                    ),
                    ONE_RUN,
                ));
            }
            Place::Empty => return Ok(vec![(None, &[][..])]),
            Place::ExpertRun {
                layer,
                first,
                count,
            } => {
                let store = self.expert_store()?;
                let nodes = store.replica_nodes(layer)?;
                let run = |node| {
                    let run = store.run_near(node, layer, (first, count), Kind::Weights)?;
                    Ok::<_, Error>(run.filter(|b| b.len() as u64 == t.len))
                };
                if nodes.is_empty() {
                    let node = crate::topology::current_node()?;
                    return Ok(run(node)?.map(|b| (None, b)).into_iter().collect());
                }
                return nodes
                    .iter()
                    .filter_map(|n| run(n).map(|b| b.map(|b| (Some(n), b))).transpose())
                    .collect();
            }
            Place::NotHeld { .. } | Place::Padded { .. } => {
                // The same error tensor() gives: outside the share, or no one run of bytes.
                return Err(self.tensor(name).err().unwrap_or_else(|| {
                    Error::empty("PlacedModel::tensor_copies", "copy to give")
                }));
            }
        };
        let store = &self.stores[store].store;
        let nodes = store.replica_nodes(layer)?;
        if nodes.is_empty() {
            return Ok(vec![(None, piece(store.weights(layer, 0)?, offset, len))]);
        }
        nodes
            .iter()
            .map(|n| Ok((Some(n), piece(store.weights_on(n, layer, 0)?, offset, len))))
            .collect()
    }
}

/// `slot[offset..offset + len]`, empty where the slot is shorter (never a panic).
pub(super) fn piece(slot: &[u8], offset: usize, len: usize) -> &[u8] {
    slot.get(offset..offset.saturating_add(len))
        .unwrap_or_default()
}
