//! The figures of each candidate. Every layout is described the same way — where each
//! expert's bytes are ([`Place`]) and how many bytes each node holds — and one function
//! turns a description into the remote fraction, the cross-domain fraction and the
//! imbalance, so that the layouts differ only in their descriptions.

mod assign;

use super::table::{Candidate, PlanRow, PlanTable};
use super::{Machine, ModelSizes, PlanOptions};
use crate::routing::RoutingStats;
use std::collections::BTreeMap;

use crate::node::{Node, NodeSet};
use crate::store::{ExpertAssignment, Home, HotCopies, Layout, Placer, SlotOrder};

/// Where one expert's bytes are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    /// Page by page over every node.
    Interleaved,
    /// On node index `i`.
    Home(usize),
    /// A copy on every node.
    Everywhere,
    /// A copy per domain, interleaved over its nodes.
    PerDomain,
}

pub(super) struct Ctx<'a> {
    model: &'a ModelSizes,
    machine: &'a Machine,
    /// Per MoE layer: each expert's routing probability.
    probs: Vec<Vec<f64>>,
    /// Per MoE layer: the counts, where the statistics have the layer.
    counts: Vec<Option<Vec<u64>>>,
    budget: Vec<u64>,
    domains: Vec<Vec<usize>>,
    readers: Vec<usize>,
    reads: Reads,
}

/// What a byte of an expert costs its readers, averaged over the nodes with CPUs: the
/// fraction read remotely, the fraction read from another domain, the mean distance.
#[derive(Debug, Clone, Copy, Default)]
struct Sums {
    remote: f64,
    cross: f64,
    distance: f64,
}

/// [`Sums`] for each [`Place`], computed once per machine: a place's cost depends on the
/// machine only, so the figures cost O(experts) per layout, not O(experts × nodes²)
/// (a described 1024-node machine took minutes per table when summed per expert).
#[derive(Debug, Clone, Default)]
struct Reads {
    interleaved: Sums,
    everywhere: Sums,
    per_domain: Sums,
    /// Per home node index.
    home: Vec<Sums>,
}

impl Reads {
    /// Each reader `r` reads a byte of each place from: the whole set (interleaved,
    /// `1/n` of it local), its own node (a copy everywhere), its domain's copy (`1/m`
    /// local on a domain of `m` nodes), or the home node.
    fn new(machine: &Machine, domains: &[Vec<usize>], readers: &[usize]) -> Reads {
        let n = machine.nodes.len();
        let dist = |a: usize, b: usize| f64::from(machine.distances[a][b]);
        let domain = |i: usize| machine.nodes[i].domain;
        let count = readers.len().max(1) as f64;
        let sum = |f: &dyn Fn(usize) -> (f64, f64, f64)| {
            let mut s = Sums::default();
            for &r in readers {
                let (local, off_domain, mean_distance) = f(r);
                s.remote += (1.0 - local) / count;
                s.cross += off_domain / count;
                s.distance += mean_distance / count;
            }
            s
        };
        let members = |r: usize| -> &[usize] {
            domains
                .iter()
                .find(|d| d.contains(&r))
                .map_or(&[], Vec::as_slice)
        };
        let nf = n.max(1) as f64;
        Reads {
            interleaved: sum(&|r| {
                let m = members(r).len().max(1) as f64;
                (
                    1.0 / nf,
                    (nf - m) / nf,
                    (0..n).map(|j| dist(r, j)).sum::<f64>() / nf,
                )
            }),
            everywhere: sum(&|r| (1.0, 0.0, dist(r, r))),
            per_domain: sum(&|r| {
                let d = members(r);
                let m = d.len().max(1) as f64;
                (1.0 / m, 0.0, d.iter().map(|&j| dist(r, j)).sum::<f64>() / m)
            }),
            home: (0..n)
                .map(|h| {
                    sum(&|r| {
                        (
                            f64::from(u8::from(h == r)),
                            f64::from(u8::from(domain(h) != domain(r))),
                            dist(r, h),
                        )
                    })
                })
                .collect(),
        }
    }

