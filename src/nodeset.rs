//! [`Node`] and [`NodeSet`]: node ids and sets of them, the vocabulary every layer of the
//! crate speaks — [`Error`](crate::Error) included, so this module depends on nothing
//! else in the crate. Parsing node strings, the kernel's mask words and reading this
//! machine's nodes are in `node`, above `error`.

use std::fmt;

/// The most nodes Linux can be built for (`CONFIG_NODES_SHIFT` is at most 10).
pub const MAX_NODES: usize = 1024;
pub(crate) const WORDS: usize = MAX_NODES / 64;
/// A NUMA node id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Node(pub u16);

impl Node {
    /// The id as an index.
    pub fn index(self) -> usize {
        usize::from(self.0)
    }
}

impl fmt::Display for Node {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// A set of NUMA nodes: a fixed bitset of [`MAX_NODES`] bits (`Copy`, no allocation).
///
/// Parses and prints numactl's node-string syntax.
///
/// # Example
/// ```
/// use numapin::{Node, NodeContext, NodeSet};
/// // Four nodes exist; 0, 1 and 2 have memory this process may use.
/// let ctx = NodeContext::new(4, NodeSet::from_nodes([0, 1, 2]).unwrap());
/// let set = NodeSet::parse_in("0-2,!1", &ctx);
/// assert!(set.is_err()); // `!` only works as a prefix of the whole string
/// let set = NodeSet::parse_in("!1", &ctx).unwrap();
/// assert_eq!(set.to_string(), "0,2");
/// assert_eq!(NodeSet::parse_in("+1", &ctx).unwrap(), NodeSet::from_nodes([1]).unwrap());
/// assert!(set.contains(Node(2)));
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct NodeSet {
    pub(crate) bits: [u64; WORDS],
}

impl NodeSet {
    /// The empty set.
    pub const fn new() -> Self {
        NodeSet { bits: [0; WORDS] }
    }

    /// Adds a node; ids at or above [`MAX_NODES`] are ignored (a [`Node`] from this crate
    /// never is one).
    pub fn insert(&mut self, node: Node) {
        let i = node.index();
        if i < MAX_NODES {
            self.bits[i / 64] |= 1 << (i % 64);
        }
    }

    /// Removes a node.
    pub fn remove(&mut self, node: Node) {
        let i = node.index();
        if i < MAX_NODES {
            self.bits[i / 64] &= !(1 << (i % 64));
        }
    }

    /// Whether the node is in the set.
    pub fn contains(&self, node: Node) -> bool {
        let i = node.index();
        i < MAX_NODES && self.bits[i / 64] & (1 << (i % 64)) != 0
    }

    /// Number of nodes in the set.
    pub fn len(&self) -> usize {
        self.bits.iter().map(|w| w.count_ones() as usize).sum()
    }

    /// Whether the set is empty.
    pub fn is_empty(&self) -> bool {
        self.bits.iter().all(|&w| w == 0)
    }

    /// The nodes in ascending order.
    pub fn iter(&self) -> impl Iterator<Item = Node> + '_ {
        (0..MAX_NODES)
            .filter(|&i| self.bits[i / 64] & (1 << (i % 64)) != 0)
            .map(|i| Node(i as u16))
    }

    /// The `n`-th node of the set in ascending order.
    pub fn nth(&self, n: usize) -> Option<Node> {
        self.iter().nth(n)
    }

    /// The highest node in the set.
    pub fn last(&self) -> Option<Node> {
        (0..MAX_NODES)
            .rev()
            .find(|&i| self.bits[i / 64] & (1 << (i % 64)) != 0)
            .map(|i| Node(i as u16))
    }

    /// Nodes in both sets.
    pub fn intersection(&self, other: &NodeSet) -> NodeSet {
        let mut out = *self;
        out.bits
            .iter_mut()
            .zip(other.bits)
            .for_each(|(a, b)| *a &= b);
        out
    }

    /// Nodes in `self` but not in `other`.
    pub fn difference(&self, other: &NodeSet) -> NodeSet {
        let mut out = *self;
        out.bits
            .iter_mut()
            .zip(other.bits)
            .for_each(|(a, b)| *a &= !b);
        out
    }

    /// Nodes in either set.
    pub fn union(&self, other: &NodeSet) -> NodeSet {
        let mut out = *self;
        out.bits
            .iter_mut()
            .zip(other.bits)
            .for_each(|(a, b)| *a |= b);
        out
    }

    /// Adds the ids `lo..=hi` (both below [`MAX_NODES`], `lo <= hi`) a word at a time.
    pub(crate) fn insert_range(&mut self, lo: usize, hi: usize) {
        self.bits
            .iter_mut()
            .zip(range_words(lo, hi))
            .for_each(|(w, r)| *w |= r);
    }

    /// Reads a kernel mask back (the inverse of [`KernelMask`](crate::KernelMask)).
    pub fn from_kernel_words(words: &[u64]) -> NodeSet {
        let mut set = NodeSet::new();
        for (dst, src) in set.bits.iter_mut().zip(words) {
            *dst = *src;
        }
        set
    }
}

