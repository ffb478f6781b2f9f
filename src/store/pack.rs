//! The pack pipeline, one step a method: validate → mark the layer → reserve → bind →
//! populate → fill → replicas. A layer becomes readable only at the end, in one `set`.

use std::collections::BTreeSet;
use std::sync::Mutex;
use std::sync::atomic::Ordering;

use super::access::check_fits;
use super::arena::{self, Arena};
use super::layer::Layer;
use super::{
    ExpertSource, Kind, LayerReport, LayerSpec, PACK, PinStore, SlotMap, assign, replica, slot_map,
    table,
};
use crate::error::{Error, Result};
use crate::policy::{MemPolicy, Placement};
use crate::region::Region;
use crate::source::load;

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

impl PinStore {
    /// Reserves layer `layer`'s regions (weights and, if `scale_bytes > 0`, scales) at a
    /// fixed stride, binds each once before anything touches it, populates them, and
    /// fills every slot from `sources` with the loader threads. The layer becomes
    /// readable only once every slot is loaded. Each slot holds its source's pieces in
    /// order, at multiples of
    /// [`StoreOptions::piece_align`](super::StoreOptions::piece_align) (the slots grow by
    /// the padding); [`PinStore::slot_map`] records where.
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
    /// [`Error::NotHeld`]. The layout sees only the share:
    /// [`Layout::SplitExperts`](super::Layout::SplitExperts) splits the held experts over its nodes, and the map budget counts the share's
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
        self.check_copies(layer, spec, order.as_ref())?;
        let mut arenas = self.reserve(layer, spec, order.as_ref())?;
        let policy = self.policy_for(layer);
        let (placement, mut mbind_calls) =
            self.place(policy.as_ref(), &arenas, spec.experts, order.as_ref())?;
        let reader = self.reader(sources)?;
        let (read_mode, read_fallback) = reader.outcome();
        self.populate_for(&mut arenas, sources)?;
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
            direct_reads: filled.direct,
            read_mode,
            read_fallback,
            direct_io,
            files: reader.file_reads(),
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
            0 => self.placer.copy_groups.first().and_then(|g| g.nth(0)),
            _ => self.layout.nodes().and_then(|set| set.nth(0)),
        };
        if bound && let Some(first) = first {
            packed = packed.with_replicas(first, replicas);
        }
        if !self.options.writable {
            // Loaded: from here on a stray write faults. Whole regions, so no mapping
            // splits (`ensure` opens a region whole for its fill).
            for arena in packed.all_arenas_mut() {
                arena.set_read_only(true)?;
            }
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
    /// this layer's copy, every node of a split one for its block and its share of the
    /// hot copies, and the mappings of all copies (split blocks and hot copies included)
    /// fit the map budget.
    fn check_copies(
        &self,
        layer: usize,
        spec: &LayerSpec,
        order: Option<&assign::SlotOrder>,
    ) -> Result<()> {
        let copies = self.copies();
        if !self.placer.copy_groups.is_empty() {
            let align = self.options.slot_align.bytes()?;
            let needed = replica::copy_bytes(spec, align)?;
            self.check_replica_memory(format!("layer {layer}'s replica"), needed)?;
        }
        // Where the layer's bytes go and the mappings of every copy: the one arithmetic's
        // answer, asked once.
        let placed =
            (self.placer).arrange(layer, spec.experts, self.strides(spec)?, order.cloned());
        if let Some(set) = self.layout.blocks() {
            self.check_split_memory(layer, &set, &placed)?;
        }
        let maps = placed.mappings;
        if maps > spec.kinds().count() {
            self.check_budget(format!("layer {layer} ({copies} copies)"), maps)?;
        }
        Ok(())
    }

    /// Each kind's slot stride in this store (`None`: the layer has no region of it), as
    /// [`layout::Placer`](super::layout::Placer) takes them.
    pub(super) fn strides(&self, spec: &LayerSpec) -> Result<[Option<u64>; 2]> {
        let align = self.options.slot_align.bytes()?;
        let mut out = [None; 2];
        for kind in spec.kinds() {
            let s = arena::stride_for(spec.bytes(kind), align)
                .ok_or_else(|| Error::overflow(PACK, format!("{spec:?}: a slot's stride")))?;
            out[kind.index()] = Some(s as u64);
        }
        Ok(out)
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
            (_, Some(_)) => {
                let ranges = self.split_bindings(experts, order);
                let (p, calls) = self.bind_blocks(arenas, &ranges)?;
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
    pub(super) fn reserve(
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
    pub(super) fn name_region(&self, region: &Region, layer: usize, kind: Kind) -> Result<()> {
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
    /// Faults the regions in first where the layer copies bytes from memory. Reads
    /// fault the slots in themselves, under the bind, on every loader thread and
    /// overlapped with the device's transfers, where a separate pass zeroes the whole
    /// layer on one thread first (a cold drop-behind load ran 1.5-2x slower with it);
    /// bytes in memory are copied in user space, where a fault that finds the bound
    /// nodes full is not an error the copy can return.
    fn populate_for(
        &self,
        arenas: &mut [Option<Arena>; 2],
        sources: &[ExpertSource<'_>],
    ) -> Result<()> {
        let copies_memory = sources.iter().any(|source| {
            Kind::ALL.iter().any(
                |&kind| matches!(source.tensor(kind), crate::source::Tensor::Memory(b) if !b.is_empty()),
            )
        });
        if self.options.populate && copies_memory {
            for arena in arenas.iter_mut().flatten() {
                arena.populate()?;
            }
        }
        Ok(())
    }

    fn reader<'a>(&'a self, sources: &'a [ExpertSource<'a>]) -> Result<load::Reader<'a>> {
        let shared = self
            .behind
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let reader = load::Reader::new(
            self.options.read_mode,
            sources
                .iter()
                .flat_map(|source| Kind::ALL.map(|kind| source.tensor(kind).files()))
                .flatten(),
        )?
        .shared(shared)
        .expect(
            sources
                .iter()
                .flat_map(|source| Kind::ALL.map(|kind| source.tensor(kind).pieces()))
                .flatten()
                .map(|p| (p.file, p.offset, p.len)),
        )
        .advised(&self.advised)
        .room(self.maps.room());
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
        if self.options.read_mode == crate::source::ReadMode::DropBehind {
            // Drop-behind: in file-offset order, file by file in first-use order. Expert
            // numbers sort as names in most checkpoints (experts 0, 1, 10, 11, ..., 2),
            // and reading them by number sends the kernel's readahead over bytes read
            // and advised away already, which it reads from the device again.
            jobs = file_order(jobs);
        }
        // Direct reads give each loader thread a bounce buffer (one more heap mapping) and,
        // with io_uring, a ring (its own mappings).
        let bounce_maps = reader.scratch_maps();
        let what = || format!("layer {layer} direct-I/O bounce buffer and ring");
        let scratch = if bounce_maps == 0 {
            reader.scratch()?
        } else if let Ok(_reservation) = self.maps.reserve(what, bounce_maps) {
            reader.scratch()?
        } else {
            // No room for the read threads (without io_uring): one read at a time.
            let _reservation = self.maps.reserve(what, reader.scratch_maps_alone())?;
            reader.scratch_alone()?
        };
        let bytes: u64 = lengths.iter().flatten().map(|&n| n as u64).sum();
        let meter = self
            .options
            .progress
            .as_ref()
            .map(|hook| load::Meter::new(hook, (self.number, layer), bytes, jobs.len()));
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
        let roles = self.options.role_major;
        if roles > 1 && !spec.experts.is_multiple_of(roles) {
            return Err(Error::bad_value(
                PACK,
                "experts",
                spec.experts,
                format!(
                    "layer {layer}: role-major slots come in {roles} runs of the experts, \
                     one source per role and expert"
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
}

/// An arena's mapping name: `numapin 3 L12 weights 25` (at most 79 bytes, the kernel's
/// limit, all of them characters it accepts).
fn region_name(store: u64, layer: usize, kind: Kind, n: usize) -> String {
    format!("numapin {store} L{layer} {} {n}", kind.name())
}

/// `jobs` by where their first file piece is: files in the order they first appear, then
/// by offset (stable: jobs of bytes in memory first, in their order).
fn file_order(jobs: Vec<load::Job<'_>>) -> Vec<load::Job<'_>> {
    let mut files: Vec<*const std::fs::File> = Vec::new();
    let mut keyed: Vec<_> = jobs
        .into_iter()
        .map(|job| {
            let key = job.tensor.pieces().first().map(|p| {
                let file: *const std::fs::File = p.file;
                let rank = files.iter().position(|&f| f == file).unwrap_or_else(|| {
                    files.push(file);
                    files.len() - 1
                });
                (rank, p.offset)
            });
            (key, job)
        })
        .collect();
    keyed.sort_by_key(|(key, _)| *key);
    keyed.into_iter().map(|(_, job)| job).collect()
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
