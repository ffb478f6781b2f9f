//! A checkpoint's experts into a [`PinStore`]: every MoE layer packed at its model layer
//! number straight from the files (each piece a `pread` into its slot, no copy per
//! expert, also across shards). The check that re-reads every slot's pieces is
//! `verify.rs`.

use std::collections::BTreeMap;
use std::fmt;

use super::{Checkpoint, ExpertPlan, LayerPlan, Naming, RoleSlice, Share};
use crate::error::{Error, Result};
use crate::store::{ExpertSource, LayerReport, LayerSpec, Piece, PinStore};

/// What [`Checkpoint::pack`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct ModelReport {
    /// The expert naming used (detected, or chosen with [`Checkpoint::pack_with`]).
    pub naming: String,
    /// Files of the checkpoint.
    pub files: usize,
    /// MoE layers packed (dense layers are not in the store).
    pub layers: usize,
    /// Model layer number → experts packed.
    pub experts_per_layer: BTreeMap<usize, usize>,
    /// Expert bytes packed (weights and scales, as in the files; padding from
    /// [`StoreOptions::piece_align`](crate::store::StoreOptions::piece_align) not
    /// included).
    pub bytes: u64,
    /// `pread` calls issued.
    pub reads: usize,
    /// Tensors that are not experts, left for the engine to load.
    pub engine_tensors: usize,
    /// Their bytes.
    pub engine_bytes: u64,
    /// Each layer's report, by increasing layer number.
    pub layer_reports: Vec<LayerReport>,
    /// The rank's share placed ([`Checkpoint::pack_share`]); `None`: the whole
    /// checkpoint.
    pub share: Option<ShareReport>,
}

/// Which share of a checkpoint a store holds: what an engine checks it got.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct ShareReport {
    /// The share asked for ([`Share`]'s text: `experts 0-63, slice rows:0/2`).
    pub share: String,
    /// Model layer → the global expert ids held, as ranges (`"0-63"`).
    pub experts_held: BTreeMap<usize, String>,
    /// Model layer → experts the checkpoint's layer has.
    pub experts_of: BTreeMap<usize, usize>,
    /// Model layer → how each role was sliced (empty without a slice).
    pub slices: BTreeMap<usize, Vec<RoleSlice>>,
}

impl fmt::Display for ModelReport {
    /// One line: `naming per-expert: 2 MoE layers × 4 experts packed (98304 bytes, 24 reads,
    /// 2 files); 31 tensors (27392 bytes) left for the engine`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut counts = self.experts_per_layer.values();
        let first = counts.next();
        write!(f, "naming {}: {} MoE layers", self.naming, self.layers)?;
        match first {
            Some(n) if counts.all(|c| c == n) => write!(f, " × {n} experts")?,
            Some(_) => {
                let per: Vec<String> = self
                    .experts_per_layer
                    .iter()
                    .map(|(l, n)| format!("{l}:{n}"))
                    .collect();
                write!(f, " (experts per layer {})", per.join(","))?;
            }
            None => {}
        }
        write!(
            f,
            " packed ({} bytes, {} reads, {} files); {} tensors ({} bytes) left for the engine",
            self.bytes, self.reads, self.files, self.engine_tensors, self.engine_bytes
        )?;
        if let Some(share) = &self.share {
            write!(f, "; share: {}", share.share)?;
        }
        Ok(())
    }
}

impl Checkpoint {
    /// Packs every MoE layer into `store` with [`PinStore::pack_layer`] at its model layer
    /// number, the expert naming detected (see [`Naming::detect`]). Dense layers are not
    /// packed. An expert's weight slot holds its weight pieces in the naming's order
    /// (gate, up, down; fused: gate_up, down), its scale slot the scale pieces in the same
    /// order and then the expert's biases, if any ([`Naming::Generic`]); each piece is read from its own file straight into the slot, so an expert
    /// split across two shards costs a read per shard and no copy. Where the pieces went
    /// inside a slot: [`PinStore::slot_map`].
    ///
    /// The map budget for the whole model is checked before anything is reserved
    /// ([`PinStore::check_model_budget`]); a model with some layers with scales and some
    /// without is counted as if all had them.
    ///
    /// # Errors
    /// [`Error::Checkpoint`] from the naming ([`CheckpointFault::NoExperts`] listing names
    /// that look like expert tensors, [`CheckpointFault::Missing`],
    /// [`CheckpointFault::Shape`]); [`Error::MapBudget`] when the model cannot fit;
    /// whatever [`PinStore::pack_layer`] returns (a layer packed already, a read that
    /// fails). Layers packed before an error stay packed.
    ///
    /// [`CheckpointFault::NoExperts`]: crate::CheckpointFault::NoExperts
    /// [`CheckpointFault::Missing`]: crate::CheckpointFault::Missing
    /// [`CheckpointFault::Shape`]: crate::CheckpointFault::Shape
    ///
    /// # Example
    /// ```no_run
    /// use numapin::model::Checkpoint;
    /// use numapin::store::{Layout, PinStore, StoreOptions};
    ///
    /// let checkpoint = Checkpoint::open("/models/qwen-moe")?; // shards and their index
    /// let store = PinStore::new(Layout::Interleave(numapin::NodeSet::allowed()?),
    ///                           StoreOptions::default())?;
    /// let report = checkpoint.pack(&store)?;
    /// println!("{report}");
    /// let gate_up_down: &[u8] = store.weights(3, 17)?; // layer 3, expert 17
    /// let down = store.slot_map(3)?.pieces(17, numapin::store::Kind::Weights).unwrap()[2];
    /// let _down_bytes = &gate_up_down[down.offset..down.end()];
    /// assert!(checkpoint.verify(&store)?.verified());
    /// # Ok::<(), numapin::Error>(())
    /// ```
    pub fn pack(&self, store: &PinStore) -> Result<ModelReport> {
        let naming = Naming::detect(self)?;
        self.pack_with(store, &naming)
    }

