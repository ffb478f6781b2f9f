//! [`Layout::Replicate`], [`Layout::ReplicateDomains`] and [`Layout::SplitExperts`]:
//! which node holds what, the memory check before replicas are built, the replica copies,
//! and the lookups ([`PinStore::weights_local`], [`PinStore::weights_on`],
//! [`PinStore::home_node`]).
//!
//! A copy lives on a group of nodes ([`PinStore::copy_groups`]): one node for
//! [`Layout::Replicate`], a domain's nodes for [`Layout::ReplicateDomains`]. Each copy is
//! known by its group's lowest node (the node [`PinStore::replica_nodes`] lists).
//!
//! The memory checks read [`crate::topology::available_bytes`] (its module docs say
//! which figure, and why).

#[cfg(doc)]
use super::Layout;
use super::arena::Arena;
use super::layer::{Arenas, Layer};
use super::layout::copy_policy;
use super::{Kind, LayerSpec, PinStore};
use crate::error::{Error, Result};
use crate::node::{Node, NodeSet};
use crate::source::Tensor;
use crate::source::load::{self, OnNode};
use crate::topology::{self, FIGURE, Topology, available_bytes};

/// What [`PinStore::build_replicas`] made.
#[derive(Default)]
pub(super) struct Built {
    /// The replicas after the first, with their nodes.
    pub(super) replicas: Vec<(Node, Arenas)>,
    /// `mbind` calls made.
    pub(super) mbind_calls: usize,
    /// Bytes written by a loader on the replica's node.
    pub(super) local_bytes: u64,
    /// Loader threads that could not run on the replica's node.
    pub(super) off_node_loaders: usize,
    /// The nodes the copying loaders ran on (see [`load::Filled::loader_nodes`]).
    pub(super) loader_nodes: Vec<Node>,
}

/// The bytes one copy of a layer of `spec` maps (every region, padding included).
pub(crate) fn copy_bytes(spec: &LayerSpec, align: usize) -> Result<u64> {
    let mut total: u64 = 0;
    for kind in spec.kinds() {
        let stride = super::arena::stride_for(spec.bytes(kind), align);
        let bytes = stride.and_then(|s| s.checked_mul(spec.experts));
        let Some(bytes) = bytes else {
            return Err(Error::overflow(
                "PinStore",
                format!("{spec:?}: a copy's size"),
            ));
        };
        total = total.saturating_add(bytes as u64);
    }
    Ok(total)
}

impl PinStore {
    /// Checks, before anything is mapped, that `layers` layers of `spec` fit in the memory
    /// of every node that gets a copy: for [`Layout::Replicate`], each node of the set
    /// needs the whole model; for [`Layout::ReplicateDomains`], each node of a domain its
    /// share of the interleaved copy (the model ÷ the domain's nodes in the set, rounded
    /// up). Other layouts, and machines where placement is denied or unsupported (one
    /// unplaced copy is built then), pass.
    ///
    /// The per-node figure is `MemFree + Inactive(file)` (free pages plus clean page cache
    /// the kernel drops first; not `MemFree`, which leaves out the model file just read,
    /// nor `FilePages`, which counts active and dirty cache the kernel keeps). The
    /// planner's live machine and the probe read the same figure.
    ///
    /// # Errors
    /// [`Error::NodeMemory`] naming each node's available bytes and the figure used; the
    /// sizes overflow; or a node's meminfo cannot be read.
    pub fn check_model_memory(&self, layers: usize, spec: &LayerSpec) -> Result<()> {
        let align = self.options.slot_align.bytes()?;
        let needed = copy_bytes(spec, align)?.saturating_mul(layers as u64);
        self.check_replica_memory(format!("a model of {layers} layers"), needed)
    }

    /// [`PinStore::check_model_memory`] for `needed` bytes per copy.
    pub(super) fn check_replica_memory(&self, what: String, needed: u64) -> Result<()> {
        if self.placer.copy_groups.is_empty()
            || crate::calls::NumaCall::Mbind.support()? != crate::calls::MempolicySupport::Available
        {
            return Ok(());
        }
        // An interleaved copy puts an equal share of its pages on each node of its group.
        let share = |group: &NodeSet| needed.div_ceil(group.len().max(1) as u64);
        let mut nodes = Vec::new();
        for group in &self.placer.copy_groups {
            for node in group.iter() {
                if let Some(bytes) = available_bytes(node)? {
                    nodes.push((node, bytes, share(group), group.len()));
                }
            }
        }
        // The error names every node that needs the same share as the first one short of
        // it (all the nodes, for one copy per node).
        let Some(&(_, _, short, per)) = nodes.iter().find(|&&(_, bytes, s, _)| bytes < s) else {
            return Ok(());
        };
        let available = nodes
            .iter()
            .filter(|&&(_, _, s, _)| s == short)
            .map(|&(node, bytes, _, _)| (node, bytes))
            .collect();
        let what = if per > 1 {
            format!("{what}, interleaved over the {per} nodes of each domain")
        } else {
            what
        };
        Err(Error::NodeMemory {
            what,
            needed: short,
            available,
            figure: FIGURE,
        })
    }

