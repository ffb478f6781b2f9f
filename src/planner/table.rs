//! [`PlanTable`]: the planner's rows, the recommendation rule, and their text and JSON.

use std::fmt;

use crate::nodeset::Node;
use crate::store::ExpertAssignment;

/// A candidate layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
pub enum Candidate {
    /// Every expert region interleaved page by page over all nodes
    /// ([`Layout::Interleave`](crate::store::Layout::Interleave)).
    Interleave,
    /// Layer `l` bound to node `l mod n`
    /// ([`Layout::LayerPerNode`](crate::store::Layout::LayerPerNode)).
    LayerPerNode,
    /// A copy of everything on every node
    /// ([`Layout::Replicate`](crate::store::Layout::Replicate)).
    ReplicatePerNode,
    /// A copy of everything per domain (socket), interleaved over the domain's nodes
    /// ([`Layout::ReplicateDomains`](crate::store::Layout::ReplicateDomains)).
    ReplicatePerDomain,
    /// Each layer's experts in contiguous blocks, one per node
    /// ([`Layout::SplitExperts`](crate::store::Layout::SplitExperts)).
    SplitByIndex,
    /// Each layer's experts assigned to nodes balanced by routing load under the budget
    /// (by index where a layer has no statistics).
    SplitByLoad,
    /// The hottest experts (and all non-expert tensors) on every node, as many as the
    /// budget allows; the rest split by load.
    Hybrid,
    /// As [`Candidate::Hybrid`] with one copy of the hot experts (and of the non-expert
    /// tensors) per domain, interleaved over the domain's nodes
    /// ([`HotCopies::PerDomain`](crate::store::HotCopies::PerDomain)): on a machine with
    /// multi-node domains (SNC, NPS), more hot experts in the same budget, each read
    /// from the reader's socket.
    HybridPerDomain,
}

impl Candidate {
    /// Every candidate, in table order.
    pub const ALL: [Candidate; 8] = [
        Candidate::Interleave,
        Candidate::LayerPerNode,
        Candidate::ReplicatePerNode,
        Candidate::ReplicatePerDomain,
        Candidate::SplitByIndex,
        Candidate::SplitByLoad,
        Candidate::Hybrid,
        Candidate::HybridPerDomain,
    ];

    /// Its name in the table and the JSON.
    pub fn name(self) -> &'static str {
        match self {
            Candidate::Interleave => "interleave",
            Candidate::LayerPerNode => "layer-per-node",
            Candidate::ReplicatePerNode => "replicate-node",
            Candidate::ReplicatePerDomain => "replicate-domain",
            Candidate::SplitByIndex => "split-index",
            Candidate::SplitByLoad => "split-load",
            Candidate::Hybrid => "hybrid",
            Candidate::HybridPerDomain => "hybrid-domain",
        }
    }
}

/// One candidate's figures.
#[derive(Debug, Clone, PartialEq)]
pub struct PlanRow {
    /// The layout.
    pub candidate: Candidate,
    /// Bytes it puts on each node ([`PlanTable::nodes`] order): expert slots plus its
    /// share of the non-expert tensors.
    pub bytes_per_node: Vec<u64>,
    /// Whether every node's bytes fit its budget and the mappings fit the map limit.
    pub fits: bool,
    /// Mappings of the expert regions (one per region per kind, per copy, per block).
    pub mappings: usize,
    /// Expected fraction of expert bytes a token reads from another node, threads on
    /// every node with CPUs reading any expert with its routing probability.
    pub remote_fraction: f64,
    /// The part of those reads that crosses to another domain (socket).
    pub cross_domain_fraction: f64,
    /// The mean SLIT distance of those reads, local ones included (10 = all local): the
    /// kernel's relative cost of each read, weighted by bytes.
    pub mean_distance: f64,
    /// Most-loaded node over the mean, each expert running on its home node (replicated
    /// experts run where the token's thread is; interleaved ones have no home and count
    /// as even). Layers run one after another, so this is the sum over layers of each
    /// layer's most-loaded node over the sum of the layers' means.
    pub imbalance: f64,
    /// Experts with a copy on every node or domain (all of them for the replicated
    /// layouts).
    pub hot_experts: usize,
    /// Fraction of routed expert traffic (probability-weighted bytes) that goes to those.
    pub hot_traffic: f64,
    /// The experts' homes of [`Candidate::SplitByLoad`] and the hybrids.
    pub(super) assignment: Option<ExpertAssignment>,
}

