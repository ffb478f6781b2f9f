//! [`Layout`]: how a store places its layers, and every decision that follows from it —
//! the policy of each region, the copies and the blocks a layer becomes, the node an
//! expert is bound to, the mappings a region costs, where loader threads run. The rest of
//! the store asks these methods and never matches a layout itself, so adding a layout
//! touches this file, its tests and the docs.

use std::fmt;
use std::ops::Range;

use crate::error::{Error, Result};
use crate::node::{Node, NodeContext, NodeSet};
use crate::policy::MemPolicy;

mod placing;
#[cfg(test)]
pub(crate) use placing::ARRANGED;
pub(crate) use placing::{LayerPlacement, Placer};

/// How layers are placed. `#[non_exhaustive]`: layouts are added (a match on one needs
/// a `_` arm outside the crate).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Layout {
    /// Every region interleaved page by page over the set: every core reads every
    /// layer, so spread the bandwidth.
    Interleave(NodeSet),
    /// Layer `i` bound to the `i mod n`-th node of the set.
    LayerPerNode(NodeSet),
    /// A copy of every layer on each node of the set, each bound (`MPOL_BIND`) to its
    /// node: a thread reads its own node's copy
    /// ([`PinStore::weights_local`](super::PinStore::weights_local)). Costs nodes × the
    /// memory and nodes × the mappings; the file is read once, into the first node's copy,
    /// and the others are copied from it. Where placement is denied or unsupported, one
    /// unplaced copy is built.
    Replicate(NodeSet),
    /// A copy of every layer per domain (socket, see
    /// [`Topology::domains`](crate::topology::Topology::domains)) among the set's nodes,
    /// each interleaved over the domain's nodes of the set (bound to the node where the
    /// domain has one there): with sub-NUMA clustering, a copy per socket instead of 2–4
    /// per socket. [`PinStore::weights_local`](super::PinStore::weights_local) reads the
    /// calling thread's domain's copy (a thread in a domain without one: the copy of the
    /// set's node nearest to its node). Costs domains × the memory and the mappings; the
    /// file is read once, as for [`Layout::Replicate`], and each domain's nodes need a
    /// share of a copy (the copy ÷ the domain's nodes in the set). The domains are read
    /// once, when the store is made.
    ReplicateDomains(NodeSet),
    /// The experts of each layer in contiguous blocks, one per node of the set (expert
    /// `e` of `E` on the `e × n / E`-th node), each block bound to its node:
    /// [`PinStore::home_node`](super::PinStore::home_node) says where an expert lives. Up
    /// to n mappings per region.
    SplitExperts(NodeSet),
    /// No binding at all: the baseline, and what a denied container gets anyway.
    Unplaced,
}

impl Layout {
    /// The node set the layout places over (`None` for [`Layout::Unplaced`]).
    pub fn nodes(&self) -> Option<NodeSet> {
        match *self {
            Layout::Interleave(set)
            | Layout::LayerPerNode(set)
            | Layout::Replicate(set)
            | Layout::ReplicateDomains(set)
            | Layout::SplitExperts(set) => Some(set),
            Layout::Unplaced => None,
        }
    }

    /// Checks what a store needs of the layout: a non-empty set. (Shared arenas take
    /// every layout: a replicated store exports whole through `PlacedModel::export`.)
    pub(super) fn check(&self, _shared: bool) -> Result<()> {
        if self.nodes().is_some_and(|set| set.is_empty()) {
            return Err(Error::empty("PinStore::new", format!("nodes in {self:?}")));
        }
        Ok(())
    }

    /// The policy each region of layer `layer` is bound with once (`None`: unplaced, or
    /// bound block by block, see [`Layout::blocks`]); for the replicating layouts, the
    /// first copy's, on the first of `copies` ([`Layout::copy_groups`]).
    pub(super) fn region_policy(&self, layer: usize, copies: &[NodeSet]) -> Option<MemPolicy> {
        let bind = |node: Option<Node>| node.map(|n| MemPolicy::Bind(std::iter::once(n).collect()));
        match *self {
            Layout::Interleave(set) => Some(MemPolicy::Interleave(set)),
            Layout::LayerPerNode(set) => bind(set.nth(layer % set.len())),
            Layout::Replicate(_) | Layout::ReplicateDomains(_) => copies.first().map(copy_policy),
            Layout::SplitExperts(_) | Layout::Unplaced => None,
        }
    }

