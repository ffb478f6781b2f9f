//! A framework's tensor-parallel plan as a rank's share (issue 33, item 1): transformers'
//! `tp_plan` vocabulary (glob → style) read as data and turned into the slices of a
//! [`PlacementPlan`], checked against the checkpoint before anything is reserved.

use std::collections::{BTreeMap, BTreeSet};

use super::assign::{expert_tensor_indices, experts_of};
use super::glob::glob_match;
use super::plan::PlacementPlan;
use super::shape::normalized_shape;
use super::tp::expert_axis;
use crate::error::{Error, Invalid, Result, quote};
use crate::model::{Checkpoint, ExpertPlan, Naming, PieceRole, SliceAxis, TensorInfo, TensorSlice};

/// What a framework plan asks of a module's tensors, in transformers' vocabulary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum FrameworkStyle {
    /// `colwise`: rows `k/n` (the output dimension of an `[out, in]` weight; a bias its
    /// entries `k/n`).
    Colwise,
    /// `rowwise`: columns `k/n` (the input dimension); a bias whole.
    Rowwise,
    /// `embedding_rowwise`: vocabulary rows `k/n` of an embedding table.
    EmbeddingRowwise,
    /// `packed_colwise`: rows `k/n` of each packed part (gate rows then up rows).
    PackedColwise,
    /// `replicate`: whole on every rank (as a module the plan does not name).
    Replicate,
}

impl FrameworkStyle {
    /// The style transformers calls `name`, if numapin knows it.
    pub(crate) fn from_name(name: &str) -> Option<FrameworkStyle> {
        Some(match name {
            "colwise" => FrameworkStyle::Colwise,
            "rowwise" => FrameworkStyle::Rowwise,
            "embedding_rowwise" => FrameworkStyle::EmbeddingRowwise,
            "packed_colwise" => FrameworkStyle::PackedColwise,
            "replicate" => FrameworkStyle::Replicate,
            _ => return None,
        })
    }
}

/// A framework's plan: module globs (`layers.*.self_attn.q_proj`, relative to the base
/// model, `*` one layer index) and the style of each, as transformers' `tp_plan` writes
/// them. [`FrameworkPlan::share`] turns it into rank `k` of `n`'s slices: a tensor is
/// named by the longest glob that ends its module path (the name without its last
/// word, `weight` or `bias`); routed experts are held whole (expert parallelism places
/// them by `experts_held`); what no glob names is whole.
///
/// ```
/// use numapin::model::FrameworkPlan;
/// let plan = FrameworkPlan::from_json(r#"{"layers.*.self_attn.q_proj": "colwise",
///                                        "layers.*.self_attn.o_proj": "rowwise"}"#)?;
/// assert_eq!(plan.len(), 2);
/// # Ok::<(), numapin::Error>(())
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FrameworkPlan {
    /// (glob split at `.`, the style's text), in the order given.
    entries: Vec<(Vec<String>, String)>,
}

impl FrameworkPlan {
    /// An empty plan: every tensor whole.
    pub fn new() -> FrameworkPlan {
        FrameworkPlan::default()
    }

    /// Adds `glob` with the style called `style` (checked by [`FrameworkPlan::share`],
    /// which names the tensor an unknown style would apply to).
    #[must_use]
    pub fn style(mut self, glob: &str, style: &str) -> FrameworkPlan {
        let words = glob.split('.').map(str::to_owned).collect();
        self.entries.push((words, style.to_owned()));
        self
    }

    /// The plan from a JSON object of glob → style (transformers' `tp_plan`).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for text that is not a JSON object of strings.
    pub fn from_json(text: &str) -> Result<FrameworkPlan> {
        let bad =
            |why: String| Error::bad_value("FrameworkPlan::from_json", "plan", quote(text), &why);
        let value: serde_json::Value =
            serde_json::from_str(text).map_err(|e| bad(format!("not JSON: {e}")))?;
        let object = value
            .as_object()
            .ok_or_else(|| bad("not a JSON object of glob → style".to_owned()))?;
        let mut plan = FrameworkPlan::new();
        for (glob, style) in object {
            let style = style
                .as_str()
                .ok_or_else(|| bad(format!("the style of {} is not a string", quote(glob))))?;
            plan = plan.style(glob, style);
        }
        Ok(plan)
    }

