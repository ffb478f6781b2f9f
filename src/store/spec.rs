//! [`LayerSpec`], the shape of a layer a store packs, and [`LayerReport`], what packing it
//! did.

use super::{DirectIo, ExpertSource, Kind, ReadFallback, ReadMode};
#[cfg(doc)]
use super::{Layout, PinStore, StoreOptions};
use crate::error::Result;
use crate::policy::{MemPolicy, Placement};

/// The shape of one layer: how many experts, and the most bytes one expert's weights and
/// scales can have.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerSpec {
    /// Experts in the layer.
    pub experts: usize,
    /// Maximum weight bytes of one expert.
    pub weight_bytes: usize,
    /// Maximum scale bytes of one expert (0: the layer has no scales region).
    pub scale_bytes: usize,
}

impl LayerSpec {
    /// The spec that fits `sources` exactly: one expert per source, and the largest
    /// weights and scales among them.
    ///
    /// # Errors
    /// A source's piece lengths overflow.
    ///
    /// # Example
    /// ```
    /// use numapin::store::{ExpertSource, LayerSpec};
    /// let (a, b) = (vec![0u8; 100], vec![0u8; 120]);
    /// let sources = [
    ///     ExpertSource::Memory { weights: &a, scales: &[] },
    ///     ExpertSource::Memory { weights: &b, scales: &a[..4] },
    /// ];
    /// let spec = LayerSpec::fitting(&sources)?;
    /// assert_eq!(spec, LayerSpec { experts: 2, weight_bytes: 120, scale_bytes: 4 });
    /// # Ok::<(), numapin::Error>(())
    /// ```
    pub fn fitting(sources: &[ExpertSource<'_>]) -> Result<LayerSpec> {
        let mut spec = LayerSpec {
            experts: sources.len(),
            weight_bytes: 0,
            scale_bytes: 0,
        };
        for source in sources {
            for kind in Kind::ALL {
                let bytes = source.bytes(kind)?;
                let max = spec.bytes_mut(kind);
                *max = (*max).max(bytes);
            }
        }
        Ok(spec)
    }

    /// The most bytes one expert's tensor `kind` can have.
    pub fn bytes(&self, kind: Kind) -> usize {
        match kind {
            Kind::Weights => self.weight_bytes,
            Kind::Scales => self.scale_bytes,
        }
    }

    pub(super) fn bytes_mut(&mut self, kind: Kind) -> &mut usize {
        match kind {
            Kind::Weights => &mut self.weight_bytes,
            Kind::Scales => &mut self.scale_bytes,
        }
    }

    /// The tensor kinds this layer has a region for (weights always; scales when
    /// `scale_bytes > 0`).
    pub fn kinds(&self) -> impl Iterator<Item = Kind> + '_ {
        Kind::ALL
            .into_iter()
            .filter(|&k| k == Kind::Weights || self.bytes(k) > 0)
    }
}

/// What [`PinStore::pack_layer`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct LayerReport {
    /// The layer.
    pub layer: usize,
    /// Experts loaded.
    pub experts: usize,
    /// Distance between weight slots.
    pub weight_stride: usize,
    /// Distance between scale slots (0 without scales).
    pub scale_stride: usize,
    /// Bytes loaded (weights and scales).
    pub bytes: u64,
    /// Regions reserved (2, or 1 without scales).
    pub regions: usize,
    /// `mbind` calls made for this layer.
    pub mbind_calls: usize,
    /// `pread` calls planned (after coalescing; a direct read may split one into aligned
    /// windows).
    pub reads: usize,
    /// Bytes a [`ReadMode::Direct`] load copied into the slots through the loaders'
    /// bounce buffers rather than reading them in place: pieces whose slot address does
    /// not follow their file offset, and the partial alignment units at the ends of the
    /// ones that do (see [`StoreOptions::piece_congruence`]). 0 for other read modes.
    ///
    pub bounced_bytes: u64,
    /// What the direct reads did: bytes in place, reads per mechanism, the ring depth
    /// reached (all 0 where nothing was read directly).
    #[cfg_attr(feature = "serde", serde(default))]
    pub direct_reads: crate::source::DirectReads,
    /// How the files were read: [`StoreOptions::read_mode`], or [`ReadMode::Buffered`]
    /// when a direct read fell back (then [`LayerReport::read_fallback`] says why).
    pub read_mode: ReadMode,
    /// Why [`ReadMode::Direct`] fell back to buffered reads (the first file that did),
    /// if it did.
    pub read_fallback: Option<ReadFallback>,
    /// How the direct reads were issued: through `io_uring`, or on blocking loader threads
    /// and why ([`DirectIo::Threads`]); `None` where no file was read directly.
    pub direct_io: Option<DirectIo>,
    /// How each source file was read and why, in the order the sources name them
    /// (for [`ReadMode::Auto`]: each file's page-cache residency and the mode it picked).
    pub files: Vec<crate::source::FileRead>,
    /// The layer's policy (`None` for [`Layout::Unplaced`] and [`Layout::SplitExperts`],
    /// whose blocks each have their own; the first copy's for [`Layout::Replicate`]).
    pub policy: Option<MemPolicy>,
    /// Copies of the layer: the nodes of [`Layout::Replicate`], the domains of
    /// [`Layout::ReplicateDomains`] (1 where placement
    /// degraded), 1 for the other layouts.
    pub replicas: usize,
    /// Bytes written by a loader running on the node they were bound to (for a node
    /// without CPUs, such as CXL memory: on the nearest node with CPUs), over every copy
    /// (0 for [`Layout::Interleave`] and [`Layout::Unplaced`], which bind to no single
    /// node). With [`LayerReport::bytes`] × [`LayerReport::replicas`] it says how much
    /// of the load was node-local.
    pub local_bytes: u64,
    /// Loader threads that could not run on their target node (none of its CPUs in the
    /// thread's allowed set, or `sched_setaffinity` refused) and loaded from where they
    /// were, summed over the fill and each replica's copy.
    pub off_node_loaders: usize,
    /// The nodes whose CPUs the loader threads ran on, over every copy, distinct and
    /// sorted: for [`Layout::Interleave`] spread one per node (loader `w` on the `w mod
    /// n`-th node of the set), for the other layouts the node each loader filled. A node
    /// without CPUs (CXL or HBM memory) is filled from the nearest node with CPUs the
    /// process may use (by sysfs distance, ties to the lower id). Empty where no loader
    /// could move (placement degraded, or `sched_setaffinity` refused).
    pub loader_nodes: Vec<crate::node::Node>,
    /// Bound, or degraded with its reason (`None` for [`Layout::Unplaced`]).
    pub placement: Option<Placement>,
}