    /// [`Checkpoint::pack`] with a naming chosen by hand.
    ///
    /// # Errors
    /// As [`Checkpoint::pack`].
    pub fn pack_with(&self, store: &PinStore, naming: &Naming) -> Result<ModelReport> {
        let plan = naming.plan(self)?;
        self.pack_plan(store, &plan, None)
    }

    /// Packs a rank's share: the experts `share` holds of each layer, each piece cut to
    /// its tensor slice ([`ExpertPlan::share`]), each layer with
    /// [`PinStore::pack_layer_share`] so that lookups take global expert ids. The map
    /// budget, the layouts' blocks and the report count the share. The naming is
    /// detected; [`Checkpoint::pack_share_with`] takes one.
    ///
    /// # Errors
    /// As [`Checkpoint::pack`], and [`ExpertPlan::share`]'s errors (an expert id past a
    /// layer's count, nothing held in a layer, a slice past an axis or through a block).
    ///
    /// # Example
    /// ```no_run
    /// use numapin::model::{Checkpoint, ExpertShare, Share, TensorSlice};
    /// use numapin::store::{Layout, PinStore, StoreOptions};
    ///
    /// let checkpoint = Checkpoint::open("/models/qwen-moe")?;
    /// let store = PinStore::new(Layout::SplitExperts(numapin::NodeSet::parse("0-1")?),
    ///                           StoreOptions::default())?;
    /// // Rank 1 of 2 under expert parallelism: the second half of each layer's experts.
    /// let share = Share::default().experts(ExpertShare::part(1, 2)?);
    /// let report = checkpoint.pack_share(&store, &share)?;
    /// println!("{report}");
    /// let w = store.weights(3, 100)?; // global id 100: held by rank 1 of 128 experts
    /// assert!(checkpoint.verify_share(&store, &share)?.verified());
    /// # let _ = (w, TensorSlice::parse("rows:0/2")?);
    /// # Ok::<(), numapin::Error>(())
    /// ```
    pub fn pack_share(&self, store: &PinStore, share: &Share) -> Result<ModelReport> {
        let naming = Naming::detect(self)?;
        self.pack_share_with(store, &naming, share)
    }

    /// [`Checkpoint::pack_share`] with a naming chosen by hand.
    ///
    /// # Errors
    /// As [`Checkpoint::pack_share`].
    pub fn pack_share_with(
        &self,
        store: &PinStore,
        naming: &Naming,
        share: &Share,
    ) -> Result<ModelReport> {
        let plan = naming.plan(self)?.share(self, share)?;
        self.pack_plan(store, &plan, Some(share))
    }