    /// How many globs the plan has.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether the plan has no glob.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The entry naming module path `module` (its words): the longest glob that ends it
    /// word for word, `*` standing for one layer index.
    fn entry_of(&self, module: &[&str]) -> Option<usize> {
        self.entries
            .iter()
            .enumerate()
            .filter(|(_, entry)| {
                let glob = &entry.0;
                glob.len() <= module.len()
                    && glob
                        .iter()
                        .zip(&module[module.len() - glob.len()..])
                        .all(|(g, m)| {
                            g == m
                                || (g == "*"
                                    && !m.is_empty()
                                    && m.bytes().all(|b| b.is_ascii_digit()))
                        })
            })
            .max_by_key(|(_, entry)| entry.0.len())
            .map(|(i, _)| i)
    }

    /// `plan` with rank `rank` of `ranks`'s share under this framework plan: each dense
    /// tensor a cutting style names holds its part (a slice pattern naming it), every
    /// other tensor whole; routed experts whole. Under an expert share (EP) the plan's
    /// styles for routed experts are ignored (EP's `grouped_gemm`, `ep_router`, ...: the
    /// held experts are whole); without one, cutting styles on the routed experts are
    /// tensor parallelism of every expert (transformers' `tp_size=n` alone: gate and up
    /// `colwise` / `packed_colwise`, rows k/n of each; down `rowwise`, columns k/n), the
    /// preset's per-role axes ([`crate::model::Share::tensor_parallel`]): every routed
    /// expert tensor cut so, or refused. An FP8 scale grid follows its weight.
    ///
    /// # Errors
    /// All before anything is reserved, each naming the tensor: a style numapin does not
    /// know; `packed_colwise` on a dense tensor (numapin cannot cut it by packed part); a
    /// routed expert's tensor cut on another axis than its role's, or only some of them; a
    /// fused gate_up cut otherwise than `packed_colwise`, or stored otherwise than gate
    /// rows then up rows; a cut whose axis `ranks` does not divide (a fused gate_up's rows
    /// into 2 halves of `ranks` parts); a cut of an attention projection whose
    /// heads (config.json's `num_attention_heads`, `num_key_value_heads` for `k_proj` /
    /// `v_proj`) `ranks` does not divide (fewer heads than ranks would split a head); a
    /// glob that names no tensor with an unknown style. `rank ≥ ranks` or `ranks` 0.
    /// Each is an [`Invalid::BadValue`]: `what` is `"framework plan style"` for a style
    /// refused on a tensor, `"rank count"` for an axis or heads `ranks` does not divide,
    /// `"framework plan"` for a routed expert's tensor left uncut among cut ones.
    pub fn share(
        &self,
        checkpoint: &Checkpoint,
        mut plan: PlacementPlan,
        rank: u64,
        ranks: u64,
    ) -> Result<PlacementPlan> {
        TensorSlice::part(SliceAxis::Rows, rank, ranks)?;
        let experts = experts_of(checkpoint)?;
        let expert_tensors = expert_tensor_indices(experts.as_ref());
        let roles = canonical_roles(experts.as_ref());
        let held_whole = plan.expert_share().is_some_and(|s| !s.experts.is_all());
        let mut used = BTreeSet::new();
        let mut cuts: Vec<(&str, TensorSlice)> = Vec::new();
        let mut expert_cuts = BTreeSet::new();
        for (index, t) in checkpoint.tensors().iter().enumerate() {
            let name = t.name();
            let words: Vec<&str> = name.split('.').collect();
            let Some((last, module)) = words.split_last() else {
                continue;
            };
            // A scale grid is cut with its weight (the plan's own rule).
            if last.contains("scale") {
                continue;
            }
            let Some(at) = self.entry_of(module).or_else(|| self.entry_of(&words)) else {
                continue;
            };
            used.insert(at);
            // Under an expert share (EP) the held experts are whole whatever the plan
            // says of them: EP's own styles (transformers' `grouped_gemm`, ...) are
            // about the engine's kernels, not the bytes a rank holds.
            if held_whole && expert_tensors.contains(&index) {
                continue;
            }
            if expert_tensors.contains(&index) {
                let role = roles.get(&index).map(String::as_str);
                if self.cuts_expert(t, (module, role), at, ranks)? {
                    expert_cuts.insert(index);
                }
                continue;
            }
            if let Some(axis) = self.axis_of(checkpoint, t, module, at, ranks)? {
                cuts.push((name, TensorSlice::part(axis, rank, ranks)?));
            }
        }
        self.check_unused(&used)?;
        if !expert_cuts.is_empty() {
            check_every_expert_cut(checkpoint, &expert_tensors, &expert_cuts)?;
            let share = plan.share.take().unwrap_or_default();
            plan.share = Some(share.tensor_parallel(rank, ranks)?);
        }
        for (glob, slice) in patterns(checkpoint, &cuts) {
            plan = plan.slice_pattern(glob, slice);
        }
        Ok(plan)
    }

