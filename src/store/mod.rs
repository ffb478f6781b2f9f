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
mod pack;
mod replica;
mod served;
mod shared;
mod slot_map;
mod spec;
mod stats;
mod table;
#[cfg(feature = "model")]
mod whole_export;

use std::collections::BTreeSet;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

pub use crate::source::{
    DROP_BEHIND_EVERY, DirectIo, DirectReads, ExpertSource, FileRead, IO_URING_ENV,
    IoUringFallback, Kind, LOADER_THREAD_MAPS, MAX_READ, POOL_DEPTH, PROGRESS_STEP, Piece,
    Progress, ProgressHook, ReadFallback, ReadMode, Residency, ResidencyProbe,
};
pub use assign::{ExpertAssignment, Home, HotCopies, NodeShare};
pub(crate) use assign::{HOT, SlotOrder};
use layer::Layer;
pub(crate) use layer::ids_text;
#[cfg(test)]
pub(crate) use layout::ARRANGED;
pub use layout::Layout;
pub(crate) use layout::{LayerPlacement, Placer, block, block_of};
pub use manifest::{Manifest, ManifestRegion};
pub use options::{MAX_ALIGN, SlotAlign, StoreOptions};
pub use shared::Export;
pub(crate) use slot_map::PieceLayout;
pub use slot_map::{SlotMap, SlotPiece};
pub use spec::{LayerReport, LayerSpec};
pub use stats::{PAGE_SAMPLE, StoreStats};
#[cfg(feature = "model")]
pub(crate) use whole_export::StorePart;
// For whole-model plans (`model::whole`), which check every store's needs at once.
pub(crate) use budget::HEAP_MARGIN;

use crate::error::{Error, Result};
use crate::nodeset::NodeSet;
use crate::policy::{MemPolicy, Placement};

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
    /// The one arithmetic of placement: the copies' groups, the hot copies' groups, and
    /// each layer's blocks and figures ([`layout::Placer`]).
    placer: layout::Placer,
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
    /// How far the drop-behind fills of this store advised each file away.
    advised: crate::source::load::Advised,
    /// The drop-behind records of the placement this store is part of, shared with its
    /// other stores ([`PinStore::share_drop_behind`]).
    behind: Mutex<Option<std::sync::Arc<crate::source::load::SharedBehind>>>,
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

const PACK: &str = "PinStore::pack_layer";

impl PinStore {
    /// The read mode its loads use ([`StoreOptions::read_mode`]): verifies re-read the
    /// files the same way.
    pub(crate) fn read_mode(&self) -> ReadMode {
        self.options.read_mode
    }

    /// A store with no layers yet.
    ///
    /// # Errors
    /// A layout with an empty node set, zero loader threads, a bad slot alignment, a
    /// piece alignment that is not a power of two, or (for
    /// [`Layout::ReplicateDomains`]) the machine's domains cannot be read.
    pub fn new(layout: Layout, options: StoreOptions) -> Result<PinStore> {
        layout.check(options.shared)?;
        if options.loader_threads == 0 {
            return Err(Error::empty(
                "PinStore::new",
                "loader threads (loader_threads is 0)",
            ));
        }
        let slot = options.slot_align.bytes()?;
        slot_map::check_piece_align(options.piece_align)?;
        slot_map::check_piece_congruence(options.piece_congruence, options.piece_align, slot)?;
        if options.assignment.is_some() && layout.blocks().is_none() {
            return Err(Error::invalid(
                "PinStore::new",
                format!(
                    "an expert assignment with {layout:?}: it places the experts of \
                     Layout::SplitExperts"
                ),
            ));
        }
        check_role_major(&options)?;
        let hot = options
            .assignment
            .as_ref()
            .map(ExpertAssignment::hot_copy_shape);
        let placer = layout::Placer::live(layout, hot)?.role_major(options.role_major);
        Ok(PinStore {
            layout,
            placer,
            state: State::Open,
            layers: table::Table::new(),
            packing: Mutex::new(BTreeSet::new()),
            mbind_calls: AtomicUsize::new(0),
            placement: Mutex::new(None),
            maps: budget::MapGate::new(options.vma_budget),
            options,
            number: NEXT_STORE_NUMBER.fetch_add(1, Ordering::Relaxed),
            regions_named: AtomicUsize::new(0),
            advised: Default::default(),
            behind: Mutex::new(None),
        })
    }

    /// Makes this store's drop-behind fills use `shared`, the records of every file of a
    /// placement, shared by all its stores (`None`: its own again).
    pub(crate) fn share_drop_behind(
        &self,
        shared: Option<std::sync::Arc<crate::source::load::SharedBehind>>,
    ) {
        *self.behind.lock().unwrap_or_else(|e| e.into_inner()) = shared;
    }

    /// This store's number in the process: distinct for every store made, the `<store>`
    /// of its regions' names (`numapin <store> L<layer> …`) and [`Progress::store`] in
    /// its progress reports.
    pub fn number(&self) -> u64 {
        self.number
    }

    /// The layout every layer of this store takes.
    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// The policy layer `layer` gets (`None`: unplaced, or [`Layout::SplitExperts`],
    /// whose blocks each get their node; the first copy's for [`Layout::Replicate`] and
    /// [`Layout::ReplicateDomains`]).
    pub fn policy_for(&self, layer: usize) -> Option<MemPolicy> {
        self.layout.region_policy(layer, &self.placer.copy_groups)
    }

    /// The nodes each copy of a layer lives on, the first copy's first: one node per copy
    /// for [`Layout::Replicate`], a domain's nodes of the set per copy for
    /// [`Layout::ReplicateDomains`] (each copy interleaved over them); empty for the
    /// layouts that make one copy. What the layout asks for; where placement is denied or
    /// unsupported, one unplaced copy is built ([`PinStore::replica_nodes`] is then empty).
    pub fn copy_groups(&self) -> &[NodeSet] {
        &self.placer.copy_groups
    }

    /// The groups the copies of a layer live on: the layout's ([`PinStore::copy_groups`]),
    /// or a hybrid layer's hot copies' ([`PinStore::hot_groups`]).
    fn groups(&self) -> &[NodeSet] {
        if self.placer.copy_groups.is_empty() {
            &self.placer.hot_groups
        } else {
            &self.placer.copy_groups
        }
    }

    /// Copies of each layer the layout makes (1 but for the replicating layouts).
    fn copies(&self) -> usize {
        self.placer.copy_groups.len().max(1)
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

fn broken(op: &'static str) -> Error {
    Error::Unusable {
        op,
        why: "an earlier export failed while re-mapping an arena, and the kernel had \
              already unmapped it"
            .into(),
    }
}

/// [`StoreOptions::role_major`]: at least 1, and without an assignment (it orders the
/// slots node by node). A shared store's export carries it (`StorePart::role_major`).
fn check_role_major(options: &StoreOptions) -> Result<()> {
    let roles = options.role_major;
    let bad = |why: &str| {
        Error::bad_value(
            "PinStore::new",
            "role_major",
            roles.to_string(),
            why.to_owned(),
        )
    };
    if roles == 0 {
        return Err(bad("a slot order needs at least 1 role"));
    }
    if roles > 1 && options.assignment.is_some() {
        return Err(bad(
            "role-major slots with an expert assignment: the assignment orders the slots \
             node by node",
        ));
    }
    Ok(())
}
