//! Node ids, node sets, numactl's node-string syntax and the kernel's mask words.

use std::fmt;
use std::sync::OnceLock;

use crate::error::{Error, Result};

mod conventions;

use crate::nodeset::WORDS;
pub(crate) use crate::nodeset::{MAX_NODES, Node, NodeSet};

/// What a node string is resolved against: how many node ids the kernel can have, and
/// which nodes this process may allocate on (`all`, `!` and `+` refer to them).
///
/// The fields are private so that every context is valid: `possible` is always in
/// `1..=MAX_NODES` (a context with 0 possible nodes, or with more ids than any kernel can
/// have, cannot be built).
///
/// ```compile_fail
/// use numapin::{NodeContext, NodeSet};
/// // Private fields: no context can bypass `new`'s clamps.
/// let ctx = NodeContext { possible: 0, allowed: NodeSet::new() };
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeContext {
    possible: usize,
    allowed: NodeSet,
}

impl NodeContext {
    /// A context with explicit figures (tests, tools that inspect another machine).
    ///
    /// `possible` is clamped into `1..=MAX_NODES`: no kernel has no node or more than
    /// [`MAX_NODES`], so a figure outside that range can only be a mistake, and clamping
    /// keeps every id this crate accepts representable as a [`Node`]. `allowed` is kept as
    /// given.
    pub fn new(possible: usize, allowed: NodeSet) -> Self {
        NodeContext {
            possible: possible.clamp(1, MAX_NODES),
            allowed,
        }
    }

    /// This process on this machine, read from sysfs and `/proc/self/status`.
    ///
    /// # Errors
    /// Reading `/proc/self/status` fails.
    pub fn current() -> Result<Self> {
        Ok(NodeContext::new(possible_node_count(), NodeSet::allowed()?))
    }

    /// Node ids `0..possible` are valid (`/sys/devices/system/node/possible`); always in
    /// `1..=MAX_NODES`.
    pub fn possible(&self) -> usize {
        self.possible
    }

    /// Nodes with memory inside this process's `mems_allowed`.
    pub fn allowed(&self) -> NodeSet {
        self.allowed
    }
}

impl NodeSet {
    /// A set of the given ids.
    ///
    /// # Errors
    /// An id at or above [`MAX_NODES`].
    pub fn from_nodes(ids: impl IntoIterator<Item = usize>) -> Result<Self> {
        let mut set = NodeSet::new();
        for id in ids {
            if id >= MAX_NODES {
                return Err(Error::no_such_node(
                    "NodeSet::from_nodes",
                    "ids",
                    id,
                    MAX_NODES,
                    None,
                ));
            }
            set.insert(Node(id as u16));
        }
        Ok(set)
    }

    /// The nodes with memory that this process may allocate on: `Mems_allowed` from
    /// `/proc/self/status` intersected with `/sys/devices/system/node/has_memory`.
    /// On a kernel without NUMA sysfs, node 0.
    ///
    /// # Errors
    /// `/proc/self/status` cannot be read.
    pub fn allowed() -> Result<NodeSet> {
        let mems = mems_allowed()?;
        Ok(match nodes_with_memory()? {
            Some(with_memory) => mems.intersection(&with_memory),
            None => mems,
        })
    }

    /// Parses numactl's node-string syntax against this process's topology.
    /// See [`NodeSet::parse_in`].
    ///
    /// # Errors
    /// As [`NodeSet::parse_in`]; also when the topology cannot be read.
    pub fn parse(input: &str) -> Result<NodeSet> {
        NodeSet::parse_in(input, &NodeContext::current()?)
    }

