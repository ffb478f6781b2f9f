//! `PinStore`: the read-mostly tensors of a model, packed per layer into two bound
//! regions (weights and scales) at a fixed stride, so that a whole model costs O(layers)
//! mappings and `mbind` calls however many experts it has.

mod access;
mod arena;
mod assign;
mod budget;
mod layer;
mod layout;
mod manifest;
mod options;
mod replica;
mod shared;
mod slot_map;
mod spec;
mod stats;
mod table;

use std::collections::BTreeSet;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::source::load;
pub use crate::source::{
    DROP_BEHIND_EVERY, DirectIo, ExpertSource, IoUringFallback, Kind, LOADER_THREAD_MAPS, MAX_READ,
    PROGRESS_STEP, Piece, Progress, ProgressHook, ReadFallback, ReadMode,
};
use access::check_fits;
use arena::Arena;
pub use assign::{ExpertAssignment, NodeShare};
use layer::Layer;
pub(crate) use layer::ids_text;
pub use layout::Layout;
pub(crate) use layout::{block, block_of};
pub use manifest::{Manifest, ManifestRegion};
pub use options::{MAX_ALIGN, SlotAlign, StoreOptions};
pub use shared::Export;
pub(crate) use slot_map::PieceLayout;
pub use slot_map::{SlotMap, SlotPiece};
pub use spec::{LayerReport, LayerSpec};
pub use stats::{PAGE_SAMPLE, StoreStats};
// For whole-model plans (`model::whole`), which check every store's needs at once.
pub(crate) use budget::HEAP_MARGIN;
pub(crate) use replica::{FIGURE as NODE_MEMORY_FIGURE, available_bytes};