    /// Builds the replicas after the first copy (`first`, loaded): for each further group
    /// of [`PinStore::copy_groups`], reserves the layer's regions, binds them to the
    /// group's node (or interleaves them over its nodes), populates them, and copies every
    /// slot from the first copy with the loader threads, running on the group's CPUs
    /// (helpers under the map budget, as for a fill). Returns the replicas, the `mbind`
    /// calls made and what the loaders did.
    pub(super) fn build_replicas(
        &self,
        layer: usize,
        spec: &LayerSpec,
        first: &Arenas,
    ) -> Result<Built> {
        let mut built = Built::default();
        for group in self.placer.copy_groups.iter().skip(1) {
            let Some(lead) = group.nth(0) else { continue };
            let (copy, calls, filled) = self.build_copy(layer, spec, group, first)?;
            built.mbind_calls += calls;
            built.local_bytes += filled.local_bytes;
            built.off_node_loaders += filled.off_node_loaders;
            built.loader_nodes.extend(filled.loader_nodes);
            built.replicas.push((lead, copy));
        }
        Ok(built)
    }

    /// One replica of a layer of `spec` on the nodes of `group`, copied from `first`;
    /// with the `mbind` calls made and what the loaders did.
    fn build_copy(
        &self,
        layer: usize,
        spec: &LayerSpec,
        group: &NodeSet,
        first: &Arenas,
    ) -> Result<(Arenas, usize, load::Filled)> {
        let mut copy = self.reserve(layer, spec, None)?;
        let policy = copy_policy(group);
        let mut calls = 0;
        for arena in copy.iter().flatten() {
            let placement = arena.bind(&policy)?;
            self.mbind_calls
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            calls += 1;
            // Kept in the store's placement (the first degradation sticks).
            let _ = self.note_placement(placement);
        }
        if self.options.populate {
            for arena in copy.iter_mut().flatten() {
                arena.populate()?;
            }
        }
        let filled = self.copy_replica(layer, group, &mut copy, first)?;
        Ok((copy, calls, filled))
    }

    /// Benchmark only: builds one more copy of `layer` bound to `node` exactly as a
    /// replica is built (reserve, bind, populate, copy with the loader threads on the
    /// node), then drops it; returns the bytes copied. It lets a one-node machine
    /// measure what building k replicas costs, k copies on one node.
    ///
    /// # Errors
    /// The layer is not packed, or as [`PinStore::pack_layer`].
    #[doc(hidden)]
    pub fn bench_replica_copy(&self, layer: usize, node: Node) -> Result<u64> {
        let l = self.layer(layer)?;
        let group = std::iter::once(node).collect();
        let (copy, _, _) = self.build_copy(layer, l.spec(), &group, l.first_copy())?;
        Ok(copy.iter().flatten().map(Arena::loaded_bytes).sum())
    }

    /// Copies every loaded slot of `first` into `copy` with the loader threads on the
    /// group's node (spread over its nodes for an interleaved copy); marks the slots
    /// loaded.
    fn copy_replica(
        &self,
        layer: usize,
        group: &NodeSet,
        copy: &mut Arenas,
        first: &Arenas,
    ) -> Result<load::Filled> {
        let mut jobs = Vec::new();
        for ((kind, to), from) in Kind::ALL.into_iter().zip(copy.iter_mut()).zip(first) {
            let (Some(to), Some(from)) = (to, from) else {
                continue;
            };
            for (slot, dest) in to.slots_mut()?.into_iter().enumerate() {
                if let Some(bytes) = from.slot(slot) {
                    jobs.push(load::Job {
                        dest,
                        tensor: Tensor::Memory(bytes),
                        what: (layer, slot, kind),
                    });
                }
            }
        }
        jobs.sort_by_key(|job| (job.what.1, job.what.2));
        let reader = load::Reader::buffered();
        let threads = self.options.loader_threads;
        let (node, spread): (Option<Node>, Vec<Node>) = if group.len() == 1 {
            (group.nth(0), Vec::new())
        } else {
            (None, group.iter().collect())
        };
        let loading = load::Loading {
            reader: &reader,
            scratch: reader.scratch()?,
            meter: None,
            target: &|_| node,
            spread: &spread,
        };
        let filled = load::fill(jobs, threads, loading, |spawned| {
            let what = || format!("replica loader thread {} of {threads}", spawned + 2);
            self.maps.reserve(what, load::LOADER_THREAD_MAPS).ok()
        })?;
        for (to, from) in copy.iter_mut().zip(first) {
            let (Some(to), Some(from)) = (to, from) else {
                continue;
            };
            for slot in 0..from.slots() {
                if let Some(len) = from.loaded(slot) {
                    to.mark_loaded(slot, len);
                }
            }
        }
        Ok(filled)
    }