    /// The axis entry `at`'s style cuts tensor `t` (of `module`) along for `ranks` ranks;
    /// `None` when it stays whole (replicated, a row-parallel layer's bias). Refused: an
    /// unknown style, a packed cut, an axis `ranks` does not divide, a cut through an
    /// attention head.
    fn axis_of(
        &self,
        checkpoint: &Checkpoint,
        t: &TensorInfo,
        module: &[&str],
        at: usize,
        ranks: u64,
    ) -> Result<Option<SliceAxis>> {
        let (glob, style_name) = &self.entries[at];
        let named = || format!("{} ({}: {})", quote(t.name()), glob.join("."), style_name);
        let Some(style) = FrameworkStyle::from_name(style_name) else {
            return Err(unknown_style(style_name, named()));
        };
        if style == FrameworkStyle::Replicate {
            return Ok(None);
        }
        if style == FrameworkStyle::PackedColwise {
            return Err(Error::bad_value(
                SHARE,
                "framework plan style",
                quote(style_name),
                format!(
                    "{}: numapin cannot yet cut a dense tensor by packed part",
                    named()
                ),
            ));
        }
        let shape = normalized_shape(t);
        let axis = match (style, shape.len()) {
            // A row-parallel layer's bias is added once, after the reduction: whole.
            (FrameworkStyle::Rowwise, 0 | 1) => return Ok(None),
            (FrameworkStyle::Rowwise, _) => SliceAxis::Columns,
            _ => SliceAxis::Rows,
        };
        let extent = match axis {
            SliceAxis::Rows => shape.first(),
            SliceAxis::Columns => shape.last(),
        }
        .copied()
        .unwrap_or(1);
        if extent % ranks != 0 {
            return Err(indivisible(named(), axis, extent, ranks));
        }
        check_heads(checkpoint, module, ranks, &named)?;
        Ok(Some(axis))
    }

    /// Whether entry `at`'s style cuts routed expert tensor `t` (tensor parallelism of
    /// every expert: gate and up by rows, down by columns, a fused gate_up by rows of
    /// each half); `false` when it replicates. `role`: the naming's canonical role of
    /// `t`, when it has one. Refused: an unknown style, a style or axis that is not the
    /// role's, an axis `ranks` does not divide.
    fn cuts_expert(
        &self,
        t: &TensorInfo,
        (module, role): (&[&str], Option<&str>),
        at: usize,
        ranks: u64,
    ) -> Result<bool> {
        let (glob, style_name) = &self.entries[at];
        let named = || format!("{} ({}: {})", quote(t.name()), glob.join("."), style_name);
        let Some(style) = FrameworkStyle::from_name(style_name) else {
            return Err(unknown_style(style_name, named()));
        };
        if style == FrameworkStyle::Replicate {
            return Ok(false);
        }
        expert_cut(t, (module, role), (style, style_name), ranks, &named)?;
        Ok(true)
    }

    /// Refuses an entry that named no tensor when its style is unknown too (a typo in
    /// both is otherwise silent).
    fn check_unused(&self, used: &BTreeSet<usize>) -> Result<()> {
        let unknown = self.entries.iter().enumerate().find(|(i, (_, style))| {
            !used.contains(i) && FrameworkStyle::from_name(style).is_none()
        });
        match unknown {
            Some((_, (glob, style))) => Err(unknown_style(
                style,
                format!("{} names no tensor", quote(&glob.join("."))),
            )),
            None => Ok(()),
        }
    }
}

const SHARE: &str = "FrameworkPlan::share";

/// A style numapin does not know, typed: the style and what named it.
fn unknown_style(style: &str, named: String) -> Error {
    Error::invalid_because(
        SHARE,
        Invalid::BadValue {
            what: "framework plan style",
            value: quote(style),
            why: format!(
                "{named}: numapin knows colwise, rowwise, embedding_rowwise, packed_colwise, \
                 replicate"
            ),
        },
    )
}

