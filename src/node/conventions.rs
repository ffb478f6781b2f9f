//! Standard-library conventions for [`NodeSet`]: parsing with `FromStr` and serde here;
//! the tests check those and the set operators and iteration (defined in `nodeset`).

use super::NodeSet;
#[cfg(any(feature = "serde", test))]
use super::{MAX_NODES, NodeContext};
use crate::error::{Error, Result};

impl std::str::FromStr for NodeSet {
    type Err = Error;

    /// [`NodeSet::parse`]: numactl's node-string syntax against this process's topology
    /// (`"0-2".parse::<NodeSet>()` fails where node 2 does not exist).
    fn from_str(input: &str) -> Result<NodeSet> {
        NodeSet::parse(input)
    }
}

#[cfg(any(feature = "serde", test))]
impl NodeSet {
    /// Parses a literal node list as [`Display`](std::fmt::Display) prints it (`0-2,5`; empty
    /// for the empty set) without reading this machine's topology: ids up to
    /// [`MAX_NODES`], no `all`, `!` or `+`. For data written elsewhere (serde, reports).
    pub(crate) fn parse_literal(input: &str) -> Result<NodeSet> {
        if input.trim().is_empty() {
            return Ok(NodeSet::new());
        }
        NodeSet::parse_in(input, &NodeContext::new(MAX_NODES, NodeSet::new()))
    }
}

#[cfg(feature = "serde")]
impl<'de> serde::Deserialize<'de> for NodeSet {
    /// A literal list as [`Display`](std::fmt::Display) prints it, read without this machine's
    /// topology (a report from a 4-node box deserializes on a 1-node one).
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<NodeSet, D::Error> {
        let text = <std::borrow::Cow<'de, str>>::deserialize(deserializer)?;
        NodeSet::parse_literal(&text).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod convention_tests {
    use super::*;
    use crate::nodeset::Node;
    use proptest::prelude::*;

    fn set(ids: &[usize]) -> NodeSet {
        NodeSet::from_nodes(ids.iter().copied()).unwrap()
    }

    #[test]
    fn from_str_is_parse() {
        // Node 0 exists on every Linux machine; MAX_NODES never does.
        assert_eq!("0".parse::<NodeSet>().unwrap(), set(&[0]));
        assert_eq!(
            "all".parse::<NodeSet>().unwrap(),
            NodeSet::parse("all").unwrap()
        );
        match "1024".parse::<NodeSet>() {
            Err(Error::Parse { part, .. }) => assert_eq!(part, "1024"),
            other => panic!("1024 gave {other:?}"),
        }
    }

    #[test]
    fn literal_parse_ignores_this_machine() {
        assert_eq!(NodeSet::parse_literal("").unwrap(), NodeSet::new());
        assert_eq!(
            NodeSet::parse_literal("1-3,1023").unwrap(),
            set(&[1, 2, 3, 1023])
        );
        for bad in ["all", "!0", "+0", "1024", "0,,1"] {
            assert!(NodeSet::parse_literal(bad).is_err(), "{bad:?} parsed");
        }
    }

    #[test]
    fn operators_match_the_named_methods() {
        let (a, b) = (set(&[0, 1, 2, 64]), set(&[2, 3, 64, 1000]));
        assert_eq!(a | b, set(&[0, 1, 2, 3, 64, 1000]));
        assert_eq!(a & b, set(&[2, 64]));
        assert_eq!(a - b, set(&[0, 1]));
        let mut c = a;
        c |= b;
        assert_eq!(c, a | b);
        c &= set(&[1, 3, 5]);
        assert_eq!(c, set(&[1, 3]));
        c -= set(&[3]);
        assert_eq!(c, set(&[1]));
    }

    #[test]
    fn into_iter_by_value_and_by_reference() {
        let s = set(&[0, 63, 64, 127, 128, 1023]);
        let by_ref: Vec<usize> = (&s).into_iter().map(Node::index).collect();
        assert_eq!(by_ref, [0, 63, 64, 127, 128, 1023]);
        let mut by_value = Vec::new();
        for node in s {
            by_value.push(node.index());
        }
        assert_eq!(by_value, by_ref);
        let it = s.into_iter();
        assert_eq!(it.len(), 6);
        assert_eq!(NodeSet::new().into_iter().next(), None);
    }

    proptest! {
        #[test]
        fn into_iter_agrees_with_iter(ids in proptest::collection::btree_set(0usize..MAX_NODES, 0..64)) {
            let s = NodeSet::from_nodes(ids.iter().copied()).unwrap();
            let mut it = s.into_iter();
            prop_assert_eq!(it.len(), ids.len());
            let mut seen = Vec::new();
            while let Some(node) = it.next() {
                seen.push(node);
                prop_assert_eq!(it.len(), ids.len() - seen.len());
            }
            prop_assert_eq!(seen, s.iter().collect::<Vec<_>>());
        }

        #[test]
        fn operators_are_set_algebra(a in proptest::collection::btree_set(0usize..200, 0..30),
                                     b in proptest::collection::btree_set(0usize..200, 0..30)) {
            let (sa, sb) = (NodeSet::from_nodes(a.iter().copied()).unwrap(),
                            NodeSet::from_nodes(b.iter().copied()).unwrap());
            let want = |ids: Vec<usize>| NodeSet::from_nodes(ids).unwrap();
            prop_assert_eq!(sa | sb, want(a.union(&b).copied().collect()));
            prop_assert_eq!(sa & sb, want(a.intersection(&b).copied().collect()));
            prop_assert_eq!(sa - sb, want(a.difference(&b).copied().collect()));
        }

        #[test]
        fn display_literal_roundtrip(ids in proptest::collection::btree_set(0usize..MAX_NODES, 0..40)) {
            let s = NodeSet::from_nodes(ids.iter().copied()).unwrap();
            prop_assert_eq!(NodeSet::parse_literal(&s.to_string()).unwrap(), s);
        }
    }
}