    /// Parses numactl's node-string syntax.
    ///
    /// - `3`, `0-2`, `0,2-3`: ids and inclusive ranges, decimal only (`010` is ten);
    /// - `all`: the allowed nodes;
    /// - `!list`: the allowed nodes except `list`;
    /// - `+list`: ids relative to the allowed set (`+0` is its first node), as libnuma's
    ///   cpuset-relative form; `!+list` combines both.
    ///
    /// # Errors
    /// [`Error::Parse`] quoting the offending part: empty input or list items, stray
    /// commas, non-decimal text, reversed ranges (`3-1`), ids at or above
    /// `ctx.possible`, relative ids beyond the allowed set, and a result with no nodes.
    pub fn parse_in(input: &str, ctx: &NodeContext) -> Result<NodeSet> {
        // Clipped, as the share and slice parsers do: a megabyte of input is not echoed.
        let fail = |part: &str, reason: &str| Error::Parse {
            what: "node string",
            input: crate::error::clip_owned(input.to_string(), 200),
            part: crate::error::clip_owned(part.to_string(), 64),
            reason: reason.to_string(),
        };
        let trimmed = input.trim();
        if trimmed.is_empty() {
            return Err(fail(input, "empty node string"));
        }
        if trimmed == "all" {
            return if ctx.allowed.is_empty() {
                Err(fail(trimmed, "no allowed nodes"))
            } else {
                Ok(ctx.allowed)
            };
        }
        let (invert, rest) = match trimmed.strip_prefix('!') {
            Some(rest) => (true, rest),
            None => (false, trimmed),
        };
        let (relative, list) = match rest.strip_prefix('+') {
            Some(rest) => (true, rest),
            None => (false, rest),
        };
        if list.is_empty() {
            return Err(fail(trimmed, "prefix without a node list"));
        }
        let bound = if relative {
            ctx.allowed.len()
        } else {
            ctx.possible
        };
        let parse_id = |text: &str, item: &str| -> Result<usize> {
            if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
                return Err(fail(item, "expected a decimal node id"));
            }
            let id: usize = text.parse().map_err(|_| fail(item, "node id too large"))?;
            if id >= bound {
                let why = if relative {
                    format!("relative id {id} is beyond the {bound} allowed nodes")
                } else {
                    format!("node {id} does not exist (possible nodes: 0-{})", bound - 1)
                };
                return Err(fail(item, &why));
            }
            Ok(id)
        };
        // The allowed nodes by rank, computed once (a relative id is an index into it).
        let mut ranks = [Node(0); MAX_NODES];
        if relative {
            ranks
                .iter_mut()
                .zip(ctx.allowed.iter())
                .for_each(|(r, n)| *r = n);
        }
        let mut set = NodeSet::new();
        for item in list.split(',') {
            let item = item.trim();
            if item.is_empty() {
                return Err(fail(list, "empty item (stray comma)"));
            }
            let (lo, hi) = match item.split_once('-') {
                Some((a, b)) => (parse_id(a.trim(), item)?, parse_id(b.trim(), item)?),
                None => {
                    let id = parse_id(item, item)?;
                    (id, id)
                }
            };
            if lo > hi {
                return Err(fail(item, "empty range (start above end)"));
            }
            // O(words) per item, whatever the range: parsing stays linear in the input.
            if relative {
                // `hi < allowed.len()` was checked by parse_id, so both ranks exist: the
                // allowed nodes from the `lo`-th to the `hi`-th are exactly the allowed
                // nodes inside that id range.
                let (first, last) = (ranks[lo].index(), ranks[hi].index());
                let mut span = NodeSet::new();
                span.insert_range(first, last);
                set = set.union(&span.intersection(&ctx.allowed));
            } else {
                // `hi < possible <= MAX_NODES` was checked by parse_id.
                set.insert_range(lo, hi);
            }
        }
        if invert {
            set = ctx.allowed.difference(&set);
        }
        if set.is_empty() {
            return Err(fail(trimmed, "selects no nodes"));
        }
        Ok(set)
    }

    /// The kernel's view of this set, sized for this machine's possible node count.
    pub fn as_kernel_mask(&self) -> KernelMask {
        KernelMask::new(self, possible_node_count())
    }
}

