//! What [`Checkpoint::place`](crate::model::Checkpoint::place) did ([`WholeReport`]), and
//! what the check of every placed tensor, every copy, against the files found
//! ([`WholeVerify`]): the figures, not how they are taken (`measure`).

use std::fmt;

use super::assign::PlacementCost;
use super::classes::TensorClass;
use crate::model::{ModelReport, VerifyReport};

/// What placing a checkpoint whole did: the plan, its cost as counted before anything
/// was reserved, and what each class's stores measured.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct WholeReport {
    /// The plan in its text form.
    pub plan: String,
    /// Which share was placed ([`PlacementPlan::share_text`]); `None`: the whole model.
    ///
    /// [`PlacementPlan::share_text`]: super::PlacementPlan::share_text
    pub share: Option<String>,
    /// The expert naming (none: the checkpoint has no routed experts).
    pub naming: Option<String>,
    /// Files of the checkpoint.
    pub files: usize,
    /// Tensors of the checkpoint, every one placed.
    pub tensors: usize,
    /// Their bytes, as in the files (the whole checkpoint's; the cost counts the share).
    pub bytes: u64,
    /// The plan's cost, per class (with why each class has its layout).
    pub cost: PlacementCost,
    /// Measured per class, in the order of `cost.classes`.
    pub measured: Vec<ClassMeasured>,
    /// Distinct mappings of the process that the placement's regions lie in (lines of
    /// `/proc/self/maps` overlapping any region of any store, each counted once): the
    /// total, where the classes' [`ClassMeasured::mappings`] count a mapping the kernel
    /// merged across classes once in each.
    pub mappings: usize,
    /// The experts' pack report, as [`Checkpoint::pack`](crate::model::Checkpoint::pack)
    /// gives it.
    pub experts: Option<ModelReport>,
    /// The tensors converted at placement, one line each: `NAME BF16 -> F32 (N bytes
    /// in the file, M placed)` ([`PlacementPlan::convert_class`](super::PlacementPlan::convert_class)).
    #[cfg_attr(feature = "serde", serde(default))]
    pub converted: Vec<String>,
}

/// One class's stores, measured after packing.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct ClassMeasured {
    /// The class.
    pub class: TensorClass,
    /// Mappings its stores' regions lie in (`/proc/self/smaps` lines overlapping them).
    /// Where the kernel merged adjacent regions of equal policy and protection into one
    /// mapping, that mapping counts in every class with a region in it: these do not add
    /// up to the placement's total, [`WholeReport::mappings`].
    pub mappings: usize,
    /// `mbind` calls its stores made.
    pub mbind_calls: usize,
    /// `pread` calls its loads made (dense classes; the experts' are in their report).
    pub reads: usize,
    /// Bytes its [`ReadMode::Direct`](crate::store::ReadMode::Direct) loads copied through
    /// the bounce buffer instead of reading in place (dense classes; the experts' are in
    /// their report's [`LayerReport::bounced_bytes`](crate::store::LayerReport::bounced_bytes)).
    pub bounced_bytes: u64,
    /// What its direct loads did: bytes in place, reads per mechanism, ring depth (the
    /// experts' summed over their layers' reports).
    #[cfg_attr(feature = "serde", serde(default))]
    pub direct_reads: crate::source::DirectReads,
    /// `bound`, `unplaced`, or `degraded: REASON` (one copy, no policy).
    pub placement: String,
    /// Wall nanoseconds its loads took (its stores' `pack_layer` calls, one after the
    /// other).
    pub load_nanos: u64,
    /// How its loads read each file and why ([`FileRead`](crate::store::FileRead): for
    /// [`ReadMode::Auto`](crate::source::ReadMode::Auto) the file's residency and the mode
    /// it picked), the first load of each file.
    pub files: Vec<crate::store::FileRead>,
}

