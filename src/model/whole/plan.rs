//! [`PlacementPlan`]: a layout per tensor class, overrides by class and by name pattern,
//! and the text form `pin_model --plan` takes.

use std::fmt::{self, Write as _};

use super::classes::TensorClass;
use super::glob::{collapse_stars, glob_match};
use super::text::Item;
use crate::error::{Error, Result, quote};
use crate::model::{Share, TensorSlice};
use crate::node::{Node, NodeSet};
use crate::store::Layout;

/// How the tensors of a dense class (every class but the routed experts) are placed.
/// `#[non_exhaustive]`: layouts can be added.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DenseLayout {
    /// A copy on each node of the set, each bound to its node; a reader gets its own
    /// node's copy ([`TensorView::bytes`](super::TensorView::bytes)).
    Replicate(NodeSet),
    /// One copy interleaved page by page over the set.
    Interleave(NodeSet),
    /// One copy bound to the node.
    Bind(Node),
    /// One copy, no policy.
    Unplaced,
}

impl DenseLayout {
    /// The store layout that places it: a class's groups are the layers of one store.
    pub(crate) fn store_layout(self) -> Layout {
        match self {
            DenseLayout::Replicate(set) => Layout::Replicate(set),
            DenseLayout::Interleave(set) => Layout::Interleave(set),
            DenseLayout::Bind(node) => Layout::LayerPerNode(std::iter::once(node).collect()),
            DenseLayout::Unplaced => Layout::Unplaced,
        }
    }

    fn parse(text: &str) -> Result<DenseLayout> {
        let (kind, nodes) = text.split_once(':').unwrap_or((text, ""));
        let set = || NodeSet::parse(nodes);
        Ok(match kind {
            "replicate" => DenseLayout::Replicate(set()?),
            "interleave" => DenseLayout::Interleave(set()?),
            "bind" => DenseLayout::Bind(Node(crate::error::decimal::<u16>(nodes).ok_or_else(
                || {
                    Error::bad_value(
                        "PlacementPlan",
                        "bind node",
                        quote(nodes),
                        "not a node number",
                    )
                },
            )?)),
            "unplaced" if nodes.is_empty() => DenseLayout::Unplaced,
            _ => {
                return Err(Error::bad_value(
                    "PlacementPlan",
                    "dense layout",
                    quote(text),
                    "not replicate:NODES, interleave:NODES, bind:NODE or unplaced",
                ));
            }
        })
    }
}

impl std::str::FromStr for DenseLayout {
    type Err = Error;

    /// One layout in the text form [`fmt::Display`] prints: `replicate:NODES`,
    /// `interleave:NODES`, `bind:NODE`, `unplaced` (NODES in numactl syntax). Anything
    /// else, a second item included (`bind:0;experts=unplaced`), is an error.
    fn from_str(text: &str) -> Result<DenseLayout> {
        DenseLayout::parse(text.trim())
    }
}

impl fmt::Display for DenseLayout {
    /// The text form: `replicate:0-3`, `interleave:0,1`, `bind:2`, `unplaced`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DenseLayout::Replicate(set) => write!(f, "replicate:{set}"),
            DenseLayout::Interleave(set) => write!(f, "interleave:{set}"),
            DenseLayout::Bind(node) => write!(f, "bind:{}", node.0),
            DenseLayout::Unplaced => f.write_str("unplaced"),
        }
    }
}

/// The text form of an expert [`Layout`] (its `Display`): `split:NODES`,
/// `interleave:NODES`, `replicate:NODES`, `replicate-domains:NODES`,
/// `layer-per-node:NODES`, `unplaced`.
pub(crate) fn expert_layout_text(layout: &Layout) -> String {
    layout.to_string()
}

fn parse_expert_layout(text: &str) -> Result<Layout> {
    text.parse()
}

