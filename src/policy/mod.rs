//! Memory policies, their flags, and the calling thread's policy.
//!
//! # Safety
//!
//! The thread-policy calls pass a mask this module sized itself; they change no memory.
#![allow(unsafe_code)]

mod check;
mod thread;

use std::fmt;

use numapin_sys as sys;

pub use crate::calls::DegradeReason;
use crate::calls::{NumaCall, degrade_or_error};
use crate::error::{Errno, Error, Result};
use crate::node::{KernelMask, Node, NodeContext, NodeSet};
pub(crate) use check::{
    check_exist, check_mbind_flags, check_migrate_nodes, check_move_target, check_policy_call,
    not_allowed,
};
pub(crate) use thread::policy_at_addr;
pub use thread::{ScopedPolicy, scoped, set_thread_policy, set_thread_policy_with, thread_policy};

/// A memory policy: where future page faults of a range (or a thread) allocate.
///
/// # Example
/// ```
/// use numapin::NodeSet;
/// use numapin::policy::MemPolicy;
/// let p = MemPolicy::Interleave(NodeSet::from_nodes([0, 1, 2]).unwrap());
/// assert_eq!(p.to_string(), "interleave:0-2");
/// assert!(MemPolicy::Bind(NodeSet::new()).validate().is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[doc(alias = "mempolicy")]
pub enum MemPolicy {
    /// `MPOL_DEFAULT`: no policy of its own (a range falls back to the thread's policy,
    /// a thread to local allocation).
    Default,
    /// `MPOL_LOCAL`: the node of the faulting CPU.
    Local,
    /// `MPOL_PREFERRED`: this node while it has room, then others.
    Preferred(Node),
    /// `MPOL_PREFERRED_MANY`: these nodes while they have room (since Linux 5.15).
    PreferredMany(NodeSet),
    /// `MPOL_BIND`: only these nodes; the allocation fails (OOM) when they are full.
    Bind(NodeSet),
    /// `MPOL_INTERLEAVE`: page by page, round robin over these nodes.
    Interleave(NodeSet),
    /// `MPOL_WEIGHTED_INTERLEAVE`: by the weights in
    /// `/sys/kernel/mm/mempolicy/weighted_interleave/` (since Linux 6.9).
    WeightedInterleave(NodeSet),
}

bitflags::bitflags! {
    /// Mode flags OR-ed into the mode (`set_mempolicy(2)`).
    /// `STATIC_NODES` and `RELATIVE_NODES` exclude each other.
    #[repr(transparent)]
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct ModeFlags: i32 {
        /// `MPOL_F_STATIC_NODES`: keep the node ids when the cpuset changes (since Linux 2.6.26).
        const STATIC_NODES = sys::MPOL_F_STATIC_NODES;
        /// `MPOL_F_RELATIVE_NODES`: ids relative to the allowed set (since Linux 2.6.26).
        const RELATIVE_NODES = sys::MPOL_F_RELATIVE_NODES;
        /// `MPOL_F_NUMA_BALANCING`: allow NUMA balancing under `Bind` (since Linux 5.12;
        /// `Preferred`/`PreferredMany` since 6.x).
        const NUMA_BALANCING = sys::MPOL_F_NUMA_BALANCING;
        const _ = !0;
    }
}

bitflags::bitflags! {
    /// Flags of `mbind(2)`. Binding a fresh mapping before its first write needs none of
    /// them: a policy steers future faults; `MOVE` is for pages that already exist.
    #[repr(transparent)]
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
    pub struct MbindFlags: u32 {
        /// `MPOL_MF_STRICT`: fail with `EIO` if existing pages are elsewhere (and, with
        /// `MOVE`, could not be moved).
        const STRICT = sys::MPOL_MF_STRICT;
        /// `MPOL_MF_MOVE`: move this process's existing pages of the range.
        const MOVE = sys::MPOL_MF_MOVE;
        /// `MPOL_MF_MOVE_ALL`: also pages shared with other processes; needs
        /// `CAP_SYS_NICE` (else `EPERM`, which here is an error, not a degradation).
        const MOVE_ALL = sys::MPOL_MF_MOVE_ALL;
        const _ = !0;
    }
}