/// What [`PlacedModel::verify`](super::PlacedModel::verify) found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct WholeVerify {
    /// Tensors re-read and compared (dense ones and per-expert ones; the pieces of
    /// tensors holding every expert are in `experts`).
    pub tensors: usize,
    /// Copies compared (a replicated tensor has one per node).
    pub copies: usize,
    /// Bytes compared over every copy.
    pub bytes: u64,
    /// Reads made, the experts' slots' included: windows of the files of up to 32 MiB
    /// (see [`WholeVerify::direct`]).
    pub reads: usize,
    /// Copies that differ.
    pub mismatched: usize,
    /// The first [`VerifyReport::MAX_LISTED`] of them.
    pub mismatches: Vec<String>,
    /// The experts' slots, compared as
    /// [`Checkpoint::verify_with`](crate::model::Checkpoint::verify_with) does.
    pub experts: Option<VerifyReport>,
    /// Wall nanoseconds the re-reads and compares took, per class (in class order; the
    /// routed experts' under [`TensorClass::RoutedExperts`]): every class is read in one
    /// pass, whose wall time is shared out by the threads' time on each class's bytes
    /// (plus each class's own set-up).
    pub class_nanos: Vec<(TensorClass, u64)>,
    /// What the direct re-reads did, the experts' slots' included (one pass reads
    /// every class): bytes read in place, requests per mechanism, the deepest queue.
    pub direct: crate::source::DirectReads,
}

impl WholeVerify {
    /// Whether every copy of every tensor, and every expert slot, is exactly the file's.
    pub fn verified(&self) -> bool {
        self.mismatched == 0 && self.experts.as_ref().is_none_or(VerifyReport::verified)
    }
}

impl fmt::Display for WholeVerify {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.verified() {
            write!(
                f,
                "verified: {} tensors in {} copies ({} bytes) equal to the files",
                self.tensors, self.copies, self.bytes
            )?;
        } else {
            write!(f, "NOT verified: {} copies differ", self.mismatched)?;
            if let Some(m) = self.mismatches.first() {
                write!(f, "; first: {m}")?;
            }
        }
        if let Some(e) = &self.experts {
            write!(f, "; experts {e}")?;
        }
        Ok(())
    }
}

impl fmt::Display for WholeReport {
    /// A table: per class its layout, tensors, bytes, groups, mappings (planned and
    /// measured), `mbind` calls, one-mapping-per-tensor, and why.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "plan {} ({} tensors, {} bytes, {} file(s), naming {})",
            self.plan,
            self.tensors,
            self.bytes,
            self.files,
            self.naming.as_deref().unwrap_or("none")
        )?;
        if let Some(share) = &self.share {
            writeln!(
                f,
                "  share placed: {share} (cost and budgets count the share)"
            )?;
        }
        if !self.converted.is_empty() {
            writeln!(
                f,
                "  converted at placement ({} tensors): {}",
                self.converted.len(),
                self.converted.join("; ")
            )?;
        }
        writeln!(
            f,
            "  {:<11} {:<22} {:>7} {:>12} {:>6} {:>9} {:>9} {:>6} {:>10}  placement; why",
            "class",
            "layout",
            "tensors",
            "bytes",
            "groups",
            "mappings",
            "measured",
            "mbind",
            "per-tensor"
        )?;
        for c in &self.cost.classes {
            let m = self.measured.iter().find(|m| m.class == c.class);
            writeln!(
                f,
                "  {:<11} {:<22} {:>7} {:>12} {:>6} {:>9} {:>9} {:>6} {:>10}  {}; {}",
                c.class.name(),
                c.layout,
                c.tensors,
                c.bytes,
                c.groups,
                c.mappings,
                m.map_or(0, |m| m.mappings),
                m.map_or(0, |m| m.mbind_calls),
                c.per_tensor_mappings,
                m.map_or("", |m| m.placement.as_str()),
                c.why
            )?;
            if !c.slices.is_empty() {
                // What an engine checks it got: the slices of the class's tensors.
                writeln!(f, "  {:<11} slices held: {}", "", c.slices)?;
            }
        }
        let nodes: Vec<String> = self
            .cost
            .node_bytes
            .iter()
            .map(|(n, b)| format!("node {}: {b}", n.0))
            .collect();
        write!(
            f,
            "  total: {} mappings planned ({} measured, distinct), {} mbind calls planned, \
             against {} for one mapping per tensor; bytes per node {}",
            self.cost.mappings,
            self.mappings,
            self.cost.mbind_calls,
            self.cost.per_tensor_mappings,
            if nodes.is_empty() {
                "none bound".to_owned()
            } else {
                nodes.join(", ")
            }
        )
    }
}

/// Wall nanoseconds since `started` (saturating at `u64::MAX`, 584 years).
pub(crate) fn nanos_since(started: std::time::Instant) -> u64 {
    u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX)
}