    /// Binds each region of a split layer range by range (`ranges`, from
    /// [`PinStore::split_bindings`]): one `mbind` per range per region.
    pub(super) fn bind_blocks(
        &self,
        arenas: &Arenas,
        ranges: &[(std::ops::Range<usize>, crate::policy::MemPolicy)],
    ) -> Result<(crate::policy::Placement, usize)> {
        let mut placement = crate::policy::Placement::Bound;
        let mut calls = 0;
        for (slots, policy) in ranges {
            for arena in arenas.iter().flatten() {
                let p = arena.bind_slots(slots.clone(), policy)?;
                self.mbind_calls
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                calls += 1;
                placement = self.note_placement(p);
            }
        }
        Ok((placement, calls))
    }

    /// The node expert `expert` of layer `layer` is bound to, by the layout:
    /// [`Layout::SplitExperts`] its block's node, [`Layout::LayerPerNode`] the layer's
    /// node; `None` where no single node holds it ([`Layout::Interleave`],
    /// [`Layout::Replicate`]: every node of the set, see [`PinStore::weights_local`]) or
    /// nothing is placed ([`Layout::Unplaced`]). Where placement degraded
    /// ([`PinStore::degraded`]) this is where the layout meant it to be.
    ///
    /// # Errors
    /// The layer is not packed, the expert is out of range, or not in the layer's share
    /// ([`Error::NotHeld`]).
    pub fn home_node(&self, layer: usize, expert: usize) -> Result<Option<Node>> {
        let l = self.layer(layer)?;
        let (experts, expert) = (l.experts(), l.slot_of(layer, expert)?);
        if !self.layout.has_home() || self.is_hot(layer, expert) {
            return Ok(None);
        }
        Ok(self.expert_node(layer, experts, expert))
    }

    /// The weights of `expert` of `layer` in the replica on the calling thread's node
    /// (`sched_getcpu` through the CPU → node table read once from sysfs), or for
    /// [`Layout::ReplicateDomains`] on its domain; a thread on a node without a replica
    /// (memoryless, or outside the set) gets the replica holding the set's node nearest to
    /// its own by sysfs distance, ties to the lower node id. For a layer that is not replicated
    /// (another layout, or placement degraded: one unplaced copy, see
    /// [`PinStore::degraded`]) this is [`PinStore::weights`].
    ///
    /// # Errors
    /// As [`PinStore::weights`], or the topology cannot be read.
    ///
    /// # Example
    /// ```
    /// use numapin::store::{ExpertSource, LayerSpec, Layout, PinStore, StoreOptions};
    /// use numapin::NodeSet;
    ///
    /// let store = PinStore::new(Layout::Replicate(NodeSet::allowed()?), StoreOptions::default())?;
    /// let weights = vec![vec![3u8; 5000], vec![4u8; 5000]];
    /// let sources: Vec<ExpertSource> = weights
    ///     .iter()
    ///     .map(|w| ExpertSource::Memory { weights: w, scales: &[] })
    ///     .collect();
    /// let spec = LayerSpec { experts: 2, weight_bytes: 5000, scale_bytes: 0 };
    /// store.pack_layer(0, &spec, &sources)?;
    /// // Per expert per token, from any thread: this node's copy (or the nearest).
    /// assert_eq!(store.weights_local(0, 1)?, &weights[1][..]);
    /// # Ok::<(), numapin::Error>(())
    /// ```
    pub fn weights_local(&self, layer: usize, expert: usize) -> Result<&[u8]> {
        self.slot_near(topology::current_node()?, layer, expert, Kind::Weights)
    }

    /// The scales of the replica on the calling thread's node; see
    /// [`PinStore::weights_local`].
    ///
    /// # Errors
    /// As [`PinStore::weights_local`].
    pub fn scales_local(&self, layer: usize, expert: usize) -> Result<&[u8]> {
        self.slot_near(topology::current_node()?, layer, expert, Kind::Scales)
    }

