//! The whole model placed: every tensor of a checkpoint under a layout per tensor class
//! ([`PlacementPlan`]), packed so that dense tensors cost O(layers) mappings, with typed
//! views ([`PlacedModel::tensor`], [`PlacedModel::expert`]), a verification of every copy
//! and a report per class.
//!
//! The rooms: `classes` (what a name is for), `plan` (layouts per class and pattern),
//! `shape` (a tensor's shape, block and dense slice: the leaf the others read), `assign` (a
//! plan applied to a checkpoint and priced, nothing reserved), `piece_layout` (where the
//! pieces start in their slots), `fit` (the plan against the machine's memory and map
//! budget; the default plan), `place` (the fills, then the placed model), `views` and
//! `expert_views` (lookups), `report` (what was done and verified: the figures),
//! `measure` (how they are taken: mappings, classes, every copy re-read), `schedule` (the
//! order of the fills, and drop-behind shared by all the stores of a placement),
//! `role_major` (role-major expert slots: DBRX's per-role tensors as one run each).
//!
//! # Shape: one store per class and layout
//! Dense tensors reuse [`PinStore`](crate::store::PinStore): each (class, model layer,
//! layout) group is one layer of its store with a single slot holding the group's
//! tensors in file order at multiples of `max(piece_align, 64)` (for direct reads, each
//! congruent to its file offset modulo the larger of 64 and the file's direct-I/O memory
//! alignment instead, so that its read lands in place: see [`StoreOptions::piece_congruence`](crate::store::StoreOptions::piece_congruence)).
//! So binding before first touch, replicas, the map budget, loaders and the slot map are
//! the store's, and a group costs one mapping per copy.
//!
//! # Example
//! ```no_run
//! use numapin::model::{Checkpoint, DenseLayout, PlacementPlan, TensorClass};
//! use numapin::store::{Layout, StoreOptions};
//! use numapin::NodeSet;
//!
//! let checkpoint = Checkpoint::open("/models/deepseek-v3")?;
//! let all = NodeSet::allowed()?;
//! let plan = PlacementPlan::new(Layout::SplitExperts(all), DenseLayout::Replicate(all))
//!     .class(TensorClass::Embeddings, DenseLayout::Interleave(all));
//! println!("{:?}", checkpoint.placement_cost(&plan, &StoreOptions::default())?);
//! let model = checkpoint.place(&plan, StoreOptions::default())?;
//! let q = model.tensor("model.layers.0.self_attn.q_a_proj.weight")?;
//! println!("{} {:?} {} bytes", q.dtype(), q.shape(), q.bytes().unwrap_or_default().len());
//! assert!(model.verify(&checkpoint)?.verified());
//! # Ok::<(), numapin::Error>(())
//! ```

mod assign;
mod classes;
mod convert;
mod expert_tensors;
mod expert_views;
mod export;
mod fit;
mod framework;
mod glob;
mod identity;
mod measure;
mod pack_converted;
mod piece_layout;
mod place;
mod plan;
mod report;
mod role_major;
mod schedule;
mod served;
mod shape;
mod structure;
mod text;
pub(crate) mod tp;
mod verify;
mod views;
mod wire;

pub use assign::{ClassCost, DENSE_ALIGN, PlacementCost};
pub use classes::TensorClass;
pub use expert_views::ExpertPieceView;
pub use export::{MAX_MANIFEST_BYTES, MODEL_MANIFEST_HEADER, ModelExport, ModelManifest};
pub use framework::{FrameworkPlan, FrameworkStyle};
pub use plan::{DenseLayout, PlacementPlan};
pub use report::{ClassMeasured, WholeReport, WholeVerify};
pub(crate) use shape::normalized_shape;
pub use shape::{Block, DenseSlice};
pub use structure::{ExpertRole, ExpertTensorRef};
pub use views::{PlacedModel, TensorView};