    /// Whether the layout makes a copy of every layer per node or per domain.
    #[cfg(test)]
    pub(super) fn replicates(&self) -> bool {
        matches!(self, Layout::Replicate(_) | Layout::ReplicateDomains(_))
    }

    /// The nodes each copy of a layer lives on, the first copy's first, in the order of
    /// their lowest node: one node per copy for [`Layout::Replicate`], the set's nodes of
    /// each domain for [`Layout::ReplicateDomains`] (`domains` groups a set by domain,
    /// [`Topology::domains_within`](crate::topology::Topology::domains_within) on the live
    /// machine; called only for that layout). Empty for the layouts that make one copy.
    ///
    /// # Errors
    /// As `domains`.
    pub(super) fn copy_groups(
        &self,
        domains: impl FnOnce(&NodeSet) -> Result<Vec<NodeSet>>,
    ) -> Result<Vec<NodeSet>> {
        Ok(match *self {
            Layout::Replicate(set) => set.iter().map(|n| std::iter::once(n).collect()).collect(),
            Layout::ReplicateDomains(set) => {
                let mut groups: Vec<NodeSet> = domains(&set)?
                    .into_iter()
                    .filter(|g| !g.is_empty())
                    .collect();
                groups.sort_by_key(|g| g.nth(0));
                groups
            }
            Layout::Interleave(_)
            | Layout::LayerPerNode(_)
            | Layout::SplitExperts(_)
            | Layout::Unplaced => Vec::new(),
        })
    }

    /// The nodes whose blocks a region is bound to one by one ([`Layout::SplitExperts`]).
    pub(super) fn blocks(&self) -> Option<NodeSet> {
        match *self {
            Layout::SplitExperts(set) => Some(set),
            Layout::Interleave(_)
            | Layout::LayerPerNode(_)
            | Layout::Replicate(_)
            | Layout::ReplicateDomains(_)
            | Layout::Unplaced => None,
        }
    }

    /// The node the layout binds `expert` of `layer` (of `experts`) to, if one (the first
    /// copy's for [`Layout::Replicate`]; for [`Layout::ReplicateDomains`] the first node of
    /// the first copy's domain, whose CPUs are as near that copy as any).
    pub(super) fn target_node(&self, layer: usize, experts: usize, expert: usize) -> Option<Node> {
        match *self {
            Layout::SplitExperts(set) => set.nth(block_of(expert, set.len(), experts)),
            Layout::LayerPerNode(set) => set.nth(layer % set.len()),
            Layout::Replicate(set) | Layout::ReplicateDomains(set) => set.nth(0),
            Layout::Interleave(_) | Layout::Unplaced => None,
        }
    }

    /// Whether an expert has one home node ([`Layout::Replicate`]'s experts live on every
    /// node of the set).
    pub(super) fn has_home(&self) -> bool {
        match *self {
            Layout::Replicate(_) | Layout::ReplicateDomains(_) => false,
            Layout::Interleave(_)
            | Layout::LayerPerNode(_)
            | Layout::SplitExperts(_)
            | Layout::Unplaced => true,
        }
    }

    /// The nodes loader threads spread over when the memory they fill has no single node
    /// ([`Layout::Interleave`]: each node's share of the writes then comes from nearby
    /// CPUs). Empty: each loader runs on its slot's target node, or anywhere.
    pub(super) fn loader_spread(&self) -> NodeSet {
        match *self {
            Layout::Interleave(set) => set,
            Layout::LayerPerNode(_)
            | Layout::Replicate(_)
            | Layout::ReplicateDomains(_)
            | Layout::SplitExperts(_)
            | Layout::Unplaced => NodeSet::new(),
        }
    }
}

/// The policy of a copy on `group` (one of [`Layout::copy_groups`]): bound to its node,
/// or interleaved over a domain's nodes.
pub(super) fn copy_policy(group: &NodeSet) -> MemPolicy {
    if group.len() == 1 {
        MemPolicy::Bind(*group)
    } else {
        MemPolicy::Interleave(*group)
    }
}