use crate::error::{Error, Result};
use crate::nodeset::NodeSet;
use crate::policy::{MemPolicy, Placement};
use crate::region::Region;

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
    /// The nodes of each copy a layer gets ([`Layout::copy_groups`]; empty: one copy).
    copy_groups: Vec<NodeSet>,
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
    /// A layout with an empty node set, zero loader threads, a bad slot alignment, a
    /// piece alignment that is not a power of two, or (for
    /// [`Layout::ReplicateDomains`]) the machine's domains cannot be read.
    pub fn new(layout: Layout, options: StoreOptions) -> Result<PinStore> {
        layout.check(options.shared)?;
        let copy_groups =
            layout.copy_groups(|set| Ok(crate::topology::Topology::get()?.domains_within(set)))?;
        if options.loader_threads == 0 {
            return Err(Error::empty(
                "PinStore::new",
                "loader threads (loader_threads is 0)",
            ));
        }
        let slot = options.slot_align.bytes()?;
        slot_map::check_piece_align(options.piece_align)?;
        slot_map::check_piece_congruence(options.piece_congruence, options.piece_align, slot)?;
        if options.assignment.is_some() && (layout.blocks().is_none() || options.shared) {
            return Err(Error::invalid(
                "PinStore::new",
                format!(
                    "an expert assignment with {layout:?}{}: it places the experts of \
                     Layout::SplitExperts, in a store that is not shared",
                    if options.shared {
                        " and shared arenas"
                    } else {
                        ""
                    }
                ),
            ));
        }
        Ok(PinStore {
            layout,
            copy_groups,
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
    /// whose blocks each get their node; the first copy's for [`Layout::Replicate`] and
    /// [`Layout::ReplicateDomains`]).
    pub fn policy_for(&self, layer: usize) -> Option<MemPolicy> {
        self.layout.region_policy(layer, &self.copy_groups)
    }

    /// The nodes each copy of a layer lives on, the first copy's first: one node per copy
    /// for [`Layout::Replicate`], a domain's nodes of the set per copy for
    /// [`Layout::ReplicateDomains`] (each copy interleaved over them); empty for the
    /// layouts that make one copy. What the layout asks for; where placement is denied or
    /// unsupported, one unplaced copy is built ([`PinStore::replica_nodes`] is then empty).
    pub fn copy_groups(&self) -> &[NodeSet] {
        &self.copy_groups
    }

    /// Copies of each layer the layout makes (1 but for the replicating layouts).
    fn copies(&self) -> usize {
        self.copy_groups.len().max(1)
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
    /// count), a node of a replicating layout lacks the memory for its share of this layer's copy
    /// ([`Error::NodeMemory`], checked before anything is mapped), or a call fails. The store
    /// stays usable after any of these.
    pub fn pack_layer(
        &self,
        layer: usize,
        spec: &LayerSpec,
        sources: &[ExpertSource<'_>],
    ) -> Result<LayerReport> {
        self.pack_layer_held(layer, spec, sources, None)
    }

    /// [`PinStore::pack_layer`] for a share of the layer's experts (a rank's, under
    /// expert parallelism): `sources[i]` is global expert `ids[i]`, and every lookup
    /// ([`PinStore::weights`], [`PinStore::scales`], [`PinStore::home_node`],
    /// [`PinStore::weights_local`], [`PinStore::release`], [`PinStore::ensure`],
    /// [`SlotMap::pieces`]) takes the global id; an id the layer does not hold is
    /// [`Error::NotHeld`]. The layout sees only the share: [`Layout::SplitExperts`]
    /// splits the held experts over its nodes, and the map budget counts the share's
    /// slots.
    ///
    /// # Errors
    /// As [`PinStore::pack_layer`]; `ids` not one per source, or not strictly
    /// increasing (a repeated id, or out of order: the error names the place).
    ///
    /// # Example
    /// ```
    /// use numapin::store::{ExpertSource, LayerSpec, Layout, PinStore, StoreOptions};
    /// let store = PinStore::new(Layout::Unplaced, StoreOptions::default())?;
    /// let (a, b) = (vec![1u8; 64], vec![2u8; 64]);
    /// let sources = [ExpertSource::Memory { weights: &a, scales: &[] },
    ///                ExpertSource::Memory { weights: &b, scales: &[] }];
    /// store.pack_layer_share(0, &LayerSpec::fitting(&sources)?, &sources, &[64, 70])?;
    /// assert_eq!(store.weights(0, 70)?, &b[..]);
    /// assert!(matches!(store.weights(0, 1), Err(numapin::Error::NotHeld { expert: 1, .. })));
    /// # Ok::<(), numapin::Error>(())
    /// ```
    pub fn pack_layer_share(
        &self,
        layer: usize,
        spec: &LayerSpec,
        sources: &[ExpertSource<'_>],
        ids: &[usize],
    ) -> Result<LayerReport> {
        if ids.len() != sources.len() {
            return Err(Error::mismatch(
                PACK,
                format!("layer {layer}: expert ids, one per source"),
                sources.len(),
                ids.len(),
            ));
        }
        if let Some(at) = ids.windows(2).position(|w| w[0] >= w[1]) {
            return Err(Error::bad_value(
                PACK,
                "expert ids",
                format!("{} then {} (at {at})", ids[at], ids[at + 1]),
                format!("layer {layer}: a share's ids must be strictly increasing"),
            ));
        }
        self.pack_layer_held(layer, spec, sources, Some(ids.into()))
    }

    fn pack_layer_held(
        &self,
        layer: usize,
        spec: &LayerSpec,
        sources: &[ExpertSource<'_>],
        ids: Option<Box<[usize]>>,
    ) -> Result<LayerReport> {
        self.check_open(PACK)?;
        let lengths = self.validate(layer, spec, sources)?;
        let map = SlotMap::build(layer, sources, self.piece_layout())?.with_ids(ids.clone());
        let spec = &map.grown(spec);
        let order = self.slot_order(layer, spec.experts)?;
        let _mark = self.mark_packing(layer)?;
        let copies = self.copies();
        let hot = order.as_ref().map_or(0, |o| o.hot.len());
        self.check_copies(layer, spec, hot)?;
        let mut arenas = self.reserve(layer, spec, order.as_ref())?;
        let policy = self.policy_for(layer);
        let (placement, mut mbind_calls) =
            self.place(policy.as_ref(), &arenas, spec.experts, order.as_ref())?;
        let reader = self.reader(sources)?;
        // Reads fault the slots in themselves, under the bind, on every loader thread and
        // overlapped with the device's transfers: a separate pass first zeroes them on
        // one thread, serially (a cold drop-behind load ran 1.5-2x slower with it). Only
        // bytes in memory, copied in user space, are populated first.
        let (read_mode, read_fallback) = reader.outcome();
        let copies_memory = sources.iter().any(|source| {
            Kind::ALL
                .iter()
                .any(|&kind| matches!(source.tensor(kind), crate::source::Tensor::Memory(b) if !b.is_empty()))
        });
        if self.options.populate && copies_memory {
            for arena in arenas.iter_mut().flatten() {
                arena.populate()?;
            }
        }
        let experts = spec.experts;
        let target = |expert: usize| self.expert_node(layer, experts, expert);
        let filled = self.fill(
            layer,
            &mut arenas,
            sources,
            &lengths,
            &map,
            &target,
            &reader,
        )?;
        let direct_io = reader.direct_io();
        // Replicas only where the first copy was bound: a degraded store keeps one
        // unplaced copy.
        let bound = placement.is_some_and(|p| p.is_bound());
        let built = if copies > 1 && bound {
            self.build_replicas(layer, spec, &arenas)?
        } else if let Some(order) = order.as_ref().filter(|o| bound && !o.hot.is_empty()) {
            self.build_hot_copies(layer, spec, &arenas, order)?
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
            bounced_bytes: filled.bounced_bytes,
            read_mode,
            read_fallback,
            direct_io,
            policy,
            replicas: 1 + replicas.len(),
            local_bytes: filled.local_bytes + built.local_bytes,
            off_node_loaders: filled.off_node_loaders + built.off_node_loaders,
            loader_nodes: (filled.loader_nodes.iter().chain(&built.loader_nodes))
                .copied()
                .collect::<BTreeSet<_>>()
                .into_iter()
                .collect(),
            placement,
        };
        let mut packed = Layer::new(*spec, arenas).with_slot_map(map).with_ids(ids);
        let first = match hot {
            0 => self.copy_groups.first().and_then(|g| g.nth(0)),
            _ => self.layout.nodes().and_then(|set| set.nth(0)),
        };
        if bound && let Some(first) = first {
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

    /// Before anything is mapped: every node of a replicated layout has the memory for
    /// this layer's copy, and the mappings of all copies (and split blocks) fit the map
    /// budget.
    fn check_copies(&self, layer: usize, spec: &LayerSpec, hot: usize) -> Result<()> {
        let copies = self.copies();
        if !self.copy_groups.is_empty() {
            let align = self.options.slot_align.bytes()?;
            let needed = replica::copy_bytes(spec, align)?;
            self.check_replica_memory(format!("layer {layer}'s replica"), needed)?;
        }
        let per_copy = spec.kinds().count() * self.layout.maps_per_region(spec.experts);
        // A hybrid layer's hot experts: one more region per kind on every other node.
        let hot_copies = match (hot, self.layout.nodes()) {
            (1.., Some(set)) => spec.kinds().count() * (set.len() - 1),
            _ => 0,
        };
        let maps = per_copy
            .checked_mul(copies)
            .and_then(|m| m.checked_add(hot_copies));
        let maps = maps.ok_or_else(|| {
            Error::overflow(
                PACK,
                format!("layer {layer}: the mappings of {copies} copies"),
            )
        })?;
        if maps > spec.kinds().count() {
            self.check_budget(format!("layer {layer} ({copies} copies)"), maps)?;
        }
        Ok(())
    }

    /// Step 2: binds the layer's regions, block by block for a split layout, or each
    /// region once under `policy`; unplaced, nothing. The placement and the `mbind`
    /// calls made.
    fn place(
        &self,
        policy: Option<&MemPolicy>,
        arenas: &[Option<Arena>; 2],
        experts: usize,
        order: Option<&assign::SlotOrder>,
    ) -> Result<(Option<Placement>, usize)> {
        Ok(match (policy, self.layout.blocks()) {
            (_, Some(set)) => {
                let blocks = match order {
                    Some(o) => o.blocks.clone(),
                    None => (0..set.len())
                        .map(|i| block(i, set.len(), experts))
                        .collect(),
                };
                let (p, calls) = self.bind_blocks(&set, arenas, &blocks)?;
                (Some(p), calls)
            }
            (Some(policy), _) => (
                Some(self.bind(arenas, policy)?),
                arenas.iter().flatten().count(),
            ),
            (None, _) => (None, 0),
        })
    }

    /// Step 1: maps one region per tensor kind of the layer, each under the store's map
    /// lock right after its own budget check (see the `budget` module), so that
    /// concurrent packs see each other's regions. Nothing is touched yet.
    fn reserve(
        &self,
        layer: usize,
        spec: &LayerSpec,
        order: Option<&assign::SlotOrder>,
    ) -> Result<[Option<Arena>; 2]> {
        let regions = spec.kinds().count();
        self.check_budget(format!("layer {layer}"), regions)?;
        let backing = arena::Backing::of(&self.options, layer);
        let align = self.options.slot_align.bytes()?;
        let mut arenas: [Option<Arena>; 2] = Default::default();
        for kind in spec.kinds() {
            let _reservation = self
                .maps
                .reserve(|| format!("layer {layer} {}", kind.name()), 1)?;
            let mut arena = Arena::reserve(kind, spec.experts, spec.bytes(kind), align, &backing)?;
            if let Some(order) = order {
                arena = arena.with_order(order.slot.clone());
            }
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
        if self.options.shared || !crate::calls::anon_vma_names_supported() {
            return Ok(());
        }
        let n = self.regions_named.fetch_add(1, Ordering::Relaxed);
        region.set_name(&region_name(self.number, layer, kind, n))?;
        Ok(())
    }

    /// Binds each region once, before anything touches it.
    fn bind(&self, arenas: &[Option<Arena>; 2], policy: &MemPolicy) -> Result<Placement> {
        let mut placement = Placement::Bound;
        for arena in arenas.iter().flatten() {
            let p = arena.bind(policy)?;
            self.mbind_calls.fetch_add(1, Ordering::Relaxed);
            placement = self.note_placement(p);
        }
        Ok(placement)
    }

    /// How the layer's files are read: the store's read mode, with or without `io_uring`.
    fn reader<'a>(&self, sources: &'a [ExpertSource<'a>]) -> Result<load::Reader<'a>> {
        let reader = load::Reader::new(
            self.options.read_mode,
            sources
                .iter()
                .flat_map(|source| Kind::ALL.map(|kind| source.tensor(kind).files()))
                .flatten(),
        )?
        .expect(
            sources
                .iter()
                .flat_map(|source| Kind::ALL.map(|kind| source.tensor(kind).pieces()))
                .flatten()
                .map(|p| (p.file, p.offset, p.len)),
        );
        Ok(if self.options.io_uring {
            reader
        } else {
            reader.without_io_uring()
        })
    }

    /// Step 4 (after populating): fills every slot with the loader threads, each helper
    /// thread spawned only if its mappings fit; marks the slots loaded. Returns the
    /// `pread` count and what the loaders did.
    #[allow(clippy::too_many_arguments)]
    fn fill(
        &self,
        layer: usize,
        arenas: &mut [Option<Arena>; 2],
        sources: &[ExpertSource<'_>],
        lengths: &[[usize; 2]],
        map: &SlotMap,
        target: &(dyn Fn(usize) -> Option<crate::node::Node> + Sync),
        reader: &load::Reader<'_>,
    ) -> Result<load::Filled> {
        let slots = sources.len().checked_mul(arenas.len()).ok_or_else(|| {
            Error::overflow(
                PACK,
                format!("layer {layer}: the slots of {} experts", sources.len()),
            )
        })?;
        let mut jobs = Vec::with_capacity(slots);
        for (kind, arena) in Kind::ALL.into_iter().zip(arenas.iter_mut()) {
            let Some(arena) = arena else { continue };
            for (expert, (dest, source)) in arena.slots_mut()?.into_iter().zip(sources).enumerate()
            {
                let places = map.slot_pieces(expert, kind).unwrap_or_default();
                let what = (layer, expert, kind);
                jobs.extend(slot_map::jobs(places, dest, source.tensor(kind), what)?);
            }
        }
        // Expert by expert, each expert's weights then scales: the order a checkpoint
        // usually has them in, so that the loaders walk the file forwards.
        jobs.sort_by_key(|job| (job.what.1, job.what.2));
        // Direct reads give each loader thread a bounce buffer (one more heap mapping) and,
        // with io_uring, a ring (its own mappings).
        let bounce_maps = reader.scratch_maps();
        let scratch = if bounce_maps > 0 {
            let _reservation = self.maps.reserve(
                || format!("layer {layer} direct-I/O bounce buffer and ring"),
                bounce_maps,
            )?;
            reader.scratch()?
        } else {
            reader.scratch()?
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
            reader,
            scratch,
            meter: meter.as_ref(),
            target,
            spread: &spread,
        };
        let filled = load::fill(jobs, threads, loading, |spawned| {
            let what = || format!("loader thread {} of {threads}", spawned + 2);
            self.maps
                .reserve(what, load::LOADER_THREAD_MAPS + bounce_maps)
                .ok()
        })?;
        for (kind, arena) in Kind::ALL.into_iter().zip(arenas.iter_mut()) {
            let Some(arena) = arena else { continue };
            for expert in 0..sources.len() {
                let places = map.slot_pieces(expert, kind).unwrap_or_default();
                arena.mark_loaded(expert, slot_map::extent(places));
            }
        }
        Ok(filled)
    }

    /// Checks the request; returns each expert's `[weights, scales]` byte counts.
    fn validate(
        &self,
        layer: usize,
        spec: &LayerSpec,
        sources: &[ExpertSource<'_>],
    ) -> Result<Vec<[usize; 2]>> {
        if layer >= table::MAX_INDEX {
            return Err(Error::OutOfRange {
                op: PACK,
                what: "layer".to_string(),
                index: layer,
                len: table::MAX_INDEX,
            });
        }
        if spec.experts == 0 || spec.weight_bytes == 0 {
            return Err(Error::empty(
                PACK,
                format!("experts or no weight bytes in layer {layer}'s {spec:?}"),
            ));
        }
        if sources.len() != spec.experts {
            return Err(Error::mismatch(
                PACK,
                format!("layer {layer}: sources, one per expert of the spec"),
                spec.experts,
                sources.len(),
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