/// The outcome of setting a policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(rename_all = "lowercase")
)]
#[must_use = "a Degraded placement means memory is not where it was asked to be"]
pub enum Placement {
    /// The kernel accepted the policy.
    Bound,
    /// The kernel refused with `EPERM` or `ENOSYS`: memory works, unplaced.
    Degraded(DegradeReason),
}

impl Placement {
    /// Whether the policy is in force.
    pub fn is_bound(&self) -> bool {
        matches!(self, Placement::Bound)
    }

    /// Turns a policy call's result into a placement, judging its errno with
    /// [`degrade_or_error`].
    pub(crate) fn from_call(
        call: NumaCall,
        result: std::result::Result<(), Errno>,
        args: impl FnOnce() -> String,
    ) -> Result<Placement> {
        match result {
            Ok(()) => Ok(Placement::Bound),
            Err(errno) => degrade_or_error(call, errno, args).map(Placement::Degraded),
        }
    }
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Placement::Bound => f.write_str("bound"),
            Placement::Degraded(reason) => write!(f, "degraded: {reason}"),
        }
    }
}

/// A query answered by the kernel, or not available here (`EPERM`/`ENOSYS`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Observed<T> {
    /// The kernel's answer.
    Known(T),
    /// The query is denied or unsupported here.
    Degraded(DegradeReason),
}

impl<T> Observed<T> {
    /// The answer, if there is one.
    pub fn known(self) -> Option<T> {
        match self {
            Observed::Known(t) => Some(t),
            Observed::Degraded(_) => None,
        }
    }
}

impl MemPolicy {
    /// The kernel mode number (`MPOL_*`).
    pub fn mode(&self) -> i32 {
        match self {
            MemPolicy::Default => sys::MPOL_DEFAULT,
            MemPolicy::Local => sys::MPOL_LOCAL,
            MemPolicy::Preferred(_) => sys::MPOL_PREFERRED,
            MemPolicy::PreferredMany(_) => sys::MPOL_PREFERRED_MANY,
            MemPolicy::Bind(_) => sys::MPOL_BIND,
            MemPolicy::Interleave(_) => sys::MPOL_INTERLEAVE,
            MemPolicy::WeightedInterleave(_) => sys::MPOL_WEIGHTED_INTERLEAVE,
        }
    }

    /// The policy's nodes (empty for `Default` and `Local`).
    pub fn nodes(&self) -> NodeSet {
        match self {
            MemPolicy::Default | MemPolicy::Local => NodeSet::new(),
            MemPolicy::Preferred(n) => std::iter::once(*n).collect(),
            MemPolicy::PreferredMany(s)
            | MemPolicy::Bind(s)
            | MemPolicy::Interleave(s)
            | MemPolicy::WeightedInterleave(s) => *s,
        }
    }

    /// The name numa_maps uses for the mode.
    pub fn name(&self) -> &'static str {
        match self {
            MemPolicy::Default => "default",
            MemPolicy::Local => "local",
            MemPolicy::Preferred(_) => "prefer",
            MemPolicy::PreferredMany(_) => "prefer (many)",
            MemPolicy::Bind(_) => "bind",
            MemPolicy::Interleave(_) => "interleave",
            MemPolicy::WeightedInterleave(_) => "weighted interleave",
        }
    }

    /// The kernel mask for this policy (all zero for `Default`/`Local`).
    pub(crate) fn kernel_mask(&self) -> KernelMask {
        self.nodes().as_kernel_mask()
    }

    /// Decodes what `get_mempolicy` returned.
    ///
    /// # Errors
    /// A mode this crate does not know.
    pub(crate) fn from_kernel(mode: i32, nodes: NodeSet) -> Result<(MemPolicy, ModeFlags)> {
        let flags = ModeFlags::from_bits_retain(mode & sys::MPOL_MODE_FLAGS);
        let policy = match mode & !sys::MPOL_MODE_FLAGS {
            sys::MPOL_DEFAULT => MemPolicy::Default,
            sys::MPOL_LOCAL => MemPolicy::Local,
            // An empty preferred mask is the pre-3.8 spelling of local allocation.
            sys::MPOL_PREFERRED => nodes
                .iter()
                .next()
                .map_or(MemPolicy::Local, MemPolicy::Preferred),
            sys::MPOL_PREFERRED_MANY => MemPolicy::PreferredMany(nodes),
            sys::MPOL_BIND => MemPolicy::Bind(nodes),
            sys::MPOL_INTERLEAVE => MemPolicy::Interleave(nodes),
            sys::MPOL_WEIGHTED_INTERLEAVE => MemPolicy::WeightedInterleave(nodes),
            other => {
                return Err(Error::bad_value(
                    "get_mempolicy",
                    "mode",
                    other,
                    "the kernel reported a mode this crate does not know",
                ));
            }
        };
        Ok((policy, flags))
    }
}