/// A node mask in the kernel's layout: whole 64-bit words covering every possible node
/// plus one spare bit, with `maxnode = 64 * words` (see `numapin_sys`'s crate docs for
/// why this is right whether the kernel reads `maxnode` or `maxnode - 1` bits).
#[derive(Clone, Copy)]
pub struct KernelMask {
    words: [u64; WORDS + 1],
    len: usize,
}

impl KernelMask {
    /// The mask of `set` for a kernel with `possible` node ids.
    pub fn new(set: &NodeSet, possible: usize) -> Self {
        let highest = set.last().map_or(0, |n| n.index() + 1);
        let bits_needed = possible.max(highest).clamp(1, MAX_NODES) + 1;
        let len = bits_needed.div_ceil(64);
        let mut words = [0; WORDS + 1];
        words[..WORDS].copy_from_slice(&set.bits);
        KernelMask { words, len }
    }

    /// An all-zero mask of the right size for reading a mask back from the kernel.
    pub(crate) fn empty(possible: usize) -> Self {
        KernelMask::new(&NodeSet::new(), possible)
    }

    /// The mask words.
    pub fn words(&self) -> &[u64] {
        &self.words[..self.len]
    }

    /// The mask words, writable (for `get_mempolicy`).
    pub(crate) fn words_mut(&mut self) -> &mut [u64] {
        &mut self.words[..self.len]
    }

    /// `64 * words`.
    pub fn maxnode(&self) -> u64 {
        64 * self.len as u64
    }
}

impl fmt::Debug for KernelMask {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KernelMask")
            .field("words", &self.words())
            .field("maxnode", &self.maxnode())
            .finish()
    }
}

/// The number of node ids this kernel can have (`/sys/devices/system/node/possible`,
/// highest id + 1); 1 when that file is missing (a kernel without NUMA). Read once.
pub fn possible_node_count() -> usize {
    static POSSIBLE: OnceLock<usize> = OnceLock::new();
    *POSSIBLE.get_or_init(|| {
        std::fs::read_to_string("/sys/devices/system/node/possible")
            .ok()
            .and_then(|s| parse_kernel_list(&s))
            .and_then(|s| s.last())
            .map_or(1, |n| n.index() + 1)
    })
}

/// Parses a kernel list (`0-3,5`, as in sysfs and `Mems_allowed_list`), no context.
pub(crate) fn parse_kernel_list(text: &str) -> Option<NodeSet> {
    let mut set = NodeSet::new();
    for (lo, hi) in parse_kernel_ranges(text, MAX_NODES)? {
        set.insert_range(lo, hi);
    }
    Some(set)
}

/// The inclusive ranges `(lo, hi)` of a kernel list (`0-3,8,10-11`: node lists, CPU
/// lists), each id below `limit` (so a corrupt file cannot ask for a huge table); `None`
/// if malformed. Whitespace around the list is ignored; an empty list has no ranges.
pub(crate) fn parse_kernel_ranges(text: &str, limit: usize) -> Option<Vec<(usize, usize)>> {
    let text = text.trim();
    if text.is_empty() {
        return Some(Vec::new());
    }
    text.split(',')
        .map(|item| {
            let (lo, hi) = match item.split_once('-') {
                Some((a, b)) => (a.parse::<usize>().ok()?, b.parse::<usize>().ok()?),
                None => {
                    let id = item.parse::<usize>().ok()?;
                    (id, id)
                }
            };
            (lo <= hi && hi < limit).then_some((lo, hi))
        })
        .collect()
}

/// Reads a sysfs node list; `Ok(None)` when the file does not exist (no NUMA sysfs).
pub(crate) fn read_sysfs_nodes(name: &str) -> Result<Option<NodeSet>> {
    let path = format!("/sys/devices/system/node/{name}");
    match std::fs::read_to_string(&path) {
        Ok(text) => parse_kernel_list(&text)
            .map(Some)
            .ok_or_else(|| Error::Unparsable {
                path: path.clone(),
                what: "a node list",
                found: text.chars().take(200).collect(),
            }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::io("read", path, e)),
    }
}

pub(crate) fn nodes_with_memory() -> Result<Option<NodeSet>> {
    read_sysfs_nodes("has_memory")
}

