//! A rank's share of a checkpoint: which experts of each layer this process places
//! ([`ExpertShare`], expert parallelism) and which slice of each expert tensor
//! ([`TensorSlice`], tensor parallelism), together a [`Share`].
//!
//! A share is applied to an [`ExpertPlan`] ([`ExpertPlan::share`]): the plan keeps only
//! the held experts (each layer remembers their global ids) and, with a slice, only the
//! sliced bytes of each of their pieces. Packing that plan
//! ([`Checkpoint::pack_share`](super::Checkpoint::pack_share)) gives the store slots for
//! the held experts alone, looked up by global id; everything sized from the plan (the
//! map budget, the layouts' blocks, the report) counts the share, not the whole.

mod experts;

use std::fmt;

pub use experts::ExpertShare;

use super::slice::{RoleSlice, RoleSlicer, TensorSlice};
use super::{Checkpoint, ExpertPieces, ExpertPlan, LayerPlan};
use crate::error::{Error, Result};
use crate::store::ids_text;

/// What a rank places: its experts and, optionally, a slice of each expert tensor.
/// `#[non_exhaustive]`; built with [`Share::default`] (everything) and the setters.
///
/// # Example
/// ```
/// use numapin::model::{ExpertShare, Share, TensorSlice};
/// let share = Share::default()
///     .experts(ExpertShare::parse("0-63")?)
///     .slice(TensorSlice::parse("rows:0/2")?);
/// assert_eq!(share.to_string(), "experts 0-63, slice rows:0/2");
/// # Ok::<(), numapin::Error>(())
/// ```
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct Share {
    /// The experts of each layer held.
    pub experts: ExpertShare,
    /// The slice of each expert tensor held (`None`: whole tensors).
    pub tensor_slice: Option<TensorSlice>,
    /// Rank `k` of a tensor-parallel group of `n`: each role sliced by the convention
    /// (gate and up: the output dimension; down: the input dimension, each on the axis
    /// its [`Orientation`](super::Orientation) puts it). Exclusive with
    /// [`Share::tensor_slice`]: a share with both is refused when it is cut.
    pub tensor_parallel: Option<(u64, u64)>,
}

impl Share {
    /// [`Share::experts`].
    #[must_use]
    pub fn experts(mut self, experts: ExpertShare) -> Self {
        self.experts = experts;
        self
    }

    /// [`Share::tensor_slice`].
    #[must_use]
    pub fn slice(mut self, slice: TensorSlice) -> Self {
        self.tensor_slice = Some(slice);
        self
    }

    /// [`Share::tensor_parallel`]: rank `k` of `n`, gate and up cut along their output
    /// dimension, down along its input dimension (rows and columns of `[out, in]`; DBRX's
    /// `[in, out]` `w2` by rows; a fused gate_up stored gate rows then up rows by rows
    /// k/n of each half, transformers' `packed_colwise`); an unknown role, or a fused
    /// gate_up of another layout, is an error when the share is placed.
    ///
    /// # Errors
    /// `n` is 0 or `k ≥ n`; the share has a [`Share::tensor_slice`] already
    /// ([`Share::exclusive_slices`]).
    pub fn tensor_parallel(mut self, k: u64, n: u64) -> Result<Self> {
        TensorSlice::part(super::SliceAxis::Rows, k, n)?;
        self.tensor_parallel = Some((k, n));
        self.exclusive_slices()?;
        Ok(self)
    }

    /// `Ok` unless both [`Share::tensor_slice`] and [`Share::tensor_parallel`] are set:
    /// each says how to cut every expert tensor, and neither is applied over the other.
    ///
    /// # Errors
    /// [`Invalid::BadValue`](crate::error::Invalid::BadValue) naming both (Python's
    /// `expert_slice=` with `tensor_parallel=`).
    pub fn exclusive_slices(&self) -> Result<()> {
        match (self.tensor_slice, self.tensor_parallel) {
            (Some(slice), Some((k, n))) => Err(Error::bad_value(
                "Share",
                "expert slice with tensor parallelism",
                format!("slice {slice} and tp:{k}/{n}"),
                "a tensor slice of every expert (Share::slice, Python's expert_slice=) and \
                 the tensor-parallel preset (tensor_parallel, which cuts each role its own \
                 way) are exclusive: give one",
            )),
            _ => Ok(()),
        }
    }

    /// Whether this is the whole checkpoint (every expert, whole tensors).
    pub fn is_whole(&self) -> bool {
        self.experts.is_all() && self.tensor_slice.is_none() && self.tensor_parallel.is_none()
    }
}