/// Each routed expert weight tensor's canonical role (`gate`, `up`, `gate_up`, `down`),
/// by tensor index.
fn canonical_roles(experts: Option<&(Naming, ExpertPlan)>) -> BTreeMap<usize, String> {
    let mut out = BTreeMap::new();
    for layer in experts.iter().flat_map(|(_, p)| p.layers()) {
        let canonical: Vec<&String> = layer
            .roles
            .iter()
            .zip(&layer.canonical)
            .filter(|((r, _), _)| *r == PieceRole::Weight)
            .map(|(_, c)| c)
            .collect();
        for expert in layer.experts() {
            for (p, c) in expert.weights().iter().zip(&canonical) {
                out.insert(p.tensor(), (*c).clone());
            }
        }
    }
    out
}

/// Checks a fused gate_up's cut: `packed_colwise` only (rows `k/n` of each half, as
/// transformers holds it), its rows (`[…, 2I, H]`) dividing into 2 halves of `ranks`
/// parts. Whether the layer stores gate rows then up rows is the slicer's check.
fn packed_cut(
    t: &TensorInfo,
    (style, style_name): (FrameworkStyle, &str),
    ranks: u64,
    named: &dyn Fn() -> String,
) -> Result<()> {
    if style != FrameworkStyle::PackedColwise {
        return Err(Error::bad_value(
            SHARE,
            "framework plan style",
            quote(style_name),
            format!(
                "{}: a fused gate_up (gate rows then up rows) is cut by packed_colwise, rows \
                 k/n of each half; another cut would mix gate and up rows",
                named()
            ),
        ));
    }
    let shape = normalized_shape(t);
    let rows = shape.len().checked_sub(2).map_or(1, |i| shape[i]);
    if !rows.is_multiple_of(ranks.saturating_mul(2)) {
        return Err(Error::bad_value(
            SHARE,
            "rank count",
            ranks,
            format!(
                "{}: the rows of {rows} do not divide into 2 packed halves of {ranks} ranks",
                named()
            ),
        ));
    }
    Ok(())
}

/// Checks a cutting style on a routed expert's tensor against the per-role axis numapin
/// cuts it by (gate and up rows, down columns: [`expert_axis`]; a fused gate_up
/// [`packed_cut`]); 1 when it agrees.
fn expert_cut(
    t: &TensorInfo,
    (module, canonical): (&[&str], Option<&str>),
    (style, style_name): (FrameworkStyle, &str),
    ranks: u64,
    named: &dyn Fn() -> String,
) -> Result<()> {
    let refused = |why: String| {
        Error::bad_value(
            SHARE,
            "framework plan style",
            quote(style_name),
            format!("{}: {why}", named()),
        )
    };
    let want = match style {
        FrameworkStyle::Colwise | FrameworkStyle::PackedColwise => SliceAxis::Rows,
        FrameworkStyle::Rowwise => SliceAxis::Columns,
        _ => {
            return Err(refused(
                "a routed expert's tensor cannot be cut so".to_owned(),
            ));
        }
    };
    let role = module.last().copied().unwrap_or_default();
    if canonical == Some("gate_up") {
        return packed_cut(t, (style, style_name), ranks, named);
    }
    let axis = expert_axis(role).or_else(|| canonical.and_then(expert_axis));
    if axis != Some(want) {
        return Err(refused(format!(
            "a routed expert's {} cut by {}; numapin cuts an expert's gate and up by rows, \
             its down by columns",
            quote(role),
            axis_name(want)
        )));
    }
    let shape = normalized_shape(t);
    let extent = match want {
        SliceAxis::Rows => shape.first(),
        SliceAxis::Columns => shape.last(),
    }
    .copied()
    .unwrap_or(1);
    if extent % ranks != 0 {
        return Err(indivisible(named(), want, extent, ranks));
    }
    Ok(())
}