/// A layout over a node set, from the set.
type MakeLayout = fn(NodeSet) -> Layout;

/// Each layout's name in the short string form (`interleave:0-3`), and how a node set
/// becomes the layout (`None`: the layout takes no node set). A new layout adds a line
/// here and an arm in [`Layout::name`].
const NAMES: [(&str, Option<MakeLayout>); 6] = [
    ("interleave", Some(Layout::Interleave)),
    ("layer-per-node", Some(Layout::LayerPerNode)),
    ("replicate", Some(Layout::Replicate)),
    ("replicate-domains", Some(Layout::ReplicateDomains)),
    ("split", Some(Layout::SplitExperts)),
    ("unplaced", None),
];

impl Layout {
    /// The layout's name in the short string form: `interleave`, `layer-per-node`,
    /// `replicate`, `replicate-domains`, `split`, `unplaced`.
    pub fn name(&self) -> &'static str {
        match self {
            Layout::Interleave(_) => "interleave",
            Layout::LayerPerNode(_) => "layer-per-node",
            Layout::Replicate(_) => "replicate",
            Layout::ReplicateDomains(_) => "replicate-domains",
            Layout::SplitExperts(_) => "split",
            Layout::Unplaced => "unplaced",
        }
    }

    /// Parses the short string form, `name[:nodes]`: `interleave:0-3`,
    /// `layer-per-node:all`, `replicate:all`, `split:0,2`, `unplaced`; the node set in
    /// numactl's syntax ([`NodeSet::parse_in`], against `ctx`).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] ([`Invalid::BadValue`](crate::error::Invalid)) for an
    /// unknown name, a missing node set, or a node set after `unplaced`; the node
    /// string's [`Error::Parse`].
    pub fn parse_in(input: &str, ctx: &NodeContext) -> Result<Layout> {
        Layout::parse_with(input, |nodes| NodeSet::parse_in(nodes, ctx))
    }

    fn parse_with(input: &str, nodes: impl FnOnce(&str) -> Result<NodeSet>) -> Result<Layout> {
        let bad = |why: &str| {
            Error::bad_value(
                "Layout::from_str",
                "layout",
                crate::error::quote(input),
                why,
            )
        };
        let (name, list) = match input.split_once(':') {
            Some((name, list)) => (name.trim(), Some(list)),
            None => (input.trim(), None),
        };
        let Some(&(_, make)) = NAMES.iter().find(|(n, _)| *n == name) else {
            return Err(bad(
                "unknown layout (expected interleave, layer-per-node, replicate, \
                 replicate-domains, split or unplaced)",
            ));
        };
        match (make, list) {
            (Some(make), Some(list)) => Ok(make(nodes(list)?)),
            (Some(_), None) => Err(bad("this layout needs a node set after ':' (e.g. all)")),
            (None, None) => Ok(Layout::Unplaced),
            (None, Some(_)) => Err(bad("unplaced takes no node set")),
        }
    }
}

impl fmt::Display for Layout {
    /// The short string form [`Layout::parse_in`] reads: `interleave:0-3`, `unplaced`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.nodes() {
            Some(set) => write!(f, "{}:{set}", self.name()),
            None => f.write_str(self.name()),
        }
    }
}

impl std::str::FromStr for Layout {
    type Err = Error;

    /// [`Layout::parse_in`] against this process's topology ([`NodeContext::current`]):
    /// `"split:all".parse::<Layout>()`.
    fn from_str(input: &str) -> Result<Layout> {
        Layout::parse_in(input, &NodeContext::current()?)
    }
}

/// The experts of node `i` of `n` when `experts` are split in contiguous blocks (expert
/// `e` on node `e × n / experts`).
pub(crate) fn block(i: usize, n: usize, experts: usize) -> Range<usize> {
    let start = |i: usize| (i as u128 * experts as u128).div_ceil(n.max(1) as u128) as usize;
    start(i)..start(i + 1)
}