    fn of(&self, place: Place) -> Sums {
        match place {
            Place::Interleaved => self.interleaved,
            Place::Everywhere => self.everywhere,
            Place::PerDomain => self.per_domain,
            Place::Home(h) => self.home.get(h).copied().unwrap_or_default(),
        }
    }
}

/// A layout's description: the place of each expert of each layer, and the bytes per node.
struct Described {
    places: Vec<Vec<Place>>,
    bytes: Vec<u64>,
    mappings: usize,
}

impl<'a> Ctx<'a> {
    pub(super) fn new(
        model: &'a ModelSizes,
        machine: &'a Machine,
        stats: Option<&RoutingStats>,
        options: &PlanOptions,
    ) -> Ctx<'a> {
        let counts: Vec<Option<Vec<u64>>> = model
            .moe_layers
            .iter()
            .map(|l| stats.and_then(|s| s.layer(l.layer)).map(<[u64]>::to_vec))
            .collect();
        let probs = model
            .moe_layers
            .iter()
            .zip(&counts)
            .map(|(l, c)| match c {
                Some(c) => {
                    let total: f64 = c.iter().map(|&x| x as f64).sum();
                    c.iter().map(|&x| x as f64 / total).collect()
                }
                None => vec![1.0 / l.experts.max(1) as f64; l.experts],
            })
            .collect();
        let budget = machine
            .nodes
            .iter()
            .map(|n| options.budget.unwrap_or(n.free_bytes))
            .collect();
        let readers: Vec<usize> = (0..machine.nodes.len())
            .filter(|&i| machine.nodes[i].cpus)
            .collect();
        let domains = machine.domains();
        let reads = Reads::new(machine, &domains, &readers);
        Ctx {
            model,
            machine,
            probs,
            counts,
            budget,
            domains,
            readers,
            reads,
        }
    }

    fn n(&self) -> usize {
        self.machine.nodes.len()
    }

    pub(super) fn table(&self) -> PlanTable {
        let rows = Candidate::ALL
            .iter()
            .map(|&c| self.row(c, self.describe(c)))
            .collect();
        let mut table = PlanTable {
            nodes: self.machine.nodes.iter().map(|n| n.node).collect(),
            domains: self.machine.nodes.iter().map(|n| n.domain).collect(),
            budget: self.budget.clone(),
            map_limit: self.machine.map_limit,
            statistics: self.counts.iter().any(Option::is_some),
            rows,
            recommended: None,
            why: String::new(),
        };
        table.recommend();
        table
    }

    fn describe(&self, c: Candidate) -> Described {
        let n = self.n() as u64;
        let other = self.model.other_bytes;
        let layers = &self.model.moe_layers;
        let uniform = |place: Place| layers.iter().map(|l| vec![place; l.experts]).collect();
        let even = vec![other.div_ceil(n); self.n()];
        let all = self.all_nodes();
        match c {
            Candidate::Interleave => Described {
                places: uniform(Place::Interleaved),
                ..self.arranged(even, Layout::Interleave(all), None, |_| None)
            },
            Candidate::LayerPerNode => Described {
                places: layers
                    .iter()
                    .map(|l| vec![Place::Home(l.layer % self.n()); l.experts])
                    .collect(),
                ..self.arranged(even, Layout::LayerPerNode(all), None, |_| None)
            },
            Candidate::ReplicatePerNode => Described {
                places: uniform(Place::Everywhere),
                ..self.arranged(vec![other; self.n()], Layout::Replicate(all), None, |_| {
                    None
                })
            },
            Candidate::ReplicatePerDomain => Described {
                places: uniform(Place::PerDomain),
                ..self.arranged(
                    self.domain_shares(other),
                    Layout::ReplicateDomains(all),
                    None,
                    |_| None,
                )
            },
            Candidate::SplitByIndex => self.split(
                |l| {
                    (0..l.experts)
                        .map(|e| crate::store::block_of(e, self.n(), l.experts))
                        .collect()
                },
                true,
            ),
            Candidate::SplitByLoad => self.split_by_load(),
            Candidate::Hybrid => self.hybrid(false),
            Candidate::HybridPerDomain => self.hybrid(true),
        }
    }

    /// The machine's nodes as a set (the planner's indices are their ranks in it).
    fn all_nodes(&self) -> NodeSet {
        self.machine.nodes.iter().map(|n| n.node).collect()
    }

    /// `bytes` over each domain's nodes: a copy per domain, interleaved over it.
    fn domain_shares(&self, bytes: u64) -> Vec<u64> {
        let mut out = vec![0; self.n()];
        for d in &self.domains {
            for &i in d {
                out[i] = bytes.div_ceil(d.len() as u64);
            }
        }
        out
    }

    /// The bytes per node and the mappings of every MoE layer's experts under `layout`
    /// (with a hybrid assignment's hot copies shaped `hot`, and `homes` giving a split
    /// layer's assigned homes, `None`: by index), added to `base` (the non-expert
    /// bytes per node): the store's own arithmetic
    /// ([`Placer::arrange`](crate::store::Placer)), on this described machine's domains.
    fn arranged<'h>(
        &self,
        base: Vec<u64>,
        layout: Layout,
        hot: Option<HotCopies>,
        homes: impl Fn(usize) -> Option<&'h [usize]>,
    ) -> Described {
        let ids: Vec<NodeSet> = (self.domains.iter())
            .map(|d| d.iter().map(|&i| self.machine.nodes[i].node).collect())
            .collect();
        let domains = |set: &NodeSet| ids.iter().map(|d| d.intersection(set)).collect();
        let placer = Placer::with_domains(layout, hot, domains);
        let index: BTreeMap<Node, usize> = (self.machine.nodes.iter().enumerate())
            .map(|(i, n)| (n.node, i))
            .collect();
        let mut bytes = base;
        let mut mappings = 0usize;
        let page = |b: u64| b.div_ceil(4096).saturating_mul(4096);
        for (i, l) in self.model.moe_layers.iter().enumerate() {
            let strides = [
                Some(page(l.weight_bytes)),
                (l.scale_bytes > 0).then(|| page(l.scale_bytes)),
            ];
            let order = homes(i).and_then(|h| SlotOrder::new(l.layer, h, l.experts, self.n()).ok());
            let placed = placer.arrange(l.layer, l.experts, strides, order);
            mappings = mappings.saturating_add(placed.mappings);
            for (node, b) in placed.node_bytes {
                if let Some(&at) = index.get(&node) {
                    bytes[at] = bytes[at].saturating_add(b);
                }
            }
        }
        Described {
            places: Vec::new(),
            bytes,
            mappings,
        }
    }

    /// A split layout from each layer's home nodes; non-expert bytes interleaved.
    /// `by_index`: the homes are the store's own split by index (no assignment).
    fn split(
        &self,
        homes: impl Fn(&super::MoeLayerSizes) -> Vec<usize>,
        by_index: bool,
    ) -> Described {
        let n = self.n();
        let homes: Vec<Vec<usize>> = self.model.moe_layers.iter().map(homes).collect();
        let places = (homes.iter())
            .map(|h| h.iter().map(|&i| Place::Home(i)).collect())
            .collect();
        let even = vec![self.model.other_bytes.div_ceil(n as u64); n];
        Described {
            places,
            ..self.arranged(even, Layout::SplitExperts(self.all_nodes()), None, |i| {
                homes.get(i).filter(|_| !by_index).map(Vec::as_slice)
            })
        }
    }

    fn row(&self, candidate: Candidate, d: Described) -> PlanRow {
        let n = self.n();
        let (mut remote, mut cross, mut distance, mut total) = (0.0, 0.0, 0.0, 0.0);
        let (mut hot, mut hot_traffic) = (0usize, 0.0);
        let readers = self.readers.len().max(1) as f64;
        // Per layer, the load of each node when each expert runs at home.
        let mut loads: Vec<Vec<f64>> = Vec::with_capacity(d.places.len());
        for ((l, places), probs) in self.model.moe_layers.iter().zip(&d.places).zip(&self.probs) {
            let s = l.slot_bytes() as f64;
            let mut load = vec![0.0f64; n];
            // Traffic spread evenly over every node (interleaved) or over the readers
            // (a copy each), added once per layer rather than once per expert.
            let (mut spread_nodes, mut spread_readers) = (0.0f64, 0.0f64);
            for (&place, &p) in places.iter().zip(probs) {
                let w = p * s;
                total += w;
                if matches!(place, Place::Everywhere | Place::PerDomain) {
                    hot += 1;
                    hot_traffic += w;
                }
                let sums = self.reads.of(place);
                remote += w * sums.remote;
                cross += w * sums.cross;
                distance += w * sums.distance;
                match place {
                    Place::Home(h) => load[h] += w,
                    Place::Interleaved => spread_nodes += w,
                    Place::Everywhere | Place::PerDomain => spread_readers += w,
                }
            }
            if spread_nodes > 0.0 {
                load.iter_mut().for_each(|x| *x += spread_nodes / n as f64);
            }
            if spread_readers > 0.0 {
                for &r in &self.readers {
                    load[r] += spread_readers / readers;
                }
            }
            loads.push(load);
        }
        let fits = d.bytes.iter().zip(&self.budget).all(|(b, m)| b <= m)
            && d.mappings <= self.machine.map_limit;
        let frac = |x: f64| if total > 0.0 { x / total } else { 0.0 };
        let hybrids = [
            Candidate::SplitByLoad,
            Candidate::Hybrid,
            Candidate::HybridPerDomain,
        ];
        let assignment = hybrids
            .contains(&candidate)
            .then(|| {
                self.model.moe_layers.iter().zip(&d.places).fold(
                    ExpertAssignment::new(),
                    |a, (l, places)| {
                        let homes = places
                            .iter()
                            .map(|p| match p {
                                Place::Home(h) => Home::Node(self.machine.nodes[*h].node),
                                _ => Home::Hot,
                            })
                            .collect();
                        a.layer(l.layer, homes)
                    },
                )
            })
            .map(|a| match candidate {
                Candidate::HybridPerDomain => a.hot_copies(HotCopies::PerDomain),
                _ => a,
            });
        PlanRow {
            candidate,
            assignment,
            bytes_per_node: d.bytes,
            fits,
            mappings: d.mappings,
            remote_fraction: frac(remote),
            cross_domain_fraction: frac(cross),
            mean_distance: frac(distance),
            imbalance: self.imbalance(&loads),
            hot_experts: hot,
            hot_traffic: frac(hot_traffic),
        }
    }

    /// Layers run one after another, so a layer takes as long as its most-loaded node:
    /// the sum over layers of the largest node load, over the sum of the mean loads. The
    /// mean is over the nodes that run experts (nodes with CPUs, and any home with load).
    fn imbalance(&self, loads: &[Vec<f64>]) -> f64 {
        let n = self.n();
        let running: Vec<usize> = (0..n)
            .filter(|&i| self.machine.nodes[i].cpus || loads.iter().any(|l| l[i] > 0.0))
            .collect();
        let (mut max, mut mean) = (0.0, 0.0);
        for load in loads {
            max += running.iter().map(|&i| load[i]).fold(0.0, f64::max);
            mean += running.iter().map(|&i| load[i]).sum::<f64>() / running.len().max(1) as f64;
        }
        if mean > 0.0 { max / mean } else { 1.0 }
    }
}
