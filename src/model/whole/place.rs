//! Placing a whole checkpoint: the plan applied and priced (`piece_layout`), every budget
//! and memory check made for all of it (`fit`), then one store per (class, layout) packed
//! group by group and the experts packed as [`Checkpoint::pack`] does, in the schedule's
//! order, and the placed model made from the filled stores.

use std::collections::HashMap;

use super::assign::{Assigned, Group, PlacementCost};
use super::classes::TensorClass;
use super::fit::{check_budget, check_memory};
use super::plan::PlacementPlan;
use super::report::{WholeReport, nanos_since};
use super::schedule::{GroupPieces, Step, share_drop_behind};
use super::shape::normalized_shape;
use super::views::{DenseStore, Place, PlacedModel, PlacedTensor};
use crate::error::{Error, Result, quote};
use crate::model::pack::{PlannedLayer, check_layers_budget, pack_planned};
use crate::model::{Checkpoint, ExpertPlan, SliceAxis};
use crate::store::{
    ExpertSource, Kind, LayerReport, LayerSpec, Piece, PinStore, ReadMode, StoreOptions,
};

const OP: &str = "Checkpoint::place";

/// The routed experts' store before its fills, their plan and the layers to pack.
type PlannedExperts<'c> = (PinStore, ExpertPlan, Vec<PlannedLayer<'c>>);

/// What the fills left: the dense stores, where each dense tensor landed, the experts'
/// load time and a report per expert layer.
struct Filled {
    stores: Vec<DenseStore>,
    places: HashMap<usize, Place>,
    expert_load_nanos: u64,
    layer_reports: Vec<Option<LayerReport>>,
}

impl Checkpoint {
    /// Places every tensor of the checkpoint under `plan`: the routed experts in a store
    /// of the plan's expert layout (as [`Checkpoint::pack`]), each dense class in a store
    /// of its layout where each group (class, model layer, layout) is one layer of one
    /// slot holding its tensors at multiples of `max(options.piece_align, 64)` in file
    /// order. Every region is bound once before it is touched; replicas are copied from
    /// the first copy.
    ///
    /// With [`ReadMode::Direct`], and [`ReadMode::Auto`] where a file is mostly not in
    /// the page cache (and [`StoreOptions::piece_congruence`] at its default 0), every
    /// dense tensor starts at an offset congruent to its file offset modulo the larger of
    /// the files' direct-I/O memory alignment (`stx_dio_mem_align`) and that alignment,
    /// whatever its file offset (one at a multiple of 64 in the file stays 64-aligned;
    /// one that is not follows its offset, as in the file), and every expert piece modulo
    /// the direct-I/O alignment (not under a [`PlacementPlan::share`], whose column-cut
    /// rows must stay back to back, nor in role-major slots, whose runs must): each read
    /// lands in the slot in place, only the partial units at a piece's two ends going
    /// through the loader's bounce buffer
    /// ([`ClassMeasured::bounced_bytes`](super::ClassMeasured::bounced_bytes),
    /// [`ClassMeasured::direct_reads`](super::ClassMeasured::direct_reads)), at the price
    /// of less than the modulus in padding per piece. `piece_congruence(1)` keeps the
    /// dense alignment alone and the experts back to back.
    ///
    /// With [`ReadMode::DropBehind`], all the placement's stores share one drop-behind
    /// record per file: a file range is advised away only once every piece in it was read,
    /// by whichever store owns it, and nothing at or past the first piece of a fill still
    /// to run; the fills (dense groups and expert layers) run in file order, each reading
    /// its pieces in file-offset order, so each byte is read from the device once
    /// (tests/whole_model/drop_behind.rs). Per store, a dense class's fill evicted the
    /// expert bytes it read past and the experts' store read them again (1.39x the file).
    ///
    /// Role-major expert slots ([`StoreOptions::role_major`]): a checkpoint whose expert
    /// tensors are flattened per role (DBRX's `w1`/`v1`/`w2`, `[E·I, H]`) gets them
    /// without asking, where no expert assignment or shared store orders the slots and
    /// no share cuts an expert role (a share holding whole experts, `experts_held`, is
    /// role-major over its held experts: a role's tensor is the held experts' rows, one
    /// run, where their ids are consecutive; a tensor-parallel cut stays a slot per
    /// expert); a caller may ask for `role_major(R)`, `R` the layers' weight roles (one
    /// piece each, no scale slot). Slot `r × E + e` then holds role `r` of expert `e`,
    /// on `e`'s node under a split: [`PlacedModel::tensor`] of a role's tensor is one run
    /// of bytes in the file's layout, [`PlacedModel::expert`] is unchanged; the cost is
    /// the store's (`R × blocks` mappings per region on several nodes, one on one node).
    ///
    /// Mappings: a dense group costs one mapping per copy (its layout's nodes for
    /// [`DenseLayout::Replicate`](super::DenseLayout::Replicate), else 1), so a class of L layers costs at most
    /// L × copies mappings (+1 for a global group); the experts cost what the store
    /// costs (2 regions per MoE layer per copy, one per block when split).
    /// [`PlacementCost::mappings`] is the exact sum.
    ///
    /// Before anything is reserved, the whole plan is checked: its mappings against the
    /// map budget, and the bytes each node is asked to hold against what the node has
    /// (or, where placement is denied or unsupported, one copy against all nodes' memory).
    ///
    /// # Errors
    /// [`Error::MapBudget`], [`Error::NodeMemory`] with the figures, before any
    /// allocation; a pattern (or slice pattern) that chooses no dense tensor
    /// ([`Error::InvalidArgument`] naming it: it matches none, or every one it matches is
    /// claimed by a later pattern, named too);
    /// [`Error::Checkpoint`] for a tensor whose bytes are not its dtype × shape, for
    /// the expert naming's faults and for a file truncated since it was opened
    /// ([`CheckpointFault::Truncated`](crate::error::CheckpointFault::Truncated)); what
    /// [`PinStore::pack_layer`] returns.
    pub fn place(&self, plan: &PlacementPlan, options: StoreOptions) -> Result<PlacedModel> {
        self.check_not_truncated()?;
        let (assigned, slot) = self.assigned(plan, &options)?;
        let cost = assigned.cost(self, plan, slot, options.assignment.as_ref())?;
        check_budget(&cost, &options)?;
        check_memory(&cost)?;
        // The assignment places the routed experts: a dense store has none to assign.
        let dense_options = options
            .clone()
            .assignment(None)
            .piece_align(assigned.layout.align)
            .piece_congruence(assigned.layout.modulus)
            .role_major(1);
        let stores = dense_stores(&assigned, &dense_options)?;
        let planned = self.planned_experts(&assigned, plan, &options)?;
        let filled = self.fill(&assigned, &options, stores, planned.as_ref())?;
        // A read racing a truncation can be handed, in full, the zeroed tail of a large
        // folio the truncation cut (seen on ext4): a file shorter now is an error.
        self.check_not_truncated()?;
        self.placed_model(plan, &options, assigned, cost, planned, filled)
    }