    /// The weights of the replica on `node` (or the nearest replica to it, as
    /// [`PinStore::weights_local`]), for engines that schedule by node themselves.
    ///
    /// # Errors
    /// As [`PinStore::weights_local`].
    pub fn weights_on(&self, node: Node, layer: usize, expert: usize) -> Result<&[u8]> {
        self.slot_near(node, layer, expert, Kind::Weights)
    }

    /// The scales of the replica on `node`; see [`PinStore::weights_on`].
    ///
    /// # Errors
    /// As [`PinStore::weights_local`].
    pub fn scales_on(&self, node: Node, layer: usize, expert: usize) -> Result<&[u8]> {
        self.slot_near(node, layer, expert, Kind::Scales)
    }

    /// The nodes holding a replica of `layer`, each copy known by its lowest node (one per
    /// domain for [`Layout::ReplicateDomains`], see [`PinStore::copy_groups`]); empty: the
    /// layer is not replicated.
    ///
    /// # Errors
    /// The layer is not packed.
    pub fn replica_nodes(&self, layer: usize) -> Result<NodeSet> {
        Ok(*self.layer(layer)?.replica_nodes())
    }

    /// Every copy of one tensor of expert `expert` (its global id): `(node, bytes)` for
    /// each copy that holds it, the first copy first (each replica known by its lowest
    /// node; a hybrid layer's split copy by the expert's home node); one entry with no
    /// node where the layer is not replicated, or has no tensor of `kind` (empty bytes).
    ///
    /// # Errors
    /// As [`PinStore::weights`]: a copy's slot released is [`Error::Released`].
    pub(crate) fn copies_of(
        &self,
        layer: usize,
        expert: usize,
        kind: Kind,
    ) -> Result<Vec<(Option<Node>, &[u8])>> {
        let l = self.layer(layer)?;
        if l.replica_nodes().is_empty() || l.arena(kind).is_none() {
            return Ok(vec![(None, self.slot(layer, expert, kind)?)]);
        }
        let slot = l.slot_of(layer, expert)?;
        let split = self.layout.blocks().is_some();
        let mut copies = Vec::new();
        for (i, (lead, arenas)) in l.replicas().enumerate() {
            let Some(arena) = arenas[kind.index()].as_ref().filter(|a| a.holds(slot)) else {
                continue; // a hybrid layer's hot copy, for a cold expert
            };
            let node = match (split, i) {
                (true, 0) => self.home_node(layer, expert)?,
                _ => Some(lead),
            };
            let bytes = arena.slot(slot).ok_or(Error::Released {
                op: "PinStore",
                layer,
                expert,
                kind: kind.name(),
            })?;
            copies.push((node, bytes));
        }
        Ok(copies)
    }

    fn slot_near(&self, node: Node, layer: usize, expert: usize, kind: Kind) -> Result<&[u8]> {
        let l = self.layer(layer)?;
        let nodes = l.replica_nodes();
        if nodes.is_empty() {
            return self.slot(layer, expert, kind);
        }
        let slot = l.slot_of(layer, expert)?;
        let at = self.copy_lead(Topology::get()?, node, nodes);
        let Some(arena) = at.and_then(|at| l.replica_arena(at, kind)) else {
            return Ok(&[]);
        };
        if !arena.holds(slot) {
            // A hybrid layer's copy of its hot experts, asked for a cold one: its home.
            return self.slot(layer, expert, kind);
        }
        arena.slot(slot).ok_or(Error::Released {
            op: "PinStore",
            layer,
            expert,
            kind: kind.name(),
        })
    }

    /// Slots `first..first + count` of `layer` (slot indices: not a share's layer) on
    /// the copy a thread on `node` reads, as one run of bytes where they are back to back
    /// (each slot but the last loaded to its whole stride, in slot order): a role's run
    /// of experts under [`StoreOptions::role_major`](super::StoreOptions::role_major).
    /// `None` where they are not one run.
    ///
    /// # Errors
    /// The layer is not packed; the topology cannot be read.
    pub(crate) fn run_near(
        &self,
        node: Node,
        layer: usize,
        (first, count): (usize, usize),
        kind: Kind,
    ) -> Result<Option<&[u8]>> {
        let l = self.layer(layer)?;
        let nodes = l.replica_nodes();
        let arena = if nodes.is_empty() {
            l.arena(kind)
        } else {
            let at = self.copy_lead(Topology::get()?, node, nodes);
            at.and_then(|at| l.replica_arena(at, kind))
        };
        Ok(arena.and_then(|a| a.run(first, count)))
    }

