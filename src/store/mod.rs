//! `PinStore`: the read-mostly tensors of a model, packed per layer into two bound
//! regions (weights and scales) at a fixed stride, so that a whole model costs O(layers)
//! mappings and `mbind` calls however many experts it has.

mod arena;
pub mod baseline;
mod budget;
mod load;
mod shared;
mod stats;
pub mod synthetic;
mod table;

use std::collections::BTreeSet;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use arena::Arena;
pub use arena::Kind;
use load::Job;
pub use load::{ExpertSource, MAX_READ};
pub use shared::{Export, Manifest, ManifestRegion};
pub use stats::{PAGE_SAMPLE, StoreStats};

use crate::error::{Error, Result};
use crate::node::NodeSet;
use crate::policy::{MemPolicy, Observed, Placement};

/// How layers are placed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// Every region interleaved page by page over the set: every core reads every
    /// layer, so spread the bandwidth.
    Interleave(NodeSet),
    /// Layer `i` bound to the `i mod n`-th node of the set.
    LayerPerNode(NodeSet),
    /// No binding at all: the baseline, and what a denied container gets anyway.
    Unplaced,
}

/// Options of a [`PinStore`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreOptions {
    /// 2 MiB-aligned regions with `MADV_HUGEPAGE` (default on); off: `MADV_NOHUGEPAGE`,
    /// so that even with THP `always` interleaving stays page by page.
    pub huge_pages: bool,
    /// Fault each region in (`MADV_POPULATE_WRITE`) before loading (default on).
    pub populate: bool,
    /// Threads that fill slots (default: the available parallelism).
    pub loader_threads: usize,
    /// Replace `vm.max_map_count` in the budget check (tests).
    pub vma_budget: Option<usize>,
    /// Back the arenas with memfds (shmem, placed by their shared policy) so that
    /// [`PinStore::export`] can hand them to other processes (default off). Huge pages
    /// then follow `/sys/kernel/mm/transparent_hugepage/shmem_enabled`.
    pub shared: bool,
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            huge_pages: true,
            populate: true,
            loader_threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            vma_budget: None,
            shared: false,
        }
    }
}

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
    /// `pread` calls made (after coalescing).
    pub reads: usize,
    /// The layer's policy (`None` for [`Layout::Unplaced`]).
    pub policy: Option<MemPolicy>,
    /// Bound, or degraded with its reason (`None` for [`Layout::Unplaced`]).
    pub placement: Option<Placement>,
}

#[derive(Debug)]
struct Layer {
    weights: Arena,
    scales: Option<Arena>,
}

impl Layer {
    fn arena(&self, kind: Kind) -> Option<&Arena> {
        match kind {
            Kind::Weights => Some(&self.weights),
            Kind::Scales => self.scales.as_ref(),
        }
    }

    fn arena_mut(&mut self, kind: Kind) -> Option<&mut Arena> {
        match kind {
            Kind::Weights => Some(&mut self.weights),
            Kind::Scales => self.scales.as_mut(),
        }
    }

    fn arenas(&self) -> impl Iterator<Item = &Arena> {
        std::iter::once(&self.weights).chain(self.scales.as_ref())
    }
}

/// Per-layer pin arenas for same-shape tensors.
///
/// # Example
/// ```
/// use numapin::store::{ExpertSource, LayerSpec, Layout, PinStore, StoreOptions};
/// use numapin::NodeSet;
///
/// let store = PinStore::new(Layout::Interleave(NodeSet::allowed()?), StoreOptions::default())?;
/// let weights = vec![vec![1u8; 5000], vec![2u8; 5000]];
/// let scales = vec![vec![9u8; 100], vec![8u8; 100]];
/// let sources: Vec<ExpertSource> = (0..2)
///     .map(|e| ExpertSource::Memory { weights: &weights[e], scales: &scales[e] })
///     .collect();
/// let spec = LayerSpec { experts: 2, weight_bytes: 5000, scale_bytes: 100 };
/// let report = store.pack_layer(0, &spec, &sources)?;
/// assert_eq!(report.regions, 2);
/// assert_eq!(store.weights(0, 1)?, &weights[1][..]);
/// println!("{:?}", store.stats()?);
/// # Ok::<(), numapin::Error>(())
/// ```
pub struct PinStore {
    layout: Layout,
    options: StoreOptions,
    layers: table::Table<Box<Layer>>,
    packing: Mutex<BTreeSet<usize>>,
    mbind_calls: AtomicUsize,
    placement: Mutex<Option<Placement>>,
}

