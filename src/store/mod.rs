//! `PinStore`: the read-mostly tensors of a model, packed per layer into two bound
//! regions (weights and scales) at a fixed stride, so that a whole model costs O(layers)
//! mappings and `mbind` calls however many experts it has.

mod arena;
mod budget;
mod layer;
mod layout;
mod manifest;
mod replica;
mod shared;
mod slot_map;
mod stats;
mod table;

use std::collections::BTreeSet;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::source::load;
pub use crate::source::{
    DROP_BEHIND_EVERY, ExpertSource, Kind, MAPS_PER_THREAD as LOADER_THREAD_MAPS, MAX_READ,
    PROGRESS_STEP, Piece, Progress, ProgressHook, ReadFallback, ReadMode,
};
use arena::Arena;
use layer::Layer;
pub use layout::Layout;
pub use manifest::{Manifest, ManifestRegion};
pub use shared::Export;
pub use slot_map::{SlotMap, SlotPiece};
pub use stats::{PAGE_SAMPLE, StoreStats};

use crate::error::{Error, Result};
use crate::policy::{MemPolicy, Observed, Placement};
use crate::region::Region;

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
    /// Where slots start: the default [`SlotAlign::Page`] wastes less than a page per
    /// slot; [`SlotAlign::HugePage`] lets `release` give back whole huge pages, at up to
    /// 2 MiB of padding per slot.
    pub slot_align: SlotAlign,
    /// How [`PinStore::pack_layer`] reads file pieces (default [`ReadMode::Buffered`]);
    /// [`LayerReport::read_mode`] says what ran. [`PinStore::ensure`] always reads
    /// buffered.
    pub read_mode: ReadMode,
    /// Called with each layer's [`Progress`] while it loads (default none); see
    /// [`ProgressHook`] for the rate and the guarantees.
    pub progress: Option<ProgressHook>,
    /// Where pieces of a file source start inside a slot: at multiples of this power of
    /// two (default 1: back to back). A slot grows by the padding; the padding bytes are
    /// zero. [`PinStore::slot_map`] tells where each piece went.
    pub piece_align: usize,
}

/// The largest slot or piece alignment a store accepts: 1 GiB, the largest huge page.
/// Anything larger only pads slots (a 100-byte piece aligned to 1 TiB asks for a TiB),
/// and with overcommit on, populating would fault all of it in.
pub const MAX_ALIGN: usize = 1 << 30;

/// The alignment of slots inside an arena (the stride is the slot size rounded up to it).
///
/// Whatever the alignment, an arena's region is 2 MiB-aligned with `MADV_HUGEPAGE` when
/// [`StoreOptions::huge_pages`] is on, so transparent huge pages back the region, not
/// each slot. What the alignment changes is `release`: releasing a page-aligned slot
/// inside a THP region splits the huge pages at its edges (lazily: RSS drops at once,
/// `MemFree` may not until the split pages are reclaimed), and khugepaged may collapse a
/// partly released range into a huge page again. Measure a release with RSS or `mincore`,
/// not `MemFree`. Huge-page-aligned slots release whole huge pages, at the price of
/// padding every slot up to a multiple of 2 MiB (a 2 MiB + 1 byte slot takes 4 MiB).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SlotAlign {
    /// The base page (4 KiB): the stride is the slot size rounded up to the page.
    #[default]
    Page,
    /// The transparent huge page (2 MiB).
    HugePage,
    /// Any power of two at least the page size.
    Bytes(usize),
}

impl SlotAlign {
    /// The alignment in bytes.
    ///
    /// # Errors
    /// [`SlotAlign::Bytes`] that is not a power of two at least the page size.
    pub fn bytes(self) -> Result<usize> {
        let page = crate::page_size();
        match self {
            SlotAlign::Page => Ok(page),
            SlotAlign::HugePage => Ok(arena::HUGE_PAGE),
            SlotAlign::Bytes(n) if n.is_power_of_two() && n >= page && n <= MAX_ALIGN => Ok(n),
            SlotAlign::Bytes(n) => Err(Error::invalid(
                "SlotAlign",
                format!(
                    "{n} is not a power of two from the page size {page} to {MAX_ALIGN} \
                     (1 GiB: a larger alignment pads every slot by more than a huge page of \
                     the largest size)"
                ),
            )),
        }
    }
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            huge_pages: true,
            populate: true,
            loader_threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            vma_budget: None,
            shared: false,
            slot_align: SlotAlign::Page,
            read_mode: ReadMode::Buffered,
            progress: None,
            piece_align: 1,
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