    /// The store's [`StoreOptions::role_major`](super::StoreOptions::role_major).
    pub(crate) fn role_major(&self) -> usize {
        self.options.role_major
    }

    /// [`PinStore::run_near`] on the calling thread's node.
    ///
    /// # Errors
    /// As [`PinStore::run_near`].
    pub(crate) fn run_local(
        &self,
        layer: usize,
        slots: (usize, usize),
        kind: Kind,
    ) -> Result<Option<&[u8]>> {
        self.run_near(topology::current_node()?, layer, slots, kind)
    }

    /// The lowest node of the copy a thread on `node` reads: the copy whose group holds
    /// the node of the groups nearest to `node` (`node` itself when a group holds it),
    /// among the copies the layer has (`leads`).
    fn copy_lead(&self, topology: &Topology, node: Node, leads: &NodeSet) -> Option<Node> {
        // A replicated layer's copies, or a hybrid layer's hot copies (per node or domain).
        let groups = self.groups();
        if groups.is_empty() {
            return topology.nearest(node, leads);
        }
        // Per lookup, so no allocation: the copies this layer has are the groups whose
        // lead it lists; the reader's own group first, else the group of the nearest node.
        let has = |g: &&NodeSet| g.nth(0).is_some_and(|lead| leads.contains(lead));
        if let Some(own) = groups.iter().filter(has).find(|g| g.contains(node)) {
            return own.nth(0);
        }
        let all = groups
            .iter()
            .filter(has)
            .fold(NodeSet::new(), |all, g| all.union(g));
        let at = topology.nearest(node, &all)?;
        groups.iter().filter(has).find(|g| g.contains(at))?.nth(0)
    }

    /// Copies `expert`'s loaded tensors from the first copy into every replica where they
    /// are released, each on a thread running on the replica's node.
    pub(super) fn sync_replicas(&mut self, layer: usize, expert: usize) -> Result<()> {
        let Some(l) = self.layers.get_mut(layer) else {
            return Ok(());
        };
        for kind in Kind::ALL {
            let (first, others) = l.split_replicas_mut(kind);
            let Some(first) = first else { continue };
            let first: &Arena = first;
            if first.loaded(expert).is_none() {
                continue;
            }
            for (node, arena) in others {
                if arena.holds(expert) && arena.loaded(expert).is_none() {
                    let _on_node = OnNode::enter(node);
                    arena.writing(|arena| arena.copy_slot_from(first, expert))?;
                }
            }
        }
        Ok(())
    }
}

/// Loaded bytes per node by the layout: each replica's, or each block's of a split layer,
/// or the layer's node for [`Layout::LayerPerNode`].
pub(super) fn node_bytes(
    store: &PinStore,
    index: usize,
    layer: &Layer,
    into: &mut std::collections::BTreeMap<Node, u64>,
) {
    // A split layer's first copy is counted expert by expert below; its other copies
    // (a hybrid layer's hot experts) whole.
    let split = store.layout.blocks().is_some();
    let mut replicated = false;
    for (i, (lead, arenas)) in layer.replicas().enumerate() {
        replicated = true;
        if split && i == 0 {
            continue;
        }
        let bytes: u64 = arenas.iter().flatten().map(Arena::loaded_bytes).sum();
        let single = std::iter::once(lead).collect();
        let group = store
            .groups()
            .iter()
            .find(|g| g.contains(lead))
            .unwrap_or(&single);
        spread(group, bytes, into);
    }
    if replicated && !split {
        return;
    }
    let experts = layer.experts();
    // The first copy's hot range, where it is interleaved over the first hot group.
    let first_hot = (store.placer.hot_groups.first())
        .filter(|g| replicated && g.len() > 1)
        .copied();
    let mut hot_bytes = 0;
    for (_, arena) in layer.arenas_by_kind() {
        for expert in 0..experts {
            let Some(len) = arena.loaded(expert) else {
                continue;
            };
            if first_hot.is_some() && store.is_hot(index, expert) {
                hot_bytes += len as u64;
            } else if let Some(node) = store.expert_node(index, experts, expert) {
                *into.entry(node).or_default() += len as u64;
            }
        }
    }
    if let Some(group) = first_hot {
        spread(&group, hot_bytes, into);
    }
}

/// An interleaved copy of `bytes` on `group`: an equal share per node (the remainder on
/// the lowest nodes).
fn spread(group: &NodeSet, bytes: u64, into: &mut std::collections::BTreeMap<Node, u64>) {
    let n = group.len().max(1) as u64;
    for (i, node) in group.iter().enumerate() {
        *into.entry(node).or_default() += bytes / n + u64::from((i as u64) < bytes % n);
    }
}