impl std::fmt::Debug for PinStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinStore")
            .field("layout", &self.layout)
            .field("options", &self.options)
            .field("layers", &self.layers.iter().count())
            .finish()
    }
}

/// Removes a layer's "being packed" mark however `pack_layer` ends.
struct PackingMark<'a> {
    set: &'a Mutex<BTreeSet<usize>>,
    layer: usize,
}

impl Drop for PackingMark<'_> {
    fn drop(&mut self) {
        if let Ok(mut set) = self.set.lock() {
            set.remove(&self.layer);
        }
    }
}

const PACK: &str = "PinStore::pack_layer";

impl PinStore {
    /// A store with no layers yet.
    ///
    /// # Errors
    /// A layout with an empty node set, or zero loader threads.
    pub fn new(layout: Layout, options: StoreOptions) -> Result<PinStore> {
        if let Layout::Interleave(set) | Layout::LayerPerNode(set) = layout
            && set.is_empty()
        {
            return Err(Error::invalid(
                "PinStore::new",
                format!("{layout:?} has no nodes"),
            ));
        }
        if options.loader_threads == 0 {
            return Err(Error::invalid("PinStore::new", "loader_threads is 0"));
        }
        Ok(PinStore {
            layout,
            options,
            layers: table::Table::new(),
            packing: Mutex::new(BTreeSet::new()),
            mbind_calls: AtomicUsize::new(0),
            placement: Mutex::new(None),
        })
    }

    /// The layout.
    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// The policy layer `layer` gets (`None`: unplaced).
    pub fn policy_for(&self, layer: usize) -> Option<MemPolicy> {
        match self.layout {
            Layout::Interleave(set) => Some(MemPolicy::Interleave(set)),
            Layout::LayerPerNode(set) => set
                .nth(layer % set.len())
                .map(|n| MemPolicy::Bind(std::iter::once(n).collect())),
            Layout::Unplaced => None,
        }
    }