/// A layout for every tensor of a checkpoint: the routed experts keep a store
/// [`Layout`]; each dense class gets a [`DenseLayout`]; name patterns override classes
/// (the last matching pattern wins). Built with [`PlacementPlan::new`] or
/// [`Checkpoint::default_plan`](super::super::Checkpoint::default_plan), then by-value
/// setters.
///
/// # Example
/// ```
/// use numapin::model::{DenseLayout, PlacementPlan, TensorClass};
/// use numapin::store::Layout;
/// use numapin::{Node, NodeSet};
///
/// let all = NodeSet::parse("0")?;
/// let plan = PlacementPlan::new(Layout::SplitExperts(all), DenseLayout::Replicate(all))
///     .class(TensorClass::Embeddings, DenseLayout::Interleave(all))
///     .pattern("*.self_attn.*", DenseLayout::Bind(Node(0)));
/// assert_eq!(plan.layout_of(TensorClass::Embeddings), DenseLayout::Interleave(all));
/// // The same plan in the text form `pin_model --plan` takes:
/// let same = PlacementPlan::new(Layout::Unplaced, DenseLayout::Unplaced)
///     .apply("experts=split:0,dense=replicate:0,embeddings=interleave:0,*.self_attn.*=bind:0")?;
/// assert_eq!(same, plan);
/// # Ok::<(), numapin::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct PlacementPlan {
    pub(super) experts: Layout,
    /// One per class of [`TensorClass::DENSE`], in that order: the layout and why.
    pub(super) dense: Vec<(TensorClass, DenseLayout, String)>,
    pub(super) patterns: Vec<(String, DenseLayout)>,
    pub(super) experts_why: String,
    /// The routed experts this rank holds (and their slice), when it holds a share.
    pub(super) share: Option<Share>,
    /// The slice of every sliceable dense tensor this rank holds (tensor parallelism).
    pub(super) dense_slice: Option<TensorSlice>,
    /// Dense classes kept whole under a dense slice (replicated on every rank).
    pub(super) whole: Vec<TensorClass>,
    /// Per-class slices, over the dense slice and the tensor-parallel preset.
    pub(super) class_slices: Vec<(TensorClass, TensorSlice)>,
    /// Per-pattern slices, over everything else (the last matching wins).
    pub(super) slice_patterns: Vec<(String, TensorSlice)>,
    /// Rank `k` of a tensor-parallel group of `n` ([`PlacementPlan::tensor_parallel`]).
    pub(super) tp: Option<(u64, u64)>,
    /// Per-class and per-pattern dtypes ([`PlacementPlan::convert_class`]).
    pub(super) convert_classes: Vec<(TensorClass, crate::model::Dtype)>,
    pub(super) convert_patterns: Vec<(String, crate::model::Dtype)>,
}

/// The slice a dense tensor gets under a plan: the slice, whether it was asked for by
/// name (a pattern, or the preset's bias: a 1-D tensor is then cut or refused rather
/// than kept whole), and the index of the slice pattern that chose it.
pub(super) type SliceChoice = (TensorSlice, bool, Option<usize>);

/// Equal plans place the same: layouts, patterns, share (compared by its text form, as
/// a per-layer share holds a function) and slice; the reasons are not compared.
impl PartialEq for PlacementPlan {
    fn eq(&self, other: &Self) -> bool {
        let layouts = |p: &PlacementPlan| -> Vec<(TensorClass, DenseLayout)> {
            p.dense.iter().map(|(c, l, _)| (*c, *l)).collect()
        };
        self.experts == other.experts
            && layouts(self) == layouts(other)
            && self.patterns == other.patterns
            && self.share_text() == other.share_text()
            && self.class_slices == other.class_slices
            && self.slice_patterns == other.slice_patterns
            && self.convert_classes == other.convert_classes
            && self.convert_patterns == other.convert_patterns
    }
}

impl Eq for PlacementPlan {}

const CALLER: &str = "chosen by the caller";

impl PlacementPlan {
    /// Routed experts under `experts`, every dense class under `dense`.
    pub fn new(experts: Layout, dense: DenseLayout) -> PlacementPlan {
        PlacementPlan {
            experts,
            dense: TensorClass::DENSE
                .into_iter()
                .map(|c| (c, dense, CALLER.to_owned()))
                .collect(),
            patterns: Vec::new(),
            experts_why: CALLER.to_owned(),
            share: None,
            dense_slice: None,
            whole: Vec::new(),
            class_slices: Vec::new(),
            slice_patterns: Vec::new(),
            tp: None,
            convert_classes: Vec::new(),
            convert_patterns: Vec::new(),
        }
    }