/// The index (among `n` nodes) of expert `e`'s block.
pub(crate) fn block_of(e: usize, n: usize, experts: usize) -> usize {
    (e as u128 * n as u128 / experts.max(1) as u128) as usize
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nodeset::MAX_NODES;
    use proptest::prelude::*;

    fn set(ids: &[usize]) -> NodeSet {
        NodeSet::from_nodes(ids.iter().copied()).unwrap()
    }

    #[test]
    fn blocks_are_contiguous_and_agree_with_the_formula() {
        for (n, experts) in [(3, 16), (2, 5), (4, 3), (1, 7), (3, 3)] {
            let mut next = 0;
            for i in 0..n {
                let b = block(i, n, experts);
                assert_eq!(b.start, next, "n={n} experts={experts} i={i}");
                for e in b.clone() {
                    assert_eq!(block_of(e, n, experts), i, "expert {e}");
                }
                next = b.end;
            }
            assert_eq!(next, experts);
        }
        // 16 experts over 3 nodes: 6, 5, 5.
        assert_eq!(
            (0..3).map(|i| block(i, 3, 16).len()).collect::<Vec<_>>(),
            vec![6, 5, 5]
        );
    }

    #[test]
    fn every_layout_answers_every_decision() {
        let nodes = set(&[1, 3, 5]);
        let bind = |n: u16| Some(MemPolicy::Bind(std::iter::once(Node(n)).collect()));
        // (layout, policy of layer 4, copies, maps per region of 16 experts, node of
        // expert 15 of 16 in layer 4, one home, loader spread)
        let cases = [
            (
                Layout::Interleave(nodes),
                Some(MemPolicy::Interleave(nodes)),
                1,
                1,
                None,
                true,
                nodes,
            ),
            (
                Layout::LayerPerNode(nodes),
                bind(3),
                1,
                1,
                Some(Node(3)),
                true,
                NodeSet::new(),
            ),
            (
                Layout::Replicate(nodes),
                bind(1),
                3,
                1,
                Some(Node(1)),
                false,
                NodeSet::new(),
            ),
            (
                Layout::ReplicateDomains(nodes),
                Some(MemPolicy::Interleave(set(&[1, 3]))),
                2,
                1,
                Some(Node(1)),
                false,
                NodeSet::new(),
            ),
            (
                Layout::SplitExperts(nodes),
                None,
                1,
                3,
                Some(Node(5)),
                true,
                NodeSet::new(),
            ),
            (Layout::Unplaced, None, 1, 1, None, true, NodeSet::new()),
        ];
        // The domains of the machine these cases assume: nodes 1 and 3 on one socket, 5
        // on another.
        let domains = |s: &NodeSet| {
            Ok(vec![
                set(&[5]).intersection(s),
                set(&[1, 3]).intersection(s),
            ])
        };
        for (layout, policy, copies, maps, node, home, spread) in cases {
            let groups = layout.copy_groups(domains).unwrap();
            assert_eq!(layout.region_policy(4, &groups), policy, "{layout:?}");
            assert_eq!(groups.len().max(1), copies, "{layout:?}");
            assert_eq!(layout.replicates(), !groups.is_empty(), "{layout:?}");
            // Mappings per region, as the one arithmetic counts them (one region per copy).
            let placer = Placer::with_domains(layout, None, |s| domains(s).unwrap());
            let placed = placer.arrange(4, 16, [Some(1), None], None);
            assert_eq!(placed.mappings, maps * copies, "{layout:?}");
            assert_eq!(layout.target_node(4, 16, 15), node, "{layout:?}");
            assert_eq!(layout.has_home(), home, "{layout:?}");
            assert_eq!(layout.loader_spread(), spread, "{layout:?}");
            assert!(layout.check(false).is_ok(), "{layout:?}");
            // Shared arenas take every layout (replicas export with PlacedModel::export).
            assert!(layout.check(true).is_ok(), "{layout:?}");
        }
        // Fewer experts than nodes: a block per expert, no empty blocks mapped.
        let split = Placer::with_domains(Layout::SplitExperts(nodes), None, |_| Vec::new());
        assert_eq!(split.arrange(0, 2, [Some(1), None], None).mappings, 2);
        assert_eq!(split.arrange(0, 0, [Some(1), None], None).mappings, 1);
        for empty in [
            Layout::Interleave(NodeSet::new()),
            Layout::LayerPerNode(NodeSet::new()),
            Layout::Replicate(NodeSet::new()),
            Layout::ReplicateDomains(NodeSet::new()),
            Layout::SplitExperts(NodeSet::new()),
        ] {
            assert!(empty.check(false).is_err(), "{empty:?}");
        }
    }

    #[test]
    fn copies_follow_the_domains_of_the_set() {
        // Two SNC-2 sockets (0,1 | 2,3) and a CXL node 4 on the second.
        let machine = [set(&[0, 1]), set(&[2, 3, 4])];
        let domains = |s: &NodeSet| {
            Ok(machine
                .iter()
                .map(|d| d.intersection(s))
                .collect::<Vec<_>>())
        };
        let groups = |layout: Layout| layout.copy_groups(domains).unwrap();
        assert_eq!(
            groups(Layout::ReplicateDomains(set(&[0, 1, 2, 3, 4]))),
            [set(&[0, 1]), set(&[2, 3, 4])]
        );
        // A set with one node of a domain: that copy is bound to the node.
        let one = groups(Layout::ReplicateDomains(set(&[1, 2, 3])));
        assert_eq!(one, [set(&[1]), set(&[2, 3])]);
        assert_eq!(copy_policy(&one[0]), MemPolicy::Bind(set(&[1])));
        assert_eq!(copy_policy(&one[1]), MemPolicy::Interleave(set(&[2, 3])));
        // Per node, whatever the domains.
        assert_eq!(
            groups(Layout::Replicate(set(&[0, 1, 4]))),
            [set(&[0]), set(&[1]), set(&[4])]
        );
        // A failing domain reader fails the layout; the others never ask.
        let broken = |_: &NodeSet| Err(Error::empty("domains", "test"));
        assert!(
            Layout::ReplicateDomains(set(&[0]))
                .copy_groups(broken)
                .is_err()
        );
        assert!(
            Layout::Interleave(set(&[0]))
                .copy_groups(broken)
                .unwrap()
                .is_empty()
        );
    }

    #[test]
    fn short_strings_parse_to_their_layouts() {
        let ctx = NodeContext::new(4, set(&[0, 1, 2, 3]));
        let cases = [
            ("interleave:0-3", Layout::Interleave(set(&[0, 1, 2, 3]))),
            (
                "layer-per-node:all",
                Layout::LayerPerNode(set(&[0, 1, 2, 3])),
            ),
            ("replicate:all", Layout::Replicate(set(&[0, 1, 2, 3]))),
            ("split:0,2", Layout::SplitExperts(set(&[0, 2]))),
            ("split:!1", Layout::SplitExperts(set(&[0, 2, 3]))),
            (" unplaced ", Layout::Unplaced),
        ];
        for (text, want) in cases {
            assert_eq!(Layout::parse_in(text, &ctx).unwrap(), want, "{text}");
        }
        assert_eq!(Layout::SplitExperts(set(&[0, 2])).to_string(), "split:0,2");
        assert_eq!(
            Layout::Interleave(set(&[0, 1, 2, 3])).to_string(),
            "interleave:0-3"
        );
        assert_eq!(Layout::Unplaced.to_string(), "unplaced");
    }

    #[test]
    fn bad_short_strings_are_typed_errors() {
        let ctx = NodeContext::new(4, set(&[0, 1, 2, 3]));
        for text in [
            "",
            "interleave",
            "unplaced:0",
            "spread:0",
            "split:",
            "split:9",
            "bind:0",
        ] {
            let err = Layout::parse_in(text, &ctx).unwrap_err();
            assert!(
                matches!(err, Error::InvalidArgument { .. } | Error::Parse { .. }),
                "{text}: {err:?}"
            );
        }
    }

    proptest! {
        #[test]
        fn display_and_parse_round_trip(
            ids in proptest::collection::btree_set(0usize..MAX_NODES, 1..40),
            which in 0usize..NAMES.len(),
        ) {
            let nodes = NodeSet::from_nodes(ids.iter().copied()).unwrap();
            let layout = match NAMES[which].1 {
                Some(make) => make(nodes),
                None => Layout::Unplaced,
            };
            let ctx = NodeContext::new(MAX_NODES, nodes);
            let text = layout.to_string();
            prop_assert_eq!(Layout::parse_in(&text, &ctx).unwrap(), layout);
            prop_assert_eq!(layout.name(), NAMES[which].0);
        }
    }
}