    /// Reserves layer `layer`'s regions (weights and, if `scale_bytes > 0`, scales) at a
    /// fixed stride, binds each once before anything touches it, populates them, and
    /// fills every slot from `sources` with the loader threads. The layer becomes
    /// readable only once every slot is loaded.
    ///
    /// # Errors
    /// The layer is packed (or being packed) already, its index is too large, the expert
    /// count does not match `sources`, a source is larger than its slot, a file piece
    /// runs past the end of its file (the error names the offset), sizes overflow, the
    /// map budget would be crossed ([`Error::MapBudget`]), or a call fails. The store
    /// stays usable after any of these.
    pub fn pack_layer(
        &self,
        layer: usize,
        spec: &LayerSpec,
        sources: &[ExpertSource<'_>],
    ) -> Result<LayerReport> {
        let lengths = self.validate(layer, spec, sources)?;
        let _mark = self.mark_packing(layer)?;
        let regions = 1 + usize::from(spec.scale_bytes > 0);
        self.check_budget(format!("layer {layer}"), regions, spec.experts * regions)?;

        let backing = arena::Backing::of(&self.options, layer);
        let mut weights = Arena::reserve(Kind::Weights, spec.experts, spec.weight_bytes, &backing)?;
        let mut scales = match spec.scale_bytes {
            0 => None,
            n => Some(Arena::reserve(Kind::Scales, spec.experts, n, &backing)?),
        };

        let policy = self.policy_for(layer);
        let mut placement = None;
        if let Some(policy) = &policy {
            for arena in std::iter::once(&weights).chain(scales.as_ref()) {
                let p = arena.bind(policy)?;
                self.mbind_calls.fetch_add(1, Ordering::Relaxed);
                placement = Some(self.note_placement(p));
            }
        }
        if self.options.populate {
            weights.region.populate_write()?;
            if let Some(scales) = scales.as_mut() {
                scales.region.populate_write()?;
            }
        }

        let mut jobs = Vec::with_capacity(spec.experts * regions);
        let mut arenas = vec![(Kind::Weights, &mut weights)];
        arenas.extend(scales.as_mut().map(|a| (Kind::Scales, a)));
        for (kind, arena) in &mut arenas {
            let kind = *kind;
            let slices = arena.region.as_mut_slice()?.chunks_mut(arena.stride);
            for (expert, (dest, source)) in slices.zip(sources).enumerate() {
                jobs.push(Job {
                    dest,
                    part: source.part(kind),
                    expert,
                    kind,
                });
            }
        }
        let reads = load::fill(jobs, self.options.loader_threads)?;
        for (kind, arena) in arenas {
            arena.loaded = lengths.iter().map(|l| Some(l[kind as usize])).collect();
        }
        let bytes = lengths.iter().flatten().map(|&n| n as u64).sum();

        let report = LayerReport {
            layer,
            experts: spec.experts,
            weight_stride: weights.stride,
            scale_stride: scales.as_ref().map_or(0, |a| a.stride),
            bytes,
            regions,
            mbind_calls: if policy.is_some() { regions } else { 0 },
            reads,
            policy,
            placement,
        };
        self.layers
            .set(layer, Box::new(Layer { weights, scales }))
            .map_err(|_| Error::invalid(PACK, format!("layer {layer} is already packed")))?;
        Ok(report)
    }

    /// Checks the request; returns each expert's `[weights, scales]` byte counts.
    fn validate(
        &self,
        layer: usize,
        spec: &LayerSpec,
        sources: &[ExpertSource<'_>],
    ) -> Result<Vec<[usize; 2]>> {
        if layer >= table::MAX_INDEX {
            return Err(Error::invalid(
                PACK,
                format!(
                    "layer {layer} is beyond the store's {} layers",
                    table::MAX_INDEX
                ),
            ));
        }
        if spec.experts == 0 || spec.weight_bytes == 0 {
            return Err(Error::invalid(
                PACK,
                format!("layer {layer}: {spec:?} has no experts or no weight bytes"),
            ));
        }
        if sources.len() != spec.experts {
            return Err(Error::invalid(
                PACK,
                format!(
                    "layer {layer}: the spec has {} experts but {} sources were given",
                    spec.experts,
                    sources.len()
                ),
            ));
        }
        sources
            .iter()
            .enumerate()
            .map(|(expert, source)| check_fits(layer, expert, spec, source))
            .collect()
    }

    fn mark_packing(&self, layer: usize) -> Result<PackingMark<'_>> {
        let already = || Error::invalid(PACK, format!("layer {layer} is already packed"));
        if self.layers.get(layer).is_some() {
            return Err(already());
        }
        let mut set = self
            .packing
            .lock()
            .map_err(|_| Error::invalid(PACK, "a loader thread panicked earlier"))?;
        if !set.insert(layer) {
            return Err(Error::invalid(
                PACK,
                format!("layer {layer} is being packed by another thread"),
            ));
        }
        Ok(PackingMark {
            set: &self.packing,
            layer,
        })
    }

    fn note_placement(&self, placement: Placement) -> Placement {
        let Ok(mut slot) = self.placement.lock() else {
            return placement;
        };
        // The first degradation sticks: one degraded region makes the store degraded.
        match (*slot, placement) {
            (Some(Placement::Degraded(_)), _) => {}
            _ => *slot = Some(placement),
        }
        placement
    }

    fn layer(&self, layer: usize) -> Result<&Layer> {
        self.layers
            .get(layer)
            .map(|b| &**b)
            .ok_or_else(|| Error::invalid("PinStore", format!("layer {layer} is not packed")))
    }

    fn slot(&self, layer: usize, expert: usize, kind: Kind) -> Result<&[u8]> {
        let l = self.layer(layer)?;
        let Some(arena) = l.arena(kind) else {
            return Ok(&[]);
        };
        if expert >= arena.loaded.len() {
            return Err(out_of_range(layer, expert, arena.loaded.len()));
        }
        arena.loaded_slice(expert).ok_or_else(|| {
            Error::invalid(
                "PinStore",
                format!(
                    "{} is released; ensure() loads it again",
                    describe(layer, expert, kind)
                ),
            )
        })
    }

    /// Exactly the weight bytes loaded for `expert` of `layer`.
    ///
    /// # Errors
    /// The layer is not packed, the expert is out of range, or its weights are released.
    pub fn weights(&self, layer: usize, expert: usize) -> Result<&[u8]> {
        self.slot(layer, expert, Kind::Weights)
    }

    /// Exactly the scale bytes loaded for `expert` of `layer` (empty if the layer has no
    /// scales).
    ///
    /// # Errors
    /// As [`PinStore::weights`].
    pub fn scales(&self, layer: usize, expert: usize) -> Result<&[u8]> {
        self.slot(layer, expert, Kind::Scales)
    }

    /// The policy the kernel holds for one tensor's slot (`get_mempolicy(MPOL_F_ADDR)`):
    /// the proof that a released slot kept its policy.
    ///
    /// # Errors
    /// The layer is not packed, the expert is out of range, the layer has no such
    /// tensor, or `get_mempolicy` fails with an errno other than `EPERM`/`ENOSYS`.
    pub fn slot_policy(
        &self,
        layer: usize,
        expert: usize,
        kind: Kind,
    ) -> Result<Observed<(MemPolicy, crate::ModeFlags)>> {
        let arena = self.layer(layer)?.arena(kind).ok_or_else(|| {
            Error::invalid("PinStore", format!("layer {layer} has no {}", kind.name()))
        })?;
        if expert >= arena.loaded.len() {
            return Err(out_of_range(layer, expert, arena.loaded.len()));
        }
        arena.region.policy_at(arena.slot_range(expert).start)
    }

    /// Releases both tensors of an expert. See [`PinStore::release_kind`].
    ///
    /// # Errors
    /// As [`PinStore::release_kind`].
    pub fn release(&mut self, layer: usize, expert: usize) -> Result<()> {
        self.release_kind(layer, expert, Kind::Weights)?;
        self.release_kind(layer, expert, Kind::Scales)
    }

    /// Gives one tensor's pages back (`MADV_DONTNEED` over its slot). The slot's
    /// addresses and the region's policy stay; reading it is an error until
    /// [`PinStore::ensure`] loads it again, which faults under the same policy.
    ///
    /// # Errors
    /// The layer is not packed or the expert is out of range.
    pub fn release_kind(&mut self, layer: usize, expert: usize, kind: Kind) -> Result<()> {
        let arena = self.arena_mut(layer, expert, kind)?;
        let Some(arena) = arena else { return Ok(()) };
        let range = arena.slot_range(expert);
        arena.region.release(range)?;
        arena.loaded[expert] = None;
        Ok(())
    }

    fn arena_mut(&mut self, layer: usize, expert: usize, kind: Kind) -> Result<Option<&mut Arena>> {
        let l = self
            .layers
            .get_mut(layer)
            .ok_or_else(|| Error::invalid("PinStore", format!("layer {layer} is not packed")))?;
        let experts = l.weights.loaded.len();
        if expert >= experts {
            return Err(out_of_range(layer, expert, experts));
        }
        Ok(l.arena_mut(kind))
    }

    /// Loads whatever of `expert` is released (weights, scales, or both) from `source`
    /// into its own slot, under the policy the region kept. Loaded tensors are left as
    /// they are.
    ///
    /// # Errors
    /// As [`PinStore::release_kind`], a source larger than the slot, or a read fails (the
    /// slot then stays released).
    pub fn ensure(&mut self, layer: usize, expert: usize, source: &ExpertSource<'_>) -> Result<()> {
        let l = self.layer(layer)?;
        let spec = LayerSpec {
            experts: l.weights.loaded.len(),
            weight_bytes: l.weights.slot_bytes,
            scale_bytes: l.scales.as_ref().map_or(0, |a| a.slot_bytes),
        };
        let lengths = check_fits(layer, expert, &spec, source)?;
        for kind in [Kind::Weights, Kind::Scales] {
            let Some(arena) = self.arena_mut(layer, expert, kind)? else {
                continue;
            };
            if arena.loaded[expert].is_some() {
                continue;
            }
            let part = source.part(kind);
            let len = lengths[kind as usize];
            let range = arena.slot_range(expert);
            let dest = &mut arena.region.as_mut_slice()?[range];
            load::fill_slot(dest, part, expert, kind)?;
            arena.loaded[expert] = Some(len);
        }
        Ok(())
    }
}

fn out_of_range(layer: usize, expert: usize, experts: usize) -> Error {
    Error::invalid(
        "PinStore",
        format!("expert {expert} is out of range: layer {layer} has {experts}"),
    )
}

fn describe(layer: usize, expert: usize, kind: Kind) -> String {
    format!("layer {layer} expert {expert} {}", kind.name())
}

/// Checks that `source` fits its slots; returns its `[weights, scales]` byte counts.
fn check_fits(
    layer: usize,
    expert: usize,
    spec: &LayerSpec,
    source: &ExpertSource<'_>,
) -> Result<[usize; 2]> {
    if expert >= spec.experts {
        return Err(out_of_range(layer, expert, spec.experts));
    }
    let mut lengths = [0; 2];
    for (kind, max) in [
        (Kind::Weights, spec.weight_bytes),
        (Kind::Scales, spec.scale_bytes),
    ] {
        let what = || describe(layer, expert, kind);
        let len = source.part(kind).checked_len(&what)?;
        if len > max {
            return Err(Error::invalid(
                PACK,
                format!(
                    "{}: the source has {len} bytes but the slot holds {max}",
                    what()
                ),
            ));
        }
        lengths[kind as usize] = len;
    }
    Ok(lengths)
}