impl PlanRow {
    /// What to give a store to build this row: for [`Candidate::SplitByLoad`],
    /// [`Candidate::Hybrid`] and [`Candidate::HybridPerDomain`] (whose assignment asks
    /// for [`HotCopies::PerDomain`](crate::store::HotCopies::PerDomain)), the experts'
    /// homes as node ids of the planned nodes (hot: [`Home::Hot`](crate::store::Home::Hot)), for
    /// `Layout::SplitExperts(nodes)` with `StoreOptions::assignment`; `None` for the
    /// other layouts.
    pub fn assignment(&self) -> Option<&ExpertAssignment> {
        self.assignment.as_ref()
    }
}

/// The planner's answer: a row per candidate and a recommendation.
#[derive(Debug, Clone, PartialEq)]
pub struct PlanTable {
    /// The nodes, in the order of each row's `bytes_per_node`.
    pub nodes: Vec<Node>,
    /// Each node's domain.
    pub domains: Vec<usize>,
    /// Each node's budget (its free memory, or the given budget).
    pub budget: Vec<u64>,
    /// The map limit the mappings are judged against.
    pub map_limit: usize,
    /// Whether routing statistics were used (else every expert equally likely).
    pub statistics: bool,
    /// The rows, in [`Candidate::ALL`] order.
    pub rows: Vec<PlanRow>,
    /// The recommendation (see [`PlanTable::recommended`]).
    pub recommended: Option<Candidate>,
    /// Why, in words.
    pub why: String,
}

impl PlanTable {
    /// The rule: among the layouts that fit, the least mean distance of expert reads
    /// ([`PlanRow::mean_distance`]: a read from the same socket costs less than one
    /// across sockets, as the SLIT says); ties (within 1e-9) to the least remote
    /// fraction, then the least imbalance, then the fewest bytes on the fullest node,
    /// then table order. `None` when nothing fits. With the default distances (10 local,
    /// 20 remote) this is the least remote fraction.
    pub fn recommended(&self) -> Option<Candidate> {
        self.recommended
    }

    pub(super) fn recommend(&mut self) {
        let key = |r: &PlanRow| {
            (
                (r.mean_distance * 1e9).round() as i64,
                (r.remote_fraction * 1e9).round() as i64,
                (r.imbalance * 1e9).round() as i64,
                r.bytes_per_node.iter().copied().max().unwrap_or(0),
            )
        };
        let best = self.rows.iter().filter(|r| r.fits).min_by_key(|r| key(r));
        self.recommended = best.map(|r| r.candidate);
        self.why = match best {
            None => {
                let least = self
                    .rows
                    .iter()
                    .min_by_key(|r| r.bytes_per_node.iter().copied().max().unwrap_or(0));
                match least {
                    Some(r) => format!(
                        "nothing fits: the leanest layout ({}) needs {} on its fullest node \
                         against a budget of {}{}",
                        r.candidate.name(),
                        gib(r.bytes_per_node.iter().copied().max().unwrap_or(0)),
                        gib(self.budget.iter().copied().min().unwrap_or(0)),
                        if r.mappings > self.map_limit {
                            format!(", and {} mappings against {}", r.mappings, self.map_limit)
                        } else {
                            String::new()
                        }
                    ),
                    None => "no candidates".into(),
                }
            }
            Some(b) => {
                let runner = self
                    .rows
                    .iter()
                    .filter(|r| r.fits && r.candidate != b.candidate)
                    .min_by_key(|r| key(r));
                let unfit: Vec<&str> = self
                    .rows
                    .iter()
                    .filter(|r| !r.fits)
                    .map(|r| r.candidate.name())
                    .collect();
                let mut why = format!(
                    "{} fits and its expert reads travel least (mean distance {:.2}; \
                     {:.1}% of expert bytes from other nodes, {:.1}% across domains; \
                     imbalance {:.2})",
                    b.candidate.name(),
                    b.mean_distance,
                    100.0 * b.remote_fraction,
                    100.0 * b.cross_domain_fraction,
                    b.imbalance
                );
                if let Some(r) = runner {
                    why += &format!(
                        "; next: {} (distance {:.2}, {:.1}% remote, {:.1}% across domains, \
                         imbalance {:.2})",
                        r.candidate.name(),
                        r.mean_distance,
                        100.0 * r.remote_fraction,
                        100.0 * r.cross_domain_fraction,
                        r.imbalance
                    );
                }
                if !unfit.is_empty() {
                    why += &format!("; does not fit: {}", unfit.join(", "));
                }
                why
            }
        };
    }