    fn bytes_mut(&mut self, kind: Kind) -> &mut usize {
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
    /// How the files were read: [`StoreOptions::read_mode`], or [`ReadMode::Buffered`]
    /// when a direct read fell back (then [`LayerReport::read_fallback`] says why).
    pub read_mode: ReadMode,
    /// Why [`ReadMode::Direct`] fell back to buffered reads (the first file that did),
    /// if it did.
    pub read_fallback: Option<ReadFallback>,
    /// The layer's policy (`None` for [`Layout::Unplaced`] and [`Layout::SplitExperts`],
    /// whose blocks each have their own; the first copy's for [`Layout::Replicate`]).
    pub policy: Option<MemPolicy>,
    /// Copies of the layer: the nodes of [`Layout::Replicate`] (1 where placement
    /// degraded), 1 for the other layouts.
    pub replicas: usize,
    /// Bytes written by a loader running on the node they were bound to, over every copy
    /// (0 for [`Layout::Interleave`] and [`Layout::Unplaced`], which bind to no single
    /// node). With [`LayerReport::bytes`] × [`LayerReport::replicas`] it says how much
    /// of the load was node-local.
    pub local_bytes: u64,
    /// Loader threads that could not run on their target node (none of its CPUs in the
    /// thread's allowed set, or `sched_setaffinity` refused) and loaded from where they
    /// were, summed over the fill and each replica's copy.
    pub off_node_loaders: usize,
    /// [`Layout::Interleave`]: the nodes the loader threads ran on, spread one per node
    /// (loader `w` on the `w mod n`-th node of the set), distinct and sorted; empty for
    /// the other layouts, whose loaders follow the node they fill.
    pub loader_nodes: Vec<crate::node::Node>,
    /// Bound, or degraded with its reason (`None` for [`Layout::Unplaced`]).
    pub placement: Option<Placement>,
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
    state: State,
    layers: table::Table<Box<Layer>>,
    packing: Mutex<BTreeSet<usize>>,
    mbind_calls: AtomicUsize,
    placement: Mutex<Option<Placement>>,
    /// The store's map lock: every region and loader thread is made under it.
    maps: budget::MapGate,
    /// This store's number in the process, for its regions' names.
    number: u64,
    /// Regions named so far: each name is unique, or same-named neighbours would merge.
    regions_named: AtomicUsize,
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

/// Whether a store can still change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Layers can be packed, released and reloaded.
    Open,
    /// Exported or attached: the arenas are sealed, read-only views; only reads work.
    Frozen,
    /// An export failed after the kernel had unmapped an arena: nothing can be read.
    Broken,
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
    /// A layout with an empty node set, zero loader threads, a bad slot alignment, or a
    /// piece alignment that is not a power of two.
    pub fn new(layout: Layout, options: StoreOptions) -> Result<PinStore> {
        layout.check(options.shared)?;
        if options.loader_threads == 0 {
            return Err(Error::invalid("PinStore::new", "loader_threads is 0"));
        }
        options.slot_align.bytes()?;
        slot_map::check_piece_align(options.piece_align)?;
        Ok(PinStore {
            layout,
            state: State::Open,
            layers: table::Table::new(),
            packing: Mutex::new(BTreeSet::new()),
            mbind_calls: AtomicUsize::new(0),
            placement: Mutex::new(None),
            maps: budget::MapGate::new(options.vma_budget),
            options,
            number: NEXT_STORE_NUMBER.fetch_add(1, Ordering::Relaxed),
            regions_named: AtomicUsize::new(0),
        })
    }

    /// The layout.
    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// The policy layer `layer` gets (`None`: unplaced, or [`Layout::SplitExperts`],
    /// whose blocks each get their node; the first copy's for [`Layout::Replicate`]).
    pub fn policy_for(&self, layer: usize) -> Option<MemPolicy> {
        self.layout.region_policy(layer)
    }

    /// Reserves layer `layer`'s regions (weights and, if `scale_bytes > 0`, scales) at a
    /// fixed stride, binds each once before anything touches it, populates them, and
    /// fills every slot from `sources` with the loader threads. The layer becomes
    /// readable only once every slot is loaded. Each slot holds its source's pieces in
    /// order, at multiples of [`StoreOptions::piece_align`] (the slots grow by the
    /// padding); [`PinStore::slot_map`] records where.
    ///
    /// # Errors
    /// The layer is packed (or being packed) already, its index is too large, the expert
    /// count does not match `sources`, a source is larger than its slot, a file piece
    /// runs past the end of its file (the error names the offset), sizes overflow, the
    /// map budget would be crossed ([`Error::MapBudget`]; replicas and split blocks
    /// count), a [`Layout::Replicate`] node lacks the memory for this layer's copy
    /// ([`Error::NodeMemory`], checked before anything is mapped), or a call fails. The store
    /// stays usable after any of these.
    pub fn pack_layer(
        &self,
        layer: usize,
        spec: &LayerSpec,
        sources: &[ExpertSource<'_>],
    ) -> Result<LayerReport> {
        self.check_open(PACK)?;
        let lengths = self.validate(layer, spec, sources)?;
        let map = SlotMap::build(layer, sources, self.options.piece_align)?;
        let spec = &map.grown(spec);
        let _mark = self.mark_packing(layer)?;
        let copies = self.layout.copies();
        if !self.layout.replica_set().is_empty() {
            let align = self.options.slot_align.bytes()?;
            let needed = replica::copy_bytes(spec, align)?;
            self.check_replica_memory(format!("layer {layer}'s replica"), needed)?;
        }
        let per_copy = spec.kinds().count() * self.layout.maps_per_region(spec.experts);
        let maps = per_copy.checked_mul(copies).ok_or_else(|| {
            Error::invalid(PACK, format!("layer {layer}: {copies} copies overflow"))
        })?;
        if maps > spec.kinds().count() {
            self.check_budget(format!("layer {layer} ({copies} copies)"), maps)?;
        }
        let mut arenas = self.reserve(layer, spec)?;
        let policy = self.policy_for(layer);
        let (placement, mut mbind_calls) = match (&policy, self.layout.blocks()) {
            (_, Some(set)) => {
                let (p, calls) = self.bind_blocks(&set, &arenas, spec.experts)?;
                (Some(p), calls)
            }
            (Some(policy), _) => (
                Some(self.bind(&arenas, policy)?),
                arenas.iter().flatten().count(),
            ),
            (None, _) => (None, 0),
        };
        if self.options.populate {
            for arena in arenas.iter_mut().flatten() {
                arena.populate()?;
            }
        }
        let experts = spec.experts;
        let target = |expert: usize| self.layout.target_node(layer, experts, expert);
        let (filled, (read_mode, read_fallback)) =
            self.fill(layer, &mut arenas, sources, &lengths, &map, &target)?;
        // Replicas only where the first copy was bound: a degraded store keeps one
        // unplaced copy.
        let built = if copies > 1 && placement.is_some_and(|p| p.is_bound()) {
            self.build_replicas(layer, spec, &arenas)?
        } else {
            replica::Built::default()
        };
        mbind_calls += built.mbind_calls;
        let replicas = built.replicas;

        let regions = arenas.iter().flatten().count() * (1 + replicas.len());
        let stride = |kind: Kind| arenas[kind.index()].as_ref().map_or(0, Arena::stride);
        let report = LayerReport {
            layer,
            experts: spec.experts,
            weight_stride: stride(Kind::Weights),
            scale_stride: stride(Kind::Scales),
            bytes: lengths.iter().flatten().map(|&n| n as u64).sum(),
            regions,
            mbind_calls,
            reads: filled.reads,
            read_mode,
            read_fallback,
            policy,
            replicas: 1 + replicas.len(),
            local_bytes: filled.local_bytes + built.local_bytes,
            off_node_loaders: filled.off_node_loaders + built.off_node_loaders,
            loader_nodes: filled.loader_nodes.clone(),
            placement,
        };
        let mut packed = Layer::new(*spec, arenas).with_slot_map(map);
        if placement.is_some_and(|p| p.is_bound())
            && let Some(first) = self.layout.replica_set().nth(0)
        {
            packed = packed.with_replicas(first, replicas);
        }
        self.layers
            .set(layer, Box::new(packed))
            .map_err(|_| Error::AlreadyPacked {
                op: PACK,
                layer,
                in_progress: false,
            })?;
        Ok(report)
    }

    /// Step 1: maps one region per tensor kind of the layer, each under the store's map
    /// lock right after its own budget check (see the `budget` module), so that
    /// concurrent packs see each other's regions. Nothing is touched yet.
    fn reserve(&self, layer: usize, spec: &LayerSpec) -> Result<[Option<Arena>; 2]> {
        let regions = spec.kinds().count();
        self.check_budget(format!("layer {layer}"), regions)?;
        let backing = arena::Backing::of(&self.options, layer);
        let align = self.options.slot_align.bytes()?;
        let mut arenas: [Option<Arena>; 2] = Default::default();
        for kind in spec.kinds() {
            let _reservation = self
                .maps
                .reserve(|| format!("layer {layer} {}", kind.name()), 1)?;
            let arena = Arena::reserve(kind, spec.experts, spec.bytes(kind), align, &backing)?;
            self.name_region(arena.region(), layer, kind)?;
            arenas[kind.index()] = Some(arena);
        }
        Ok(arenas)
    }

    /// Names an anonymous arena's mapping `numapin <store> L<layer> <kind> <n>` where the
    /// kernel names mappings ([`crate::anon_vma_names_supported`]), so `/proc/PID/maps`
    /// tells which mapping is which layer; `n` numbers the store's regions, keeping names
    /// (and so mappings) apart. A memfd arena already carries its file's name.
    fn name_region(&self, region: &Region, layer: usize, kind: Kind) -> Result<()> {
        if self.options.shared || !crate::region::anon_vma_names_supported() {
            return Ok(());
        }
        let n = self.regions_named.fetch_add(1, Ordering::Relaxed);
        region.set_name(&region_name(self.number, layer, kind, n))?;
        Ok(())
    }

    /// Step 2: binds each region once, before anything touches it.
    fn bind(&self, arenas: &[Option<Arena>; 2], policy: &MemPolicy) -> Result<Placement> {
        let mut placement = Placement::Bound;
        for arena in arenas.iter().flatten() {
            let p = arena.bind(policy)?;
            self.mbind_calls.fetch_add(1, Ordering::Relaxed);
            placement = self.note_placement(p);
        }
        Ok(placement)
    }

    /// Step 4 (after populating): fills every slot with the loader threads, each helper
    /// thread spawned only if its mappings fit; marks the slots loaded. Returns the
    /// `pread` count and the read mode that ran.
    fn fill(
        &self,
        layer: usize,
        arenas: &mut [Option<Arena>; 2],
        sources: &[ExpertSource<'_>],
        lengths: &[[usize; 2]],
        map: &SlotMap,
        target: &(dyn Fn(usize) -> Option<crate::node::Node> + Sync),
    ) -> Result<(load::Filled, (ReadMode, Option<ReadFallback>))> {
        let slots = sources.len().checked_mul(arenas.len()).ok_or_else(|| {
            Error::invalid(
                PACK,
                format!("layer {layer}: {} experts overflow usize", sources.len()),
            )
        })?;
        let reader = load::Reader::new(
            self.options.read_mode,
            sources
                .iter()
                .flat_map(|source| Kind::ALL.map(|kind| source.tensor(kind).files()))
                .flatten(),
        )?;
        let mut jobs = Vec::with_capacity(slots);
        for (kind, arena) in Kind::ALL.into_iter().zip(arenas.iter_mut()) {
            let Some(arena) = arena else { continue };
            for (expert, (dest, source)) in arena.slots_mut()?.zip(sources).enumerate() {
                let places = map.pieces(expert, kind).unwrap_or_default();
                let what = (layer, expert, kind);
                jobs.extend(slot_map::jobs(places, dest, source.tensor(kind), what)?);
            }
        }
        // Expert by expert, each expert's weights then scales: the order a checkpoint
        // usually has them in, so that the loaders walk the file forwards.
        jobs.sort_by_key(|job| (job.what.1, job.what.2));
        // Direct reads give each loader thread a bounce buffer: one more heap mapping.
        let bounce_maps = usize::from(reader.needs_scratch());
        let scratch = if bounce_maps > 0 {
            let _reservation = self.maps.reserve(
                || format!("layer {layer} direct-I/O bounce buffer"),
                bounce_maps,
            )?;
            reader.scratch()
        } else {
            reader.scratch()
        };
        let bytes: u64 = lengths.iter().flatten().map(|&n| n as u64).sum();
        let meter = self
            .options
            .progress
            .as_ref()
            .map(|hook| load::Meter::new(hook, layer, bytes, jobs.len()));
        let threads = self.options.loader_threads;
        // Interleaved memory has no single node: spread the loaders over the set instead,
        // so that each node's share of the writes is made from nearby CPUs.
        let spread: Vec<crate::node::Node> = if self.placement_bound() {
            self.layout.loader_spread().iter().collect()
        } else {
            Vec::new()
        };
        let loading = load::Loading {
            reader: &reader,
            scratch,
            meter: meter.as_ref(),
            target,
            spread: &spread,
        };
        let filled = load::fill(jobs, threads, loading, |spawned| {
            let what = || format!("loader thread {} of {threads}", spawned + 2);
            self.maps
                .reserve(what, load::MAPS_PER_THREAD + bounce_maps)
                .ok()
        })?;
        for (kind, arena) in Kind::ALL.into_iter().zip(arenas.iter_mut()) {
            let Some(arena) = arena else { continue };
            for expert in 0..sources.len() {
                let places = map.pieces(expert, kind).unwrap_or_default();
                arena.mark_loaded(expert, slot_map::extent(places));
            }
        }
        Ok((filled, reader.outcome()))
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
        if self.layers.get(layer).is_some() {
            return Err(Error::AlreadyPacked {
                op: PACK,
                layer,
                in_progress: false,
            });
        }
        let mut set = self
            .packing
            .lock()
            .map_err(|_| Error::invalid(PACK, "a loader thread panicked earlier"))?;
        if !set.insert(layer) {
            return Err(Error::AlreadyPacked {
                op: PACK,
                layer,
                in_progress: true,
            });
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

    /// Whether binding has worked so far (a degraded store places nothing, so moving its
    /// loaders around would buy nothing).
    fn placement_bound(&self) -> bool {
        !matches!(
            self.placement.lock().ok().and_then(|p| *p),
            Some(Placement::Degraded(_))
        )
    }

    /// Refuses changes to a frozen (exported or attached) or broken store.
    fn check_open(&self, op: &'static str) -> Result<()> {
        match self.state {
            State::Open => Ok(()),
            State::Frozen => Err(Error::Frozen { op }),
            State::Broken => Err(broken(op)),
        }
    }

    fn layer(&self, layer: usize) -> Result<&Layer> {
        if self.state == State::Broken {
            return Err(broken("PinStore"));
        }
        self.layers
            .get(layer)
            .map(|b| &**b)
            .ok_or(Error::NotPacked {
                op: "PinStore",
                layer,
            })
    }

    fn slot(&self, layer: usize, expert: usize, kind: Kind) -> Result<&[u8]> {
        let l = self.layer(layer)?;
        // The expert is checked against the layer whatever the tensor: a layer without
        // scales has empty scales for its experts only.
        let experts = l.experts();
        if expert >= experts {
            return Err(out_of_range(layer, expert, experts));
        }
        let Some(arena) = l.arena(kind) else {
            return Ok(&[]);
        };
        arena.slot(expert).ok_or(Error::Released {
            op: "PinStore",
            layer,
            expert,
            kind: kind.name(),
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
        if expert >= arena.slots() {
            return Err(out_of_range(layer, expert, arena.slots()));
        }
        arena.slot_policy(expert)
    }

    /// Releases both tensors of an expert. See [`PinStore::release_kind`].
    ///
    /// # Errors
    /// As [`PinStore::release_kind`].
    pub fn release(&mut self, layer: usize, expert: usize) -> Result<()> {
        self.release_kind(layer, expert, Kind::Weights)?;
        self.release_kind(layer, expert, Kind::Scales)
    }

    /// Gives one tensor's pages back (`MADV_DONTNEED` over its slot, in every replica).
    /// The slot's addresses and the region's policy stay; reading it is an error until
    /// [`PinStore::ensure`] loads it again, which faults under the same policy.
    ///
    /// # Errors
    /// The layer is not packed, the expert is out of range, or the store was exported or
    /// attached ([`Error::Frozen`]).
    pub fn release_kind(&mut self, layer: usize, expert: usize, kind: Kind) -> Result<()> {
        self.check_open("PinStore::release")?;
        self.arena_mut(layer, expert, kind)?;
        let Some(l) = self.layers.get_mut(layer) else {
            return Ok(());
        };
        let (first, others) = l.split_replicas_mut(kind);
        for arena in first.into_iter().chain(others.into_iter().map(|(_, a)| a)) {
            arena.release_slot(expert)?;
        }
        Ok(())
    }

    fn arena_mut(&mut self, layer: usize, expert: usize, kind: Kind) -> Result<Option<&mut Arena>> {
        let l = self.layers.get_mut(layer).ok_or(Error::NotPacked {
            op: "PinStore",
            layer,
        })?;
        let experts = l.experts();
        if expert >= experts {
            return Err(out_of_range(layer, expert, experts));
        }
        Ok(l.arena_mut(kind))
    }

    /// Loads whatever of `expert` is released (weights, scales, or both) from `source`
    /// into its own slot, under the policy the region kept, its pieces laid out as in
    /// [`PinStore::pack_layer`] (the slot map follows). Loaded tensors are left as they
    /// are. A replicated layer reloads the first copy from `source` and copies it to the
    /// other replicas, each copy made on the replica's node.
    ///
    /// # Errors
    /// As [`PinStore::release_kind`] (including [`Error::Frozen`]), a source larger than
    /// the slot (padding included), or a read fails (the slot then stays released).
    pub fn ensure(&mut self, layer: usize, expert: usize, source: &ExpertSource<'_>) -> Result<()> {
        self.check_open("PinStore::ensure")?;
        let spec = *self.layer(layer)?.spec();
        // Loaded from the CPUs of the node the slot is bound to, if one (the first copy's
        // node for a replicated layer; the replicas are copied on theirs).
        let on_node = (expert < spec.experts)
            .then(|| self.layout.target_node(layer, spec.experts, expert))
            .flatten()
            .map(load::OnNode::enter);
        check_fits(layer, expert, &spec, source)?;
        for kind in Kind::ALL {
            let what = || describe(layer, expert, kind);
            let places = slot_map::places(&what, source, kind, self.options.piece_align)?;
            let len = slot_map::extent(&places);
            if len > spec.bytes(kind) {
                return Err(Error::invalid(
                    "PinStore::ensure",
                    format!(
                        "{}: the pieces take {len} bytes with their padding but the slot holds {}",
                        what(),
                        spec.bytes(kind)
                    ),
                ));
            }
            let Some(arena) = self.arena_mut(layer, expert, kind)? else {
                continue;
            };
            if arena.loaded(expert).is_some() {
                continue;
            }
            let tensor = source.tensor(kind);
            let jobs = slot_map::jobs(
                &places,
                arena.slot_mut(expert)?,
                tensor,
                (layer, expert, kind),
            )?;
            for job in jobs {
                load::fill_slot(job)?;
            }
            arena.mark_loaded(expert, len);
            if let Some(map) = self.layers.get_mut(layer).and_then(|l| l.slot_map_mut()) {
                map.set(expert, kind, places);
            }
        }
        // Back to the caller's own affinity before moving to each replica's node (from
        // the first node's CPUs alone, no other node's CPU would be allowed).
        drop(on_node);
        self.sync_replicas(layer, expert)
    }
}

/// Numbers the stores of this process, for their regions' names.
static NEXT_STORE_NUMBER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// An arena's mapping name: `numapin 3 L12 weights 25` (at most 79 bytes, the kernel's
/// limit, all of them characters it accepts).
fn region_name(store: u64, layer: usize, kind: Kind, n: usize) -> String {
    format!("numapin {store} L{layer} {} {n}", kind.name())
}

fn broken(op: &'static str) -> Error {
    Error::Unusable {
        op,
        why: "an earlier export failed while re-mapping an arena, and the kernel had \
              already unmapped it"
            .into(),
    }
}

fn out_of_range(layer: usize, expert: usize, experts: usize) -> Error {
    Error::OutOfRange {
        op: "PinStore",
        what: format!("expert of layer {layer}"),
        index: expert,
        len: experts,
    }
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
    for kind in Kind::ALL {
        let max = spec.bytes(kind);
        let what = || describe(layer, expert, kind);
        let len = source.tensor(kind).checked_len(PACK, &what)?;
        if len > max {
            return Err(Error::invalid(
                PACK,
                format!(
                    "{}: the source has {len} bytes but the slot holds {max}",
                    what()
                ),
            ));
        }
        lengths[kind.index()] = len;
    }
    Ok(lengths)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn region_names_are_unique_and_valid_at_the_extremes() {
        let names = [
            region_name(1, 0, Kind::Weights, 0),
            region_name(1, 0, Kind::Scales, 1),
            region_name(1, 0, Kind::Weights, 2),
            region_name(2, 0, Kind::Weights, 0),
            region_name(u64::MAX, usize::MAX, Kind::Weights, usize::MAX),
        ];
        assert_eq!(names[0], "numapin 1 L0 weights 0");
        let unique: BTreeSet<&String> = names.iter().collect();
        assert_eq!(unique.len(), names.len());
        for name in &names {
            assert_eq!(crate::region::invalid_name_reason(name), None, "{name}");
        }
    }
}