impl FromIterator<Node> for NodeSet {
    fn from_iter<I: IntoIterator<Item = Node>>(iter: I) -> Self {
        let mut set = NodeSet::new();
        iter.into_iter().for_each(|n| set.insert(n));
        set
    }
}

impl fmt::Display for NodeSet {
    /// The canonical compact form: ascending, runs of three or more as ranges
    /// (`0-2,5,7-9`; `0,1` stays `0,1`). The empty set prints as nothing.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let nodes: Vec<usize> = self.iter().map(Node::index).collect();
        let mut first = true;
        let mut i = 0;
        while i < nodes.len() {
            let mut j = i;
            while j + 1 < nodes.len() && nodes[j + 1] == nodes[j] + 1 {
                j += 1;
            }
            let sep = if first { "" } else { "," };
            first = false;
            match j - i {
                0 => write!(f, "{sep}{}", nodes[i])?,
                1 => write!(f, "{sep}{},{}", nodes[i], nodes[j])?,
                _ => write!(f, "{sep}{}-{}", nodes[i], nodes[j])?,
            }
            i = j + 1;
        }
        Ok(())
    }
}

impl fmt::Debug for NodeSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "NodeSet({self})")
    }
}

/// The mask words of the ids `lo..=hi` (both below [`MAX_NODES`], `lo <= hi`).
fn range_words(lo: usize, hi: usize) -> [u64; WORDS] {
    let mut words = [0u64; WORDS];
    for (i, w) in words.iter_mut().enumerate() {
        let (base, top) = (i * 64, i * 64 + 63);
        if hi < base || lo > top {
            continue;
        }
        let from = lo.saturating_sub(base);
        let to = hi.min(top) - base;
        // Bits `from..=to` of this word: all ones shifted, without overflowing at 64.
        *w = (u64::MAX >> (63 - (to - from))) << from;
    }
    words
}

impl std::ops::BitOr for NodeSet {
    type Output = NodeSet;

    /// [`NodeSet::union`].
    fn bitor(self, other: NodeSet) -> NodeSet {
        self.union(&other)
    }
}

impl std::ops::BitAnd for NodeSet {
    type Output = NodeSet;

    /// [`NodeSet::intersection`].
    fn bitand(self, other: NodeSet) -> NodeSet {
        self.intersection(&other)
    }
}

impl std::ops::Sub for NodeSet {
    type Output = NodeSet;

    /// [`NodeSet::difference`].
    fn sub(self, other: NodeSet) -> NodeSet {
        self.difference(&other)
    }
}

impl std::ops::BitOrAssign for NodeSet {
    fn bitor_assign(&mut self, other: NodeSet) {
        *self = self.union(&other);
    }
}

impl std::ops::BitAndAssign for NodeSet {
    fn bitand_assign(&mut self, other: NodeSet) {
        *self = self.intersection(&other);
    }
}

impl std::ops::SubAssign for NodeSet {
    fn sub_assign(&mut self, other: NodeSet) {
        *self = self.difference(&other);
    }
}

/// The nodes of a [`NodeSet`] in ascending order (from `into_iter`); it owns a copy of
/// the set's bits, so it borrows nothing.
#[derive(Debug, Clone)]
pub struct NodeSetIter {
    bits: [u64; WORDS],
    word: usize,
}

impl Iterator for NodeSetIter {
    type Item = Node;

    fn next(&mut self) -> Option<Node> {
        while self.word < WORDS {
            let bits = self.bits[self.word];
            if bits != 0 {
                let bit = bits.trailing_zeros() as usize;
                self.bits[self.word] &= bits - 1;
                // word < 16 and bit < 64: the id is below MAX_NODES and fits a u16.
                return Some(Node((self.word * 64 + bit) as u16));
            }
            self.word += 1;
        }
        None
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left: usize = self.bits[self.word.min(WORDS)..]
            .iter()
            .map(|w| w.count_ones() as usize)
            .sum();
        (left, Some(left))
    }
}

impl ExactSizeIterator for NodeSetIter {}

impl std::iter::FusedIterator for NodeSetIter {}

impl IntoIterator for NodeSet {
    type Item = Node;
    type IntoIter = NodeSetIter;

    fn into_iter(self) -> NodeSetIter {
        NodeSetIter {
            bits: self.bits,
            word: 0,
        }
    }
}

impl IntoIterator for &NodeSet {
    type Item = Node;
    type IntoIter = NodeSetIter;

    fn into_iter(self) -> NodeSetIter {
        (*self).into_iter()
    }
}

#[cfg(feature = "serde")]
impl serde::Serialize for NodeSet {
    /// The [`Display`](fmt::Display) form: `"0-2,5"` (`""` for the empty set).
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

#[cfg(feature = "serde")]
impl serde::Serialize for Node {
    /// The id as a number.
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_u16(self.0)
    }
}

#[cfg(feature = "serde")]
impl<'de> serde::Deserialize<'de> for Node {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Node, D::Error> {
        u16::deserialize(deserializer).map(Node)
    }
}
