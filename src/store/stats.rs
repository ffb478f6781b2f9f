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

/// Figures of the whole store, measured when asked.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct StoreStats {
    /// Layers packed.
    pub layers: usize,
    /// Expert slots whose weights are loaded.
    pub experts_loaded: usize,
    /// Loaded bytes (weights and scales).
    pub bytes: u64,
    /// Mappings the store's regions occupy, counted in `/proc/self/smaps`.
    pub vmas: usize,
    /// `mbind` calls made.
    pub mbind_calls: usize,
    /// Resident pages per node, estimated from a `move_pages` sample of at most
    /// [`PAGE_SAMPLE`] pages (each sampled page counts for `sample_step` pages).
    pub pages_per_node: BTreeMap<Node, u64>,
    /// One page in this many was sampled (1: every page).
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
    /// Measures the store: loaded figures, its mappings in `/proc/self/smaps`, `mbind`
    /// calls, and resident pages per node from a bounded `move_pages` sample.
    ///
    /// # Errors
    /// `/proc/self/maps` cannot be read, or `move_pages` fails with an errno other than
    /// `EPERM`/`ENOSYS` (which leave `pages_per_node` empty).
    pub fn stats(&self) -> Result<StoreStats> {
        if self.state == super::State::Broken {
            return Err(super::broken("PinStore::stats"));
        }
        let layers: Vec<&Layer> = self.layers.iter().map(|(_, l)| &**l).collect();
        let spans: Vec<(usize, usize)> = layers
            .iter()
            .flat_map(|l| l.arenas().map(Arena::span))
            .collect();
        let total_pages: usize = spans
            .iter()
            .map(|(a, b)| (b - a) / crate::page_size())
            .sum();
        let sample_step = total_pages.div_ceil(PAGE_SAMPLE).max(1);
        let mut pages_per_node = BTreeMap::new();
        for arena in layers.iter().flat_map(|l| l.arenas()) {
            match arena.placement_sampled(sample_step)? {
                Observed::Known(h) => {
                    for (node, n) in h.pages {
                        *pages_per_node.entry(node).or_insert(0u64) += (n * sample_step) as u64;
                    }
                }
                Observed::Degraded(_) => break,
            }
        }
        let smaps = diag::smaps_overlapping(&spans)?;

        Ok(StoreStats {
            layers: layers.len(),
            experts_loaded: layers.iter().map(|l| l.experts_loaded()).sum(),
            bytes: layers
                .iter()
                .flat_map(|l| l.arenas())
                .map(Arena::loaded_bytes)
                .sum(),
            vmas: smaps.len(),
            resident_bytes: smaps.iter().map(|e| e.rss).sum(),
            anon_huge_bytes: smaps.iter().map(|e| e.anon_huge).sum(),
            shared_bytes: smaps.iter().map(|e| e.shared).sum(),
            private_bytes: smaps.iter().map(|e| e.private).sum(),
            mbind_calls: self.mbind_calls.load(Ordering::Relaxed),
            pages_per_node,
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
