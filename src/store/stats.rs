//! What a store measures about itself: loaded bytes, its mappings, pages per node.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;

use super::PinStore;
use super::arena::Arena;
use super::layer::Layer;
use crate::diag;
use crate::error::Result;
use crate::node::Node;
use crate::policy::{DegradeReason, Observed, Placement};
use crate::region::{PagesSource, Region};

/// Figures of the whole store, measured when asked.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct StoreStats {
    /// Layers packed.
    pub layers: usize,
    /// Expert slots whose weights are loaded.
    pub experts_loaded: usize,
    /// Loaded bytes (weights and scales), every replica's.
    pub bytes: u64,
    /// Loaded bytes per node the layout put them on: each replica's
    /// ([`Layout::Replicate`]; a copy of [`Layout::ReplicateDomains`] split evenly over
    /// its domain's nodes, as its interleaved pages are), each block's ([`Layout::SplitExperts`]), each layer's
    /// ([`Layout::LayerPerNode`]); empty for [`Layout::Interleave`] and
    /// [`Layout::Unplaced`]. What the layout meant; `pages_per_node` says where the pages
    /// are.
    ///
    /// [`Layout::Replicate`]: super::Layout::Replicate
    /// [`Layout::ReplicateDomains`]: super::Layout::ReplicateDomains
    /// [`Layout::SplitExperts`]: super::Layout::SplitExperts
    /// [`Layout::LayerPerNode`]: super::Layout::LayerPerNode
    /// [`Layout::Interleave`]: super::Layout::Interleave
    /// [`Layout::Unplaced`]: super::Layout::Unplaced
    pub node_bytes: BTreeMap<Node, u64>,
    /// Mappings the store's regions occupy, counted in `/proc/self/smaps`.
    pub vmas: usize,
    /// `mbind` calls made.
    pub mbind_calls: usize,
    /// Resident pages per node: estimated from a `move_pages` sample of at most
    /// [`PAGE_SAMPLE`] pages (each sampled page counts for `sample_step` pages), or
    /// counted whole from `numa_maps` where the page calls are denied; empty when
    /// `pages_source` is `None`.
    pub pages_per_node: BTreeMap<Node, u64>,
    /// Where `pages_per_node` comes from; `None`: unavailable here (a kernel without
    /// NUMA), which an empty map alone could not tell from "no pages".
    pub pages_source: Option<PagesSource>,
    /// Pages of the store whose node `numa_maps` could not tell: a mapping the kernel
    /// merged across the store's edge (see [`NodeHistogram::merged`]).
    ///
    /// [`NodeHistogram::merged`]: crate::NodeHistogram::merged
    pub pages_merged: u64,
    /// One page in this many was sampled (1: every page, and always 1 from `numa_maps`).
    pub sample_step: usize,
    /// Resident bytes of the store's mappings (`smaps` `Rss`; a mapping the kernel merged
    /// with an equal neighbour counts whole).
    pub resident_bytes: u64,
    /// Of which transparent huge pages (`AnonHugePages`).
    pub anon_huge_bytes: u64,
    /// Of which mapped by other processes too (`Shared_*`: an exported store that
    /// workers attached).
    pub shared_bytes: u64,
    /// Of which private to this process (`Private_*`).
    pub private_bytes: u64,
    /// Bound, or the first degradation met (`None`:
    /// [`Layout::Unplaced`](super::Layout::Unplaced), or nothing bound yet).
    pub placement: Option<Placement>,
}

/// The most pages [`PinStore::stats`] asks `move_pages` about.
pub const PAGE_SAMPLE: usize = 1 << 16;

impl PinStore {
    /// The address span of every region of every copy of every layer, for counting the
    /// mappings that several stores share (`diag::maps_overlapping`).
    pub(crate) fn spans(&self) -> Vec<(usize, usize)> {
        self.layers
            .iter()
            .flat_map(|(_, l)| l.all_arenas().map(Arena::span))
            .collect()
    }

    /// Measures the store: loaded figures, its mappings in `/proc/self/smaps`, `mbind`
    /// calls, and resident pages per node from a bounded `move_pages` sample (or from
    /// `numa_maps` where the page calls are denied).
    ///
    /// # Errors
    /// `/proc/self/maps` or `numa_maps` cannot be read, or `move_pages` fails with an
    /// errno other than `ENOSYS` (which leaves `pages_per_node` empty and
    /// `pages_source` `None`).
    pub fn stats(&self) -> Result<StoreStats> {
        if self.state == super::State::Broken {
            return Err(super::broken("PinStore::stats"));
        }
        let mut node_bytes = BTreeMap::new();
        for (index, layer) in self.layers.iter() {
            super::replica::node_bytes(self, index, layer, &mut node_bytes);
        }
        let layers: Vec<&Layer> = self.layers.iter().map(|(_, l)| &**l).collect();
        let spans = self.spans();
        let total_pages: usize = spans
            .iter()
            .map(|(a, b)| (b - a) / crate::page::page_size())
            .sum();
        let mut sample_step = total_pages.div_ceil(PAGE_SAMPLE).max(1);
        let mut pages_per_node = BTreeMap::new();
        let (mut pages_source, mut pages_merged) = (None, 0);
        let regions: Vec<&Region> = layers
            .iter()
            .flat_map(|l| l.all_arenas().map(Arena::region))
            .collect();
        if let Observed::Known(h) = Region::placement_of_all(&regions, sample_step)? {
            if h.source == PagesSource::NumaMaps {
                sample_step = 1;
            }
            for (node, n) in h.pages {
                pages_per_node.insert(node, (n * sample_step) as u64);
            }
            pages_source = Some(h.source);
            pages_merged = h.merged as u64;
        }
        let smaps = diag::smaps_overlapping(&spans)?;

        Ok(StoreStats {
            layers: layers.len(),
            experts_loaded: layers.iter().map(|l| l.experts_loaded()).sum(),
            bytes: layers
                .iter()
                .flat_map(|l| l.all_arenas())
                .map(Arena::loaded_bytes)
                .sum(),
            node_bytes,
            vmas: smaps.len(),
            resident_bytes: smaps.iter().map(|e| e.rss).sum(),
            anon_huge_bytes: smaps.iter().map(|e| e.anon_huge).sum(),
            shared_bytes: smaps.iter().map(|e| e.shared).sum(),
            private_bytes: smaps.iter().map(|e| e.private).sum(),
            mbind_calls: self.mbind_calls.load(Ordering::Relaxed),
            pages_per_node,
            pages_source,
            pages_merged,
            sample_step,
            placement: self.placement.lock().ok().and_then(|p| *p),
        })
    }

    /// The degradation reason, if placement was refused here.
    pub fn degraded(&self) -> Option<DegradeReason> {
        match self.placement.lock().ok().and_then(|p| *p) {
            Some(Placement::Degraded(reason)) => Some(reason),
            _ => None,
        }
    }
}