impl fmt::Display for MemPolicy {
    /// numa_maps style: `bind:0-2`, `prefer:1`, `default`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MemPolicy::Default | MemPolicy::Local => f.write_str(self.name()),
            // Printed from the id itself: one beyond MAX_NODES has no place in a NodeSet.
            MemPolicy::Preferred(node) => write!(f, "{}:{node}", self.name()),
            _ => write!(f, "{}:{}", self.name(), self.nodes()),
        }
    }
}

impl MemPolicy {
    /// Parses the [`Display`](fmt::Display) form, resolving node strings against `ctx`
    /// (see [`NodeSet::parse_in`]): `default`, `local`, `prefer:1`, `prefer (many):0-1`,
    /// `bind:0-2`, `interleave:all`, `weighted interleave:0-2`.
    ///
    /// numactl's option names are accepted too: `localalloc`, `preferred:1`,
    /// `preferred-many:0-1`, `membind:0-2`, `weighted-interleave:0-2`. Names are exact
    /// (lower case); spaces around the name and the node string are ignored. `Display`
    /// always prints the first spelling, so `to_string` then `parse_in` gives the policy
    /// back for every policy whose nodes exist in `ctx` and that
    /// [`validate`](MemPolicy::validate)s.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an unknown mode name, a node string after `default`
    /// or `local`, a missing one after the other modes, more than one node after `prefer`,
    /// or an empty set (as [`validate`](MemPolicy::validate)); [`Error::Parse`] from the
    /// node string.
    pub fn parse_in(input: &str, ctx: &NodeContext) -> Result<MemPolicy> {
        MemPolicy::parse_with(input, |nodes| NodeSet::parse_in(nodes, ctx))
    }

    /// [`MemPolicy::parse_in`] with a node-string parser.
    fn parse_with(input: &str, nodes: impl FnOnce(&str) -> Result<NodeSet>) -> Result<MemPolicy> {
        let bad = |why: &str| {
            Error::bad_value(
                "MemPolicy::from_str",
                "memory policy",
                crate::error::quote(input),
                why,
            )
        };
        let (name, list) = match input.split_once(':') {
            Some((name, list)) => (name.trim(), Some(list)),
            None => (input.trim(), None),
        };
        let no_nodes = |policy: MemPolicy| match list {
            None => Ok(policy),
            Some(_) => Err(bad("this mode takes no node string")),
        };
        // `None`: `prefer`, which takes exactly one node.
        let with_set: Option<fn(NodeSet) -> MemPolicy> = match name {
            "default" => return no_nodes(MemPolicy::Default),
            "local" | "localalloc" => return no_nodes(MemPolicy::Local),
            "prefer" | "preferred" => None,
            "prefer (many)" | "preferred-many" => Some(MemPolicy::PreferredMany),
            "bind" | "membind" => Some(MemPolicy::Bind),
            "interleave" => Some(MemPolicy::Interleave),
            "weighted interleave" | "weighted-interleave" => Some(MemPolicy::WeightedInterleave),
            _ => {
                return Err(bad(
                    "unknown mode (expected default, local, prefer, prefer (many), bind, \
                     interleave or weighted interleave)",
                ));
            }
        };
        let list = list.ok_or_else(|| bad("this mode needs a node string after ':'"))?;
        let set = nodes(list)?;
        let policy = match with_set {
            Some(with_set) => with_set(set),
            None => {
                let mut it = set.iter();
                match (it.next(), it.next()) {
                    (Some(node), None) => MemPolicy::Preferred(node),
                    _ => {
                        return Err(bad(
                            "prefer takes exactly one node (prefer (many) takes a set)",
                        ));
                    }
                }
            }
        };
        policy.validate()?;
        Ok(policy)
    }
}