    /// A rank's share of the routed experts (expert parallelism, and a slice of each
    /// expert tensor if `share` has one): only those experts are placed, under their
    /// global ids, as [`Checkpoint::pack_share`](super::super::Checkpoint::pack_share)
    /// does; the cost, the map budget and the per-node memory count the share.
    #[must_use]
    pub fn share(mut self, share: Share) -> Self {
        self.share = (!share.is_whole()).then_some(share);
        self
    }

    /// A rank's slice of the dense tensors (tensor parallelism): every tensor of at
    /// least two dimensions of a sliceable class ([`TensorClass::SLICEABLE`]: attention,
    /// dense MLP, shared experts, embeddings, output head) holds `slice`: of its rows
    /// (the outermost axis, one contiguous piece) or of its columns (the innermost axis,
    /// one strided piece per row in the file, packed back to back in the slot so that
    /// [`PlacedModel::tensor`](super::PlacedModel::tensor) hands out `[rows, len]`); 1-D
    /// tensors of those classes (biases, per-head norms) and every other class (norms
    /// and routers, unclaimed globals) are placed whole, and so are classes marked with
    /// [`PlacementPlan::whole`]. The [`TensorSlice`] rules apply: a part must divide the
    /// axis, a span must lie in it, a column cut must keep whole GGML / MXFP4 blocks, an
    /// FP8 `weight_scale_inv` grid is cut with its weight on its 128-blocks (placing errs
    /// naming the tensor and the block size). [`PlacementPlan::slice_class`],
    /// [`PlacementPlan::slice_pattern`] and [`PlacementPlan::tensor_parallel`] choose
    /// per tensor.
    #[must_use]
    pub fn dense_slice(mut self, slice: TensorSlice) -> Self {
        self.dense_slice = Some(slice);
        self
    }

    /// `class`'s tensors of at least two dimensions hold `slice` (its 1-D tensors stay
    /// whole), over [`PlacementPlan::dense_slice`] and the tensor-parallel preset.
    #[must_use]
    pub fn slice_class(mut self, class: TensorClass, slice: TensorSlice) -> Self {
        self.class_slices.retain(|(c, _)| *c != class);
        self.class_slices.push((class, slice));
        self
    }

    /// Every dense tensor whose name matches `glob` (as [`PlacementPlan::pattern`])
    /// holds `slice`, over everything else (the last matching pattern wins). Asked for
    /// by name, so a row slice cuts a 1-D tensor's entries and a column slice of a 1-D
    /// tensor is an error naming it; a pattern matching no dense tensor is an error
    /// naming the pattern.
    #[must_use]
    pub fn slice_pattern(mut self, glob: impl Into<String>, slice: TensorSlice) -> Self {
        self.slice_patterns.push((glob.into(), slice));
        self
    }

    /// Rank `k` of a tensor-parallel group of `n`, as Megatron, vLLM and SGLang split
    /// the weights (see `docs/distributed.md`): column-parallel linears (`q_proj`,
    /// `k_proj`, `v_proj`, `gate_proj`, `up_proj`, `q_b_proj`, `kv_b_proj`, GGUF
    /// `attn_q`/`attn_k`/`attn_v`/`ffn_gate`/`ffn_up`) and the vocabulary-parallel
    /// embeddings and head (`embed_tokens`, `lm_head`, `token_embd`, `output`) hold the
    /// `k`-th of `n` rows, and their biases the same entries; row-parallel linears
    /// (`o_proj`, `down_proj`, `attn_output`, `ffn_down`) the `k`-th of `n` columns,
    /// their biases whole; routed experts (when the checkpoint has them) gate and up by
    /// rows, down by columns; every other tensor whole (norms, routers, DeepSeek's
    /// `q_a_proj` / `kv_a_proj_with_mqa`, fused `qkv_proj` / `gate_up_proj`).
    /// [`PlacementPlan::whole`], [`PlacementPlan::slice_class`] and
    /// [`PlacementPlan::slice_pattern`] still override it.
    ///
    /// # Errors
    /// `n` is 0 or `k ≥ n`.
    pub fn tensor_parallel(mut self, k: u64, n: u64) -> Result<Self> {
        let share = self.share.take().unwrap_or_default();
        self.share = Some(share.tensor_parallel(k, n)?);
        self.tp = Some((k, n));
        Ok(self)
    }