/// `Mems_allowed_list` of `/proc/self/status`.
pub(crate) fn mems_allowed() -> Result<NodeSet> {
    let status = std::fs::read_to_string("/proc/self/status")
        .map_err(|e| Error::io("read", "/proc/self/status", e))?;
    let line = status
        .lines()
        .find_map(|l| l.strip_prefix("Mems_allowed_list:"))
        .unwrap_or("0");
    parse_kernel_list(line).ok_or_else(|| Error::Unparsable {
        path: "/proc/self/status".to_string(),
        what: "Mems_allowed_list",
        found: line.chars().take(200).collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ctx4() -> NodeContext {
        NodeContext::new(4, NodeSet::from_nodes([0, 1, 2]).unwrap())
    }

    fn set(ids: &[usize]) -> NodeSet {
        NodeSet::from_nodes(ids.iter().copied()).unwrap()
    }

    #[test]
    fn parses_ids_ranges_and_lists() {
        let c = ctx4();
        assert_eq!(NodeSet::parse_in("3", &c).unwrap(), set(&[3]));
        assert_eq!(NodeSet::parse_in("0-2", &c).unwrap(), set(&[0, 1, 2]));
        assert_eq!(NodeSet::parse_in("0,2-3", &c).unwrap(), set(&[0, 2, 3]));
        assert_eq!(NodeSet::parse_in(" 1 , 3 ", &c).unwrap(), set(&[1, 3]));
    }

    #[test]
    fn all_bang_and_plus_resolve_against_allowed() {
        let c = NodeContext::new(8, set(&[1, 3, 5]));
        assert_eq!(NodeSet::parse_in("all", &c).unwrap(), set(&[1, 3, 5]));
        assert_eq!(NodeSet::parse_in("!3", &c).unwrap(), set(&[1, 5]));
        assert_eq!(NodeSet::parse_in("+0,2", &c).unwrap(), set(&[1, 5]));
        assert_eq!(NodeSet::parse_in("+1-2", &c).unwrap(), set(&[3, 5]));
        assert_eq!(NodeSet::parse_in("!+0", &c).unwrap(), set(&[3, 5]));
    }

    #[test]
    fn decimal_only_no_octal() {
        let c = NodeContext::new(64, set(&[0]));
        assert_eq!(NodeSet::parse_in("010", &c).unwrap(), set(&[10]));
        assert!(NodeSet::parse_in("0x1", &c).is_err());
    }

    #[test]
    fn errors_quote_the_offending_part() {
        let c = ctx4();
        let cases: &[(&str, &str)] = &[
            ("", ""),
            ("   ", "   "),
            ("4", "4"),
            ("3-1", "3-1"),
            ("0,,1", "0,,1"),
            (",1", ",1"),
            ("1,", "1,"),
            ("a", "a"),
            ("-1", "-1"),
            ("99999999999999999999999", "99999999999999999999999"),
            ("+3", "3"),
            ("!", "!"),
            ("!0-2", "!0-2"),
            ("1-", "1-"),
        ];
        for (input, part) in cases {
            match NodeSet::parse_in(input, &c) {
                Err(Error::Parse { part: p, .. }) => assert_eq!(&p, part, "input {input:?}"),
                other => panic!("{input:?} gave {other:?}"),
            }
        }
    }

    #[test]
    fn display_is_compact_and_canonical() {
        assert_eq!(set(&[0, 1, 2, 5, 7, 8, 9]).to_string(), "0-2,5,7-9");
        assert_eq!(set(&[0, 1]).to_string(), "0,1");
        assert_eq!(set(&[3, 1, 0]).to_string(), "0,1,3");
        assert_eq!(set(&[]).to_string(), "");
        assert_eq!(set(&[1023]).to_string(), "1023");
    }

    #[test]
    fn kernel_mask_word_boundaries() {
        // 63 possible nodes: 63 bits + a spare = 64 bits, one word.
        let m = KernelMask::new(&set(&[62]), 63);
        assert_eq!((m.words().len(), m.maxnode()), (1, 64));
        assert_eq!(m.words()[0], 1 << 62);
        // 64 possible nodes: bit 63 used, the spare needs a second word.
        let m = KernelMask::new(&set(&[63]), 64);
        assert_eq!((m.words().len(), m.maxnode()), (2, 128));
        assert_eq!(m.words(), &[1 << 63, 0]);
        // Node 64 lives in the second word.
        let m = KernelMask::new(&set(&[64]), 65);
        assert_eq!(m.words(), &[0, 1]);
        assert_eq!(m.maxnode(), 128);
        // A set beyond `possible` still gets all its bits.
        let m = KernelMask::new(&set(&[64]), 1);
        assert_eq!(m.words(), &[0, 1]);
        // One-node machine.
        let m = KernelMask::new(&set(&[0]), 1);
        assert_eq!((m.words(), m.maxnode()), (&[1u64][..], 64));
        // The biggest kernel: 1024 nodes + spare = 17 words.
        let m = KernelMask::new(&set(&[1023]), 1024);
        assert_eq!(m.words().len(), 17);
        assert_eq!(NodeSet::from_kernel_words(m.words()), set(&[1023]));
    }

    #[test]
    fn from_nodes_rejects_ids_beyond_the_limit() {
        assert!(NodeSet::from_nodes([MAX_NODES]).is_err());
    }

    #[test]
    fn range_words_set_exactly_the_range() {
        for (lo, hi) in [
            (0, 0),
            (0, 63),
            (0, 64),
            (63, 64),
            (5, 1000),
            (1023, 1023),
            (0, 1023),
        ] {
            let mut s = NodeSet::new();
            s.insert_range(lo, hi);
            assert_eq!(s, NodeSet::from_nodes(lo..=hi).unwrap(), "{lo}-{hi}");
        }
    }

    #[test]
    fn kernel_lists_parse() {
        assert_eq!(parse_kernel_list("0-3,5\n"), Some(set(&[0, 1, 2, 3, 5])));
        assert_eq!(parse_kernel_list(""), Some(NodeSet::new()));
        assert_eq!(parse_kernel_list("x"), None);
    }

    proptest! {
        #[test]
        fn display_parse_roundtrip(ids in proptest::collection::btree_set(0usize..128, 1..40)) {
            let s = NodeSet::from_nodes(ids.iter().copied()).unwrap();
            let c = NodeContext::new(128, s);
            prop_assert_eq!(NodeSet::parse_in(&s.to_string(), &c).unwrap(), s);
        }

        #[test]
        fn mask_roundtrip(ids in proptest::collection::btree_set(0usize..1024, 0..40),
                          possible in 1usize..1025) {
            let s = NodeSet::from_nodes(ids.iter().copied()).unwrap();
            let m = KernelMask::new(&s, possible);
            prop_assert_eq!(NodeSet::from_kernel_words(m.words()), s);
            prop_assert_eq!(m.maxnode() % 64, 0);
            // At least one spare bit above every possible and every present node.
            let top = s.last().map_or(0, |n| n.index() + 1).max(possible);
            prop_assert!(m.maxnode() as usize > top);
        }

        #[test]
        fn parse_never_panics(input in "[-!+,0-9a-z ]{0,12}") {
            let _ = NodeSet::parse_in(&input, &ctx4());
        }

        #[test]
        fn bang_is_complement_within_allowed(ids in proptest::collection::btree_set(0usize..8, 1..8)) {
            let allowed = NodeSet::from_nodes(0..8).unwrap();
            let c = NodeContext::new(8, allowed);
            let s = NodeSet::from_nodes(ids.iter().copied()).unwrap();
            match NodeSet::parse_in(&format!("!{s}"), &c) {
                Ok(inv) => {
                    prop_assert_eq!(inv.union(&s), allowed);
                    prop_assert!(inv.intersection(&s).is_empty());
                }
                Err(_) => prop_assert_eq!(s, allowed),
            }
        }
    }
}