    /// The source of global expert `expert` of model layer `layer` in `plan` (a share's
    /// or the whole): what [`PinStore::ensure`] or an
    /// [`ExpertCache`](crate::cache::ExpertCache) miss loads.
    ///
    /// # Errors
    /// No such layer in the plan ([`Error::NotPacked`]), an expert the plan does not hold
    /// ([`Error::NotHeld`]) or past the layer's experts.
    pub fn expert_source(
        &self,
        plan: &ExpertPlan,
        layer: usize,
        expert: usize,
    ) -> Result<ExpertSource<'_>> {
        let l = plan.layer(layer).ok_or(Error::NotPacked {
            op: "Checkpoint::expert_source",
            layer,
        })?;
        self.source_of(l.expert(expert)?)
    }

    fn pack_plan(
        &self,
        store: &PinStore,
        plan: &ExpertPlan,
        share: Option<&Share>,
    ) -> Result<ModelReport> {
        let layers = self.planned_layers(plan)?;
        check_layers_budget(store, &layers)?;
        let mut layer_reports = Vec::with_capacity(layers.len());
        for (planned, l) in layers.iter().zip(plan.layers()) {
            layer_reports.push(pack_planned(store, planned, l)?);
        }
        // A read racing a truncation can be handed the zeroed tail of the large folio
        // it cut, in full: a file shorter now than when opened is an error.
        self.check_not_truncated()?;
        Ok(self.report(plan, layer_reports, share))
    }

    /// Each layer of `plan` (its number, spec and sources), sized and checked, nothing
    /// packed: built once, packed with [`pack_planned`].
    pub(crate) fn planned_layers(&self, plan: &ExpertPlan) -> Result<Vec<PlannedLayer<'_>>> {
        self.check_not_truncated()?;
        let mut layers = Vec::with_capacity(plan.layers().len());
        for layer in plan.layers() {
            let sources = self.sources(layer)?;
            let spec = LayerSpec::fitting(&sources)?;
            layers.push((layer.layer(), spec, sources));
        }
        Ok(layers)
    }

    pub(crate) fn report(
        &self,
        plan: &ExpertPlan,
        layer_reports: Vec<LayerReport>,
        share: Option<&Share>,
    ) -> ModelReport {
        let share = share.map(|share| {
            let held = || {
                plan.layers()
                    .iter()
                    .filter_map(|l| Some((l.layer(), l.share()?)))
            };
            ShareReport {
                share: share.to_string(),
                experts_held: held()
                    .map(|(l, s)| (l, crate::store::ids_text(s.expert_ids())))
                    .collect(),
                experts_of: held().map(|(l, s)| (l, s.of())).collect(),
                slices: held().map(|(l, s)| (l, s.slices().to_vec())).collect(),
            }
        });
        ModelReport {
            share,
            naming: plan.naming().to_owned(),
            files: self.files.len(),
            layers: plan.layers().len(),
            experts_per_layer: plan
                .layers()
                .iter()
                .map(|l| (l.layer(), l.experts().len()))
                .collect(),
            bytes: plan
                .layers()
                .iter()
                .map(|l| (l.weight_bytes() + l.scale_bytes()) * l.experts().len() as u64)
                .sum(),
            reads: layer_reports.iter().map(|r| r.reads).sum(),
            engine_tensors: plan.engine_tensors(),
            engine_bytes: plan.engine_bytes(),
            layer_reports,
        }
    }

    /// The store's sources for one layer: each plan piece as a [`Piece`] of its open file.
    fn sources(&self, layer: &LayerPlan) -> Result<Vec<ExpertSource<'_>>> {
        layer.experts().iter().map(|e| self.source_of(e)).collect()
    }

    /// One expert's pieces as a [`Piece`] of its open file each.
    fn source_of(&self, expert: &super::ExpertPieces) -> Result<ExpertSource<'_>> {
        let piece = |p: &super::TensorPiece| -> Result<Piece<'_>> {
            let file = self.files.get(p.file()).ok_or_else(|| {
                Error::bad_value(
                    "Checkpoint::pack",
                    "a piece's file",
                    p.file(),
                    format!("the checkpoint has {} files", self.files.len()),
                )
            })?;
            let len = usize::try_from(p.len()).map_err(|_| {
                Error::overflow(
                    "Checkpoint::pack",
                    format!(
                        "{}: a piece of {} bytes as a usize",
                        file.path().display(),
                        p.len()
                    ),
                )
            })?;
            Ok(Piece::new(file.file(), p.offset(), len))
        };
        // Exact capacities: a column cut has a piece per row (collecting through
        // `Result` would grow each list by doubling, up to twice its size).
        let pieces = |list: &[super::TensorPiece]| -> Result<Vec<Piece<'_>>> {
            let mut out = Vec::with_capacity(list.len());
            for p in list {
                out.push(piece(p)?);
            }
            Ok(out)
        };
        Ok(ExpertSource::File {
            weights: pieces(expert.weights())?,
            scales: pieces(expert.scales())?,
        })
    }
}

/// One MoE layer ready to pack: its model layer number, spec and sources.
pub(crate) type PlannedLayer<'c> = (usize, LayerSpec, Vec<ExpertSource<'c>>);

/// The map budget of the whole model, before its first layer is packed
/// ([`PinStore::check_model_budget`]; a model with some layers with scales and some
/// without counted as if all had them).
pub(crate) fn check_layers_budget(store: &PinStore, layers: &[PlannedLayer<'_>]) -> Result<()> {
    if let Some((_, first, _)) = layers.first() {
        let mut widest = *first;
        widest.scale_bytes = layers
            .iter()
            .map(|(_, s, _)| s.scale_bytes)
            .max()
            .unwrap_or(0);
        store.check_model_budget(layers.len(), &widest)?;
    }
    Ok(())
}

/// Packs one planned layer (`l`: its plan, with a share's held experts).
pub(crate) fn pack_planned(
    store: &PinStore,
    (layer, spec, sources): &PlannedLayer<'_>,
    l: &LayerPlan,
) -> Result<LayerReport> {
    match l.share() {
        Some(held) => store.pack_layer_share(*layer, spec, sources, held.expert_ids()),
        None => store.pack_layer(*layer, spec, sources),
    }
}