    /// A tensor-parallel rank's text form, `k/n` (decimal digits, as every text form
    /// here), read into the `(k, n)` [`PlacementPlan::tensor_parallel`] takes.
    ///
    /// ```
    /// use numapin::model::PlacementPlan;
    /// assert_eq!(PlacementPlan::parse_rank("1/4")?, (1, 4));
    /// for bad in ["+1/4", "1/+4", "4/4", "1/0", "1", "1/4/2", " 1/4"] {
    ///     assert!(PlacementPlan::parse_rank(bad).is_err(), "{bad}");
    /// }
    /// # Ok::<(), numapin::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::Parse`] for text that is not `k/n`; `n` is 0 or `k ≥ n`.
    pub fn parse_rank(text: &str) -> Result<(u64, u64)> {
        let parse_error = |reason: &str| Error::Parse {
            what: "tensor-parallel rank",
            input: crate::error::clip_owned(text.to_owned(), 200),
            part: "k/n".to_owned(),
            reason: reason.to_owned(),
        };
        let (k, n) = text
            .split_once('/')
            .ok_or_else(|| parse_error("rank k of a group of n: k/n"))?;
        let number = |x: &str| {
            crate::error::decimal::<u64>(x).ok_or_else(|| parse_error("k and n are decimal digits"))
        };
        let (k, n) = (number(k)?, number(n)?);
        TensorSlice::part(crate::model::SliceAxis::Rows, k, n)?;
        Ok((k, n))
    }

    /// The slice dense tensor `name` of `class` gets (its FP8 scale grid follows it),
    /// or `None` for whole.
    pub(super) fn slice_for(&self, class: TensorClass, name: &str) -> Option<SliceChoice> {
        if let Some(i) = self
            .slice_patterns
            .iter()
            .rposition(|(p, _)| glob_match(p, name))
        {
            return Some((self.slice_patterns[i].1, true, Some(i)));
        }
        if self.whole.contains(&class) {
            return None;
        }
        if let Some((_, slice)) = self.class_slices.iter().find(|(c, _)| *c == class) {
            return Some((*slice, false, None));
        }
        if let Some((k, n)) = self.tp {
            return match super::tp::tp_cut(name) {
                super::tp::TpCut::Cut { axis, bias } => {
                    TensorSlice::part(axis, k, n).ok().map(|s| (s, bias, None))
                }
                super::tp::TpCut::Whole => None,
            };
        }
        let slice = self.dense_slice.filter(|_| self.is_sliced(class))?;
        Some((slice, false, None))
    }

    /// The tensor-parallel rank, if the preset is set.
    pub fn tensor_parallel_of(&self) -> Option<(u64, u64)> {
        self.tp
    }

    /// Keeps `class` whole (each rank places all of it) under a dense slice, a class
    /// slice and the tensor-parallel preset; a slice pattern still cuts what it names.
    #[must_use]
    pub fn whole(mut self, class: TensorClass) -> Self {
        if !self.whole.contains(&class) {
            self.whole.push(class);
        }
        self
    }

    /// Which share the plan places, in words (`None` for the whole model):
    /// `experts 0-63, slice rows:0/2; dense rows:1/2 (norms whole)`; `tp 0/2` for the
    /// tensor-parallel preset, `attention columns:0/2` per class, `*.o_proj.* rows:0/2`
    /// per pattern.
    pub fn share_text(&self) -> Option<String> {
        if self.share.is_none()
            && self.dense_slice.is_none()
            && self.tp.is_none()
            && self.class_slices.is_empty()
            && self.slice_patterns.is_empty()
        {
            return None;
        }
        let mut parts = Vec::new();
        if let Some((k, n)) = self.tp {
            parts.push(format!(
                "tp {k}/{n} (column-parallel rows, row-parallel columns, norms and routers whole)"
            ));
        }
        if let Some(share) = &self.share {
            parts.push(share.to_string());
        }
        for (class, slice) in &self.class_slices {
            parts.push(format!("{} {slice}", class.name()));
        }
        for (pattern, slice) in &self.slice_patterns {
            parts.push(format!("{pattern} {slice}"));
        }
        if let Some(slice) = &self.dense_slice {
            let whole: Vec<&str> = self.whole.iter().map(|c| c.name()).collect();
            parts.push(if whole.is_empty() {
                format!("dense {slice}")
            } else {
                format!("dense {slice} ({} whole)", whole.join(", "))
            });
        }
        Some(parts.join("; "))
    }