impl fmt::Display for Share {
    /// `experts 0-63, slice rows:0/2` (`experts all` when whole).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "experts {}", self.experts)?;
        if let Some((k, n)) = self.tensor_parallel {
            write!(
                f,
                ", slice tp:{k}/{n} (gate, up: the output dimension; down: the input dimension)"
            )?;
        } else if let Some(slice) = &self.tensor_slice {
            write!(f, ", slice {slice}")?;
        }
        Ok(())
    }
}

/// What a layer of a shared plan holds: the global ids of its experts, how many the
/// checkpoint's layer has, and how each role was sliced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerShare {
    pub(crate) ids: Vec<usize>,
    pub(crate) of: usize,
    pub(crate) slices: Vec<RoleSlice>,
    /// Whether the layer was complete before it was cut ([`LayerPlan::is_complete`]).
    pub(crate) complete: bool,
}

impl LayerShare {
    /// The global expert id of each slot, increasing.
    pub fn expert_ids(&self) -> &[usize] {
        &self.ids
    }

    /// Experts in the checkpoint's layer (the whole, of which this is a share).
    pub(crate) fn of(&self) -> usize {
        self.of
    }

    /// How each role was sliced, in slot order (empty without a slice).
    pub(crate) fn slices(&self) -> &[RoleSlice] {
        &self.slices
    }
}

impl LayerPlan {
    /// The share this layer holds, when the plan is a share ([`ExpertPlan::share`]).
    pub fn share(&self) -> Option<&LayerShare> {
        self.share.as_ref()
    }

    /// The global expert id of slot `slot` ([`LayerPlan::experts`]'s index).
    pub fn expert_id(&self, slot: usize) -> usize {
        match &self.share {
            Some(s) => s.ids.get(slot).copied().unwrap_or(usize::MAX),
            None => slot,
        }
    }

    /// The pieces of global expert `expert`.
    ///
    /// # Errors
    /// [`Error::NotHeld`] for an expert the share does not hold; [`Error::OutOfRange`]
    /// past the layer's experts.
    pub fn expert(&self, expert: usize) -> Result<&ExpertPieces> {
        let slot = match &self.share {
            Some(s) => s.ids.binary_search(&expert).map_err(|_| Error::NotHeld {
                op: "LayerPlan::expert",
                layer: self.layer,
                expert,
                held: ids_text(&s.ids),
            })?,
            None => expert,
        };
        self.experts.get(slot).ok_or_else(|| Error::OutOfRange {
            op: "LayerPlan::expert",
            what: format!("expert of layer {}", self.layer),
            index: expert,
            len: self.experts.len(),
        })
    }
}

impl ExpertPlan {
    /// This plan cut to a rank's share: each layer keeps the experts `share` holds of it
    /// (their global ids kept in [`LayerPlan::share`]) and, with a tensor slice, only
    /// the sliced bytes of every piece (see [`TensorSlice`]); the slot sizes follow.
    /// `checkpoint` is the one the plan was made from (its tensors' shapes and dtypes
    /// say where a slice lies).
    ///
    /// # Errors
    /// [`ExpertShare::resolve`]'s (an id past a layer's count, nothing held), a plan that
    /// is a share already, and [`TensorSlice`]'s (a slice past an axis, a part that does
    /// not divide it, a cut through a quantization or scale block, a 1-D weight).
    pub fn share(&self, checkpoint: &Checkpoint, share: &Share) -> Result<ExpertPlan> {
        let mut out = self.clone();
        for layer in &mut out.layers {
            if layer.share.is_some() {
                return Err(Error::bad_value(
                    "ExpertPlan::share",
                    "layer",
                    layer.layer,
                    "a share already: share the whole plan once",
                ));
            }
            let of = layer.experts.len();
            let complete = layer.is_complete();
            let ids = share.experts.resolve(layer.layer, of)?;
            // `resolve` keeps every id below the layer's count.
            layer.experts = ids
                .iter()
                .filter_map(|&e| layer.experts.get(e).cloned())
                .collect();
            share.exclusive_slices()?;
            let slicer = match (share.tensor_parallel, share.tensor_slice) {
                (Some((k, n)), _) => Some(RoleSlicer::Tp { k, n }),
                (None, Some(slice)) => Some(RoleSlicer::Uniform(slice)),
                (None, None) => None,
            };
            let slices = match slicer {
                Some(slicer) => super::slice::slice_layer(checkpoint, layer, slicer)?,
                None => Vec::new(),
            };
            layer.share = Some(LayerShare {
                ids,
                of,
                slices,
                complete,
            });
        }
        Ok(out)
    }

    /// Whether some layer holds only a share of its experts or slices of its tensors.
    pub fn is_share(&self) -> bool {
        self.layers.iter().any(|l| l.share.is_some())
    }
}