    /// The routed experts' store (empty), plan (under the plan's share) and layers to
    /// pack; `None` for a checkpoint without routed experts.
    fn planned_experts(
        &self,
        assigned: &Assigned,
        plan: &PlacementPlan,
        options: &StoreOptions,
    ) -> Result<Option<PlannedExperts<'_>>> {
        let Some(naming) = &assigned.naming else {
            return Ok(None);
        };
        let expert_plan = match &plan.share {
            Some(share) => naming.plan(self)?.share(self, share)?,
            None => naming.plan(self)?,
        };
        let expert_options = options
            .clone()
            .piece_congruence(assigned.expert_modulus)
            .role_major(assigned.roles);
        let store = PinStore::new(plan.experts, expert_options)?;
        // Role-major: R × E slots of one piece each (the report keeps the plan per expert).
        let slots = super::role_major::role_major_plan(&expert_plan, assigned.roles);
        let layers = self.planned_layers(&slots)?;
        Ok(Some((store, expert_plan, layers)))
    }

    /// Runs every fill in [`Checkpoint::schedule`]'s order: each dense group into its
    /// store (a converted group through `pack_converted`), each expert layer into the
    /// experts' store (the map budget checked for all of them before the first); under
    /// [`ReadMode::DropBehind`] with one drop-behind record shared by all the stores,
    /// released once every fill ran.
    fn fill(
        &self,
        assigned: &Assigned,
        options: &StoreOptions,
        mut stores: Vec<DenseStore>,
        planned: Option<&PlannedExperts<'_>>,
    ) -> Result<Filled> {
        let mut dense_pieces = Vec::with_capacity(assigned.groups.len());
        for g in &assigned.groups {
            // A converted group reads and converts its own bytes (pack_converted): no
            // pieces, so it sorts first and is not in the drop-behind record.
            dense_pieces.push(if g.converted {
                None
            } else {
                Some(self.group_pieces(assigned, g)?)
            });
        }
        let steps = self.schedule(options, &dense_pieces, planned.map(|p| &p.2));
        if options.read_mode == ReadMode::DropBehind {
            let experts = planned.map(|p| (&p.0, p.2.as_slice()));
            share_drop_behind(&stores, &dense_pieces, experts);
        }
        let mut places: HashMap<usize, Place> = HashMap::new();
        let mut expert_load_nanos = 0;
        let mut layer_reports: Vec<Option<LayerReport>> = planned
            .iter()
            .flat_map(|p| p.2.iter().map(|_| None))
            .collect();
        let mut budget_checked = false;
        for step in steps {
            match step {
                Step::Dense(i) if assigned.groups[i].converted => {
                    self.pack_converted(assigned, &assigned.groups[i], &mut stores, &mut places)?;
                }
                Step::Dense(i) => {
                    let pieces = dense_pieces[i].take().unwrap_or_default();
                    self.pack_group(&assigned.groups[i], pieces, &mut stores, &mut places)?;
                }
                Step::Experts(i) => {
                    let Some((store, expert_plan, layers)) = planned else {
                        continue;
                    };
                    if !budget_checked {
                        check_layers_budget(store, layers)?;
                        budget_checked = true;
                    }
                    let started = std::time::Instant::now();
                    // Role-major slots are the store's own (a share's ids not given).
                    let report = match assigned.roles {
                        1 => pack_planned(store, &layers[i], &expert_plan.layers()[i])?,
                        _ => store.pack_layer(layers[i].0, &layers[i].1, &layers[i].2)?,
                    };
                    expert_load_nanos += nanos_since(started);
                    layer_reports[i] = Some(report);
                }
            }
        }
        for store in stores
            .iter()
            .map(|d| &d.store)
            .chain(planned.iter().map(|p| &p.0))
        {
            store.share_drop_behind(None);
        }
        Ok(Filled {
            stores,
            places,
            expert_load_nanos,
            layer_reports,
        })
    }

    /// The placed model from the filled stores: its tensor table, the experts' report,
    /// the identity of a shared placement, the figures measured and the whole report.
    fn placed_model(
        &self,
        plan: &PlacementPlan,
        options: &StoreOptions,
        assigned: Assigned,
        cost: PlacementCost,
        planned: Option<PlannedExperts<'_>>,
        filled: Filled,
    ) -> Result<PlacedModel> {
        let Filled {
            stores,
            mut places,
            expert_load_nanos,
            layer_reports,
        } = filled;
        let (experts, expert_report) = match planned {
            Some((store, expert_plan, _)) => {
                let reports = layer_reports.into_iter().flatten().collect();
                let report = self.report(&expert_plan, reports, plan.share.as_ref());
                (Some(store), Some(report))
            }
            None => (None, None),
        };
        let (expert_reads, expert_files) = expert_read_totals(expert_report.as_ref());
        let mut tensors = self.placed_tensors(&assigned, &mut places);
        if let (Some(store), Some(plan), Some(naming)) =
            (&experts, &assigned.experts, &assigned.naming)
        {
            super::expert_tensors::expert_tensors(
                store,
                plan,
                naming,
                assigned.roles,
                &mut tensors,
            )?;
            super::role_major::role_runs(store, plan, assigned.roles, &mut tensors)?;
        }
        let mut model = PlacedModel {
            by_name: tensors
                .iter()
                .enumerate()
                .map(|(i, t)| (t.name.clone(), i))
                .collect(),
            tensors,
            stores,
            experts,
            expert_load_nanos,
            expert_reads,
            expert_files,
            expert_plan: assigned.experts,
            roles: assigned.roles,
            naming: assigned.naming,
            report: None,
            // Read (the files' header bytes) only for a placement that can be exported.
            identity: match options.shared {
                true => Some(super::identity::Identity::of(self)?),
                false => None,
            },
        };
        let measured = model.measure()?;
        let mappings = model.mappings()?;
        model.report = Some(WholeReport {
            plan: plan.to_string(),
            share: plan.share_text(),
            naming: expert_report.as_ref().map(|r| r.naming.clone()),
            files: self.files.len(),
            tensors: self.tensors.len(),
            bytes: self.tensors.iter().map(|t| t.len()).sum(),
            cost,
            measured,
            mappings,
            experts: expert_report,
            converted: super::pack_converted::report_lines(self, &assigned.converts),
        });
        Ok(model)
    }

    /// Packs dense group `g` (its [`Checkpoint::group_pieces`]) into its store and records
    /// where each of its tensors landed (a tensor's pieces after the first are joined: one
    /// run from the first).
    fn pack_group(
        &self,
        g: &Group,
        (packed, counts, pieces): GroupPieces<'_>,
        stores: &mut [DenseStore],
        places: &mut HashMap<usize, Place>,
    ) -> Result<()> {
        if packed.is_empty() {
            return Ok(());
        }
        let sources = [ExpertSource::File {
            weights: pieces,
            scales: Vec::new(),
        }];
        let spec = LayerSpec::fitting(&sources)?;
        let dense = &mut stores[g.store];
        let started = std::time::Instant::now();
        let report = dense.store.pack_layer(g.slot_layer, &spec, &sources)?;
        dense.load_nanos += nanos_since(started);
        for f in &report.files {
            note_file(&mut dense.files, f);
        }
        dense.reads += report.reads;
        dense.bounced += report.bounced_bytes;
        dense.direct = dense.direct.plus(report.direct_reads);
        let map = dense.store.slot_map(g.slot_layer)?;
        let mut slots = map.pieces(0, Kind::Weights).unwrap_or_default();
        for (&i, &count) in packed.iter().zip(&counts) {
            // A tensor's pieces after the first are joined: one run from the first.
            let (mine, rest) = slots.split_at(count.min(slots.len()));
            slots = rest;
            let (Some(first), Some(last)) = (mine.first(), mine.last()) else {
                continue;
            };
            places.insert(
                i,
                Place::Dense {
                    store: g.store,
                    layer: g.slot_layer,
                    offset: first.offset,
                    len: last.end() - first.offset,
                },
            );
        }
        Ok(())
    }

    fn placed_tensors(
        &self,
        assigned: &Assigned,
        places: &mut HashMap<usize, Place>,
    ) -> Vec<PlacedTensor> {
        self.tensors
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let (class, layer) = assigned.class_of[i];
                let place = places
                    .remove(&i)
                    .unwrap_or(if class == TensorClass::RoutedExperts {
                        Place::Experts
                    } else {
                        Place::Empty
                    });
                let cut = assigned.cuts[i];
                let mut shape = normalized_shape(t);
                if let Some(c) = cut {
                    let axis = match c.slice.axis {
                        SliceAxis::Rows => shape.first_mut(),
                        SliceAxis::Columns => shape.last_mut(),
                    };
                    if let Some(d) = axis {
                        *d = c.slice.len;
                    }
                }
                PlacedTensor {
                    name: t.name().to_owned(),
                    class,
                    layer,
                    dtype: assigned.converts[i].map_or(t.dtype(), |c| c.to),
                    converted: assigned.converts[i],
                    shape,
                    file: t.file(),
                    offset: t.offset().saturating_add(cut.map_or(0, |c| c.run.offset)),
                    len: cut.map_or(t.len(), |c| c.run.bytes()),
                    rows: cut.map_or((1, 0), |c| (c.run.count, c.run.stride)),
                    place,
                    slice: cut.map(|c| c.slice),
                }
            })
            .collect()
    }

    /// The store's [`Piece`] of `bytes` at file offset `offset` of tensor `index`.
    pub(super) fn piece(&self, index: usize, offset: u64, bytes: u64) -> Result<Piece<'_>> {
        let t = &self.tensors[index];
        let file = self.files.get(t.file()).ok_or_else(|| {
            Error::bad_value(
                OP,
                "a tensor's file",
                t.file(),
                format!("the checkpoint has {} files", self.files.len()),
            )
        })?;
        let len = usize::try_from(bytes).map_err(|_| {
            Error::overflow(OP, format!("{}: {bytes} bytes as a usize", quote(t.name())))
        })?;
        Ok(Piece::new(file.file(), offset, len))
    }
}