    /// The routed experts' share, if the plan places one.
    pub(crate) fn expert_share(&self) -> Option<&Share> {
        self.share.as_ref()
    }

    /// The dense tensors' slice, if any.
    pub fn dense_slice_of(&self) -> Option<TensorSlice> {
        self.dense_slice
    }

    /// Whether the tensors of `class` are sliced by [`PlacementPlan::dense_slice`] (a
    /// dense slice is set, the class is sliceable and not marked whole); per-class,
    /// per-pattern and preset slices are chosen per tensor over it.
    pub(crate) fn is_sliced(&self, class: TensorClass) -> bool {
        self.dense_slice.is_some()
            && TensorClass::SLICEABLE.contains(&class)
            && !self.whole.contains(&class)
    }

    /// The routed experts' layout.
    #[must_use]
    pub fn experts(mut self, layout: Layout) -> Self {
        self.experts = layout;
        self.experts_why = CALLER.to_owned();
        self
    }

    /// `class`'s layout ([`TensorClass::RoutedExperts`]: ignored, see
    /// [`PlacementPlan::experts`]).
    #[must_use]
    pub fn class(mut self, class: TensorClass, layout: DenseLayout) -> Self {
        self.set_class(class, layout, CALLER.to_owned());
        self
    }

    pub(super) fn set_class(&mut self, class: TensorClass, layout: DenseLayout, why: String) {
        if let Some(entry) = self.dense.iter_mut().find(|(c, _, _)| *c == class) {
            entry.1 = layout;
            entry.2 = why;
        }
    }

    /// Every dense tensor whose checkpoint name matches `glob` (`*`: any run of
    /// characters, dots included; `?`: one character) gets `layout`, whatever its class;
    /// a later pattern wins over an earlier one. Routed experts are not matched (their
    /// layout is the experts'). Placing a plan with a pattern that chooses no tensor is
    /// an error naming the pattern: it matches no dense tensor, or every tensor it
    /// matches is claimed by a later pattern. Any pattern can be written in the text
    /// form (quoted where it must be: see [`PlacementPlan::apply`]).
    #[must_use]
    pub fn pattern(mut self, glob: impl Into<String>, layout: DenseLayout) -> Self {
        self.patterns.push((collapse_stars(glob.into()), layout));
        self
    }

    /// The layout of the routed experts.
    pub fn experts_layout(&self) -> Layout {
        self.experts
    }

    /// The layout of `class` (before patterns); the experts' layout is not a
    /// [`DenseLayout`]: [`TensorClass::RoutedExperts`] answers [`DenseLayout::Unplaced`].
    pub fn layout_of(&self, class: TensorClass) -> DenseLayout {
        self.dense
            .iter()
            .find(|(c, _, _)| *c == class)
            .map_or(DenseLayout::Unplaced, |e| e.1)
    }

    /// Why `class` has its layout: [`Checkpoint::default_plan`]'s branch and its figures,
    /// or "chosen by the caller".
    ///
    /// [`Checkpoint::default_plan`]: super::super::Checkpoint::default_plan
    pub fn why(&self, class: TensorClass) -> &str {
        if class == TensorClass::RoutedExperts {
            return &self.experts_why;
        }
        self.dense
            .iter()
            .find(|(c, _, _)| *c == class)
            .map_or("", |e| e.2.as_str())
    }

    /// The patterns, in order.
    pub fn patterns(&self) -> &[(String, DenseLayout)] {
        &self.patterns
    }

    /// The layout of a dense tensor of `class` named `name`: the last pattern matching
    /// it, else its class's. Also the index of that pattern.
    pub(super) fn dense_layout(
        &self,
        class: TensorClass,
        name: &str,
    ) -> (DenseLayout, Option<usize>) {
        match self.patterns.iter().rposition(|(p, _)| glob_match(p, name)) {
            Some(i) => (self.patterns[i].1, Some(i)),
            None => (self.layout_of(class), None),
        }
    }