    /// The table as one JSON value.
    pub fn to_json(&self) -> serde_json::Value {
        use serde_json::json;
        json!({
            "nodes": self.nodes.iter().map(|n| n.0).collect::<Vec<_>>(),
            "domains": self.domains,
            "budget_bytes": self.budget,
            "map_limit": self.map_limit,
            "statistics": self.statistics,
            "rows": self.rows.iter().map(|r| json!({
                "layout": r.candidate.name(),
                "fits": r.fits,
                "bytes_per_node": r.bytes_per_node,
                "max_node_bytes": r.bytes_per_node.iter().copied().max().unwrap_or(0),
                "mappings": r.mappings,
                "remote_fraction": r.remote_fraction,
                "cross_domain_fraction": r.cross_domain_fraction,
                "mean_distance": r.mean_distance,
                "imbalance": r.imbalance,
                "hot_experts": r.hot_experts,
                "hot_traffic": r.hot_traffic,
            })).collect::<Vec<_>>(),
            "recommended": self.recommended.map(Candidate::name),
            "why": self.why,
        })
    }
}

fn gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
}

impl fmt::Display for PlanTable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{} nodes in {} domains, budget {} per node (least), map limit {}, {}",
            self.nodes.len(),
            self.domains.iter().max().map_or(0, |d| d + 1),
            gib(self.budget.iter().copied().min().unwrap_or(0)),
            self.map_limit,
            if self.statistics {
                "with routing statistics"
            } else {
                "no routing statistics (every expert equally likely)"
            }
        )?;
        writeln!(
            f,
            "{:<17} {:>4} {:>11} {:>9} {:>7} {:>8} {:>8} {:>9} {:>6} {:>6}",
            "layout",
            "fits",
            "max/node",
            "mappings",
            "remote",
            "x-domain",
            "distance",
            "imbalance",
            "hot",
            "hot%"
        )?;
        for r in &self.rows {
            writeln!(
                f,
                "{:<17} {:>4} {:>11} {:>9} {:>6.1}% {:>7.1}% {:>8.2} {:>9.2} {:>6} {:>5.1}%",
                r.candidate.name(),
                if r.fits { "yes" } else { "no" },
                gib(r.bytes_per_node.iter().copied().max().unwrap_or(0)),
                r.mappings,
                100.0 * r.remote_fraction,
                100.0 * r.cross_domain_fraction,
                r.mean_distance,
                r.imbalance,
                r.hot_experts,
                100.0 * r.hot_traffic
            )?;
        }
        write!(
            f,
            "recommended: {} — {}",
            self.recommended.map_or("none", Candidate::name),
            self.why
        )
    }
}