/// A store for each dense class and layout of the assignment, empty.
fn dense_stores(assigned: &Assigned, options: &StoreOptions) -> Result<Vec<DenseStore>> {
    assigned
        .stores
        .iter()
        .map(|&(class, layout)| {
            Ok(DenseStore {
                class,
                store: PinStore::new(layout.store_layout(), options.clone())?,
                reads: 0,
                bounced: 0,
                direct: crate::source::DirectReads::default(),
                load_nanos: 0,
                files: Vec::new(),
            })
        })
        .collect()
}

/// The experts' direct reads summed over their layers, and the files they read (each
/// once: [`note_file`]).
fn expert_read_totals(
    report: Option<&crate::model::pack::ModelReport>,
) -> (crate::source::DirectReads, Vec<crate::store::FileRead>) {
    let layers = || report.into_iter().flat_map(|r| &r.layer_reports);
    let reads = layers().fold(crate::source::DirectReads::default(), |d, l| {
        d.plus(l.direct_reads)
    });
    let files = layers()
        .flat_map(|l| &l.files)
        .fold(Vec::new(), |mut all, f| {
            note_file(&mut all, f);
            all
        });
    (reads, files)
}

/// Adds `f` to `all` unless a read of the same path is there already (the first load's
/// decision stands for the file).
pub(crate) fn note_file(all: &mut Vec<crate::store::FileRead>, f: &crate::store::FileRead) {
    if !all.iter().any(|a| a.path == f.path) {
        all.push(f.clone());
    }
}