impl std::str::FromStr for MemPolicy {
    type Err = Error;

    /// [`MemPolicy::parse_in`] against this process's topology
    /// ([`NodeContext::current`]): `"interleave:all".parse::<MemPolicy>()`.
    fn from_str(input: &str) -> Result<MemPolicy> {
        MemPolicy::parse_in(input, &NodeContext::current()?)
    }
}

#[cfg(feature = "serde")]
impl serde::Serialize for MemPolicy {
    /// The [`Display`](fmt::Display) form: `"interleave:0-3"`.
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

#[cfg(feature = "serde")]
impl<'de> serde::Deserialize<'de> for MemPolicy {
    /// The [`Display`](fmt::Display) form with a literal node list, read without this
    /// machine's topology (a report from a 4-node box deserializes on a 1-node one).
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<MemPolicy, D::Error> {
        let text = <std::borrow::Cow<'de, str>>::deserialize(deserializer)?;
        MemPolicy::parse_with(&text, NodeSet::parse_literal).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Invalid;
    use crate::node::MAX_NODES;
    use proptest::prelude::*;

    fn set(ids: &[usize]) -> NodeSet {
        NodeSet::from_nodes(ids.iter().copied()).unwrap()
    }

    /// Every variant over nodes `0..possible`, from a node id and a non-empty id set.
    fn policy_strategy(possible: usize) -> impl Strategy<Value = MemPolicy> {
        let ids = proptest::collection::btree_set(0..possible, 1..possible.clamp(2, 40));
        (0usize..7, 0..possible, ids).prop_map(|(variant, id, ids)| {
            let s = NodeSet::from_nodes(ids).unwrap();
            match variant {
                0 => MemPolicy::Default,
                1 => MemPolicy::Local,
                2 => MemPolicy::Preferred(Node(id as u16)),
                3 => MemPolicy::PreferredMany(s),
                4 => MemPolicy::Bind(s),
                5 => MemPolicy::Interleave(s),
                _ => MemPolicy::WeightedInterleave(s),
            }
        })
    }

    #[test]
    fn parses_each_display_form() {
        let c = NodeContext::new(4, set(&[0, 1, 2, 3]));
        let cases = [
            ("default", MemPolicy::Default),
            ("local", MemPolicy::Local),
            ("prefer:1", MemPolicy::Preferred(Node(1))),
            ("prefer (many):0,1", MemPolicy::PreferredMany(set(&[0, 1]))),
            ("bind:0-2", MemPolicy::Bind(set(&[0, 1, 2]))),
            ("interleave:0-3", MemPolicy::Interleave(set(&[0, 1, 2, 3]))),
            (
                "weighted interleave:0-2",
                MemPolicy::WeightedInterleave(set(&[0, 1, 2])),
            ),
        ];
        for (text, policy) in cases {
            assert_eq!(MemPolicy::parse_in(text, &c).unwrap(), policy, "{text:?}");
            assert_eq!(policy.to_string(), text);
        }
    }

    #[test]
    fn accepts_numactl_spellings_and_node_string_syntax() {
        let c = NodeContext::new(4, set(&[0, 2, 3]));
        let cases = [
            ("localalloc", MemPolicy::Local),
            // Display prints a run of two as `0,2`; a range of two parses all the same.
            ("prefer (many):2-3", MemPolicy::PreferredMany(set(&[2, 3]))),
            ("preferred:2", MemPolicy::Preferred(Node(2))),
            ("preferred-many:0,3", MemPolicy::PreferredMany(set(&[0, 3]))),
            ("membind:all", MemPolicy::Bind(set(&[0, 2, 3]))),
            (
                "weighted-interleave:!2",
                MemPolicy::WeightedInterleave(set(&[0, 3])),
            ),
            (" interleave : +1-2 ", MemPolicy::Interleave(set(&[2, 3]))),
            ("prefer:!0,3", MemPolicy::Preferred(Node(2))),
        ];
        for (text, policy) in cases {
            assert_eq!(MemPolicy::parse_in(text, &c).unwrap(), policy, "{text:?}");
        }
    }

    #[test]
    fn rejects_with_the_reason() {
        let c = NodeContext::new(4, set(&[0, 1, 2, 3]));
        let invalid = [
            ("", "unknown mode"),
            ("Bind:0", "unknown mode"),
            ("interleaved:0", "unknown mode"),
            ("default:0", "takes no node string"),
            ("local:", "takes no node string"),
            ("bind", "needs a node string"),
            ("prefer:0-1", "exactly one node"),
        ];
        for (text, why) in invalid {
            match MemPolicy::parse_in(text, &c) {
                Err(Error::InvalidArgument {
                    op,
                    reason: reason @ Invalid::BadValue { .. },
                }) => {
                    let reason = reason.to_string();
                    assert_eq!(op, "MemPolicy::from_str");
                    assert!(reason.contains(why), "{text:?}: {reason}");
                    assert!(reason.contains(&format!("{text:?}")), "{text:?}: {reason}");
                }
                other => panic!("{text:?} gave {other:?}"),
            }
        }
        for (text, part) in [("bind:", ""), ("bind:4", "4"), ("interleave:0,,1", "0,,1")] {
            match MemPolicy::parse_in(text, &c) {
                Err(Error::Parse { part: p, .. }) => assert_eq!(p, part, "{text:?}"),
                other => panic!("{text:?} gave {other:?}"),
            }
        }
    }

    #[test]
    fn from_str_resolves_against_this_machine() {
        // Node 0 exists on every Linux machine; node 1023 on hardly any.
        assert_eq!(
            "bind:0".parse::<MemPolicy>().unwrap(),
            MemPolicy::Bind(set(&[0]))
        );
        assert_eq!("local".parse::<MemPolicy>().unwrap(), MemPolicy::Local);
        let here = NodeContext::current().unwrap();
        if here.possible() < MAX_NODES {
            assert!(matches!(
                "bind:1023".parse::<MemPolicy>(),
                Err(Error::Parse { .. })
            ));
        }
    }

    #[test]
    fn literal_parse_takes_any_node_and_no_topology_words() {
        let literal = |t: &str| MemPolicy::parse_with(t, NodeSet::parse_literal);
        assert_eq!(
            literal("interleave:0-3,1023").unwrap(),
            MemPolicy::Interleave(set(&[0, 1, 2, 3, 1023]))
        );
        assert!(literal("bind:").is_err());
        assert!(literal("bind:all").is_err());
    }

    proptest! {
        #[test]
        fn display_from_str_roundtrip(policy in policy_strategy(64)) {
            let all = NodeSet::from_nodes(0..64).unwrap();
            let c = NodeContext::new(64, all);
            prop_assert_eq!(MemPolicy::parse_in(&policy.to_string(), &c).unwrap(), policy);
            // The literal reading (serde's) agrees, without any context.
            prop_assert_eq!(
                MemPolicy::parse_with(&policy.to_string(), NodeSet::parse_literal).unwrap(),
                policy
            );
        }

        #[test]
        fn parse_never_panics(input in "[a-z (),:!+0-9-]{0,24}") {
            let _ = MemPolicy::parse_in(&input, &NodeContext::new(4, NodeSet::from_nodes(0..4).unwrap()));
        }
    }
}