/// Refuses a plan that cuts some routed expert tensors and not others: numapin's
/// tensor parallelism of the experts cuts every expert's gate, up and down, or none.
fn check_every_expert_cut(
    checkpoint: &Checkpoint,
    expert_tensors: &BTreeSet<usize>,
    expert_cuts: &BTreeSet<usize>,
) -> Result<()> {
    let uncut = checkpoint.tensors().iter().enumerate().find(|(i, t)| {
        expert_tensors.contains(i) && !expert_cuts.contains(i) && !t.name().contains("scale")
    });
    match uncut {
        Some((_, t)) => Err(Error::bad_value(
            SHARE,
            "framework plan",
            quote(t.name()),
            format!(
                "a routed expert's tensor the plan does not cut, where it cuts {} others: \
                 numapin cuts every routed expert's gate, up and down or none (hold them \
                 whole with experts_held=)",
                expert_cuts.len()
            ),
        )),
        None => Ok(()),
    }
}

/// An axis of `extent` that `ranks` does not divide, typed ([`Invalid::BadValue`], what
/// `"rank count"`): the tensor and rule (`named`), the axis and its extent.
fn indivisible(named: String, axis: SliceAxis, extent: u64, ranks: u64) -> Error {
    Error::bad_value(
        SHARE,
        "rank count",
        ranks,
        format!(
            "{named}: {} of {extent} do not divide into {ranks} ranks",
            axis_name(axis)
        ),
    )
}

fn axis_name(axis: SliceAxis) -> &'static str {
    match axis {
        SliceAxis::Rows => "the rows",
        SliceAxis::Columns => "the columns",
    }
}

/// Refuses a cut of an attention projection that would split a head: `ranks` must
/// divide the heads it holds (KV heads for `k_proj` / `v_proj`).
fn check_heads(
    checkpoint: &Checkpoint,
    module: &[&str],
    ranks: u64,
    named: &dyn Fn() -> String,
) -> Result<()> {
    let Some((attention, kv)) = checkpoint.attention_heads() else {
        return Ok(());
    };
    let Some(&proj) = module.last() else {
        return Ok(());
    };
    let in_attention = module
        .iter()
        .any(|w| w.contains("attn") || w.contains("attention"));
    let (heads, what) = match proj {
        "k_proj" | "v_proj" | "kv_proj" | "wk" | "wv" => (kv, "num_key_value_heads"),
        "q_proj" | "o_proj" | "qkv_proj" | "wq" | "wo" | "out_proj" if in_attention => {
            (attention, "num_attention_heads")
        }
        _ => return Ok(()),
    };
    if heads % ranks != 0 {
        return Err(Error::bad_value(
            SHARE,
            "rank count",
            ranks,
            format!(
                "{}: {ranks} ranks would split an attention head ({what} = {heads} in \
                 config.json)",
                named()
            ),
        ));
    }
    Ok(())
}

/// A slice pattern matching `name` alone: the plan's globs read `*` and `?`, which a
/// tensor name may hold; `?` matches either.
fn exact_glob(name: &str) -> String {
    name.replace(['*', '?'], "?")
}

/// The cuts as slice patterns, few enough for the share's text to read one per module:
/// a tensor's name with each layer index as `*` (`model.layers.*.self_attn.q_proj.weight`)
/// where that pattern matches exactly the tensors holding the same slice under it, else
/// each tensor's own name.
fn patterns(checkpoint: &Checkpoint, cuts: &[(&str, TensorSlice)]) -> Vec<(String, TensorSlice)> {
    let general = |name: &str| {
        name.split('.')
            .map(|w| {
                if !w.is_empty() && w.bytes().all(|b| b.is_ascii_digit()) {
                    "*".to_owned()
                } else {
                    exact_glob(w)
                }
            })
            .collect::<Vec<_>>()
            .join(".")
    };
    let mut groups: Vec<(String, TensorSlice, BTreeSet<&str>)> = Vec::new();
    for &(name, slice) in cuts {
        let glob = general(name);
        match groups.iter_mut().find(|g| g.0 == glob && g.1 == slice) {
            Some(g) => {
                g.2.insert(name);
            }
            None => groups.push((glob, slice, BTreeSet::from([name]))),
        }
    }
    let mut out = Vec::new();
    for (glob, slice, members) in groups {
        let exact = checkpoint
            .tensors()
            .iter()
            .filter(|t| glob_match(&glob, t.name()))
            .all(|t| members.contains(t.name()));
        if exact {
            out.push((glob, slice));
        } else {
            out.extend(members.into_iter().map(|n| (exact_glob(n), slice)));
        }
    }
    out
}