    /// Applies the text form: `KEY=VALUE` items separated by `,` or `;` (an item without
    /// `=` continues the node list of the one before: `dense=replicate:0,1`). KEY is
    /// `experts`, `dense` (every dense class), a class name ([`TensorClass::name`]), or
    /// else a name pattern; a pattern in double quotes (`"norms"=bind:0`, `""=unplaced`,
    /// `"a;b"=bind:0`, with `\\` and `\"` for a backslash and a quote) is a pattern
    /// whatever it holds, as the plan's `Display` writes every pattern that would read
    /// back as something else bare. VALUE for experts: `split:NODES`, `interleave:NODES`,
    /// `replicate:NODES`, `layer-per-node:NODES`, `unplaced`; for the others
    /// `replicate:NODES`, `interleave:NODES`, `bind:NODE`, `unplaced`. NODES in numactl
    /// syntax (`all`, `0-3`, `0,2`). VALUE `convert:DTYPE` (`norms=convert:F32`,
    /// `*.mlp.gate.weight=convert:F32`) asks for a dtype instead
    /// ([`PlacementPlan::convert_class`], [`PlacementPlan::convert_pattern`]).
    ///
    /// ```
    /// use numapin::model::{DenseLayout, PlacementPlan};
    /// use numapin::store::Layout;
    /// use numapin::Node;
    /// let plan = PlacementPlan::new(Layout::Unplaced, DenseLayout::Unplaced)
    ///     .pattern("norms", DenseLayout::Bind(Node(0)));
    /// assert!(plan.to_string().ends_with(r#";"norms"=bind:0"#));
    /// let back = PlacementPlan::new(Layout::Unplaced, DenseLayout::Unplaced).apply(&plan.to_string())?;
    /// assert_eq!(back, plan);
    /// # Ok::<(), numapin::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the item that does not parse (quoted, at most
    /// 200 bytes of it).
    pub fn apply(mut self, text: &str) -> Result<Self> {
        for item in super::text::items(text)? {
            let item = match item {
                Item::Quoted { pattern, value } => {
                    if let Some(dtype) = value.strip_prefix("convert:") {
                        self = self.apply_convert(None, Some(pattern), dtype)?;
                        continue;
                    }
                    self = self.pattern(pattern, DenseLayout::parse(&value)?);
                    continue;
                }
                Item::Bare(item) => item,
            };
            let Some((key, value)) = item.split_once('=') else {
                return Err(Error::bad_value(
                    "PlacementPlan",
                    "plan item",
                    quote(&item),
                    "not KEY=VALUE",
                ));
            };
            let (key, value) = (key.trim(), value.trim());
            if let Some(dtype) = value.strip_prefix("convert:")
                && !key.is_empty()
            {
                self = self.apply_convert(Some(key), None, dtype)?;
                continue;
            }
            match (key, TensorClass::from_name(key)) {
                ("experts", _) => self = self.experts(parse_expert_layout(value)?),
                ("dense", _) => {
                    let layout = DenseLayout::parse(value)?;
                    for class in TensorClass::DENSE {
                        self = self.class(class, layout);
                    }
                }
                (_, Some(class)) => self = self.class(class, DenseLayout::parse(value)?),
                (pattern, None) if !pattern.is_empty() => {
                    self = self.pattern(pattern, DenseLayout::parse(value)?)
                }
                _ => {
                    return Err(Error::bad_value(
                        "PlacementPlan",
                        "plan item",
                        quote(&item),
                        "an empty key (an empty pattern is written \"\")",
                    ));
                }
            }
        }
        Ok(self)
    }
}

impl fmt::Display for PlacementPlan {
    /// The text form [`PlacementPlan::apply`] reads, as the same plan: the experts' and
    /// each class's layout, then the patterns (quoted where bare they would read back as
    /// something else), then the conversions (`CLASS=convert:F32`, `PATTERN=convert:F32`).
    /// Shares and slices are not part of it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "experts={}", expert_layout_text(&self.experts))?;
        for (class, layout, _) in &self.dense {
            write!(f, ";{class}={layout}")?;
        }
        for (pattern, layout) in &self.patterns {
            f.write_char(';')?;
            super::text::write_pattern(f, pattern)?;
            write!(f, "={layout}")?;
        }
        self.write_conversions(f)
    }
}
