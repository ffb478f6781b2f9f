//! What a request must be before any NUMA call is made: the policy's shape and nodes,
//! its mode flags, `mbind`'s flags, the nodes pages are moved to.
//!
//! Checked before the call in every environment, so that an invalid request gets the
//! same error whether the kernel would have judged it (`EINVAL`, `ENODEV`, ...) or a
//! seccomp profile (`EPERM`) or a kernel without NUMA (`ENOSYS`) answers first, which
//! [`degrade_or_error`](crate::calls::degrade_or_error) turns into a degradation: a
//! request the kernel would refuse must never come back as
//! [`Placement::Degraded`](super::Placement::Degraded).

use std::fmt;

use numapin_sys as sys;

use super::{MbindFlags, MemPolicy, ModeFlags};
use crate::error::{Error, Result};
use crate::node::{MAX_NODES, Node, NodeSet, nodes_with_memory, possible_node_count};

impl MemPolicy {
    /// Checks the policy's shape, whatever machine it runs on: what the kernel would
    /// reject with a bare `EINVAL` (or, worse, silently reinterpret), naming the node.
    /// [`MemPolicy::validate_here`] also checks the node ids against this machine.
    ///
    /// # Errors
    /// A node-set policy with an empty set, or a node id at or beyond [`MAX_NODES`]
    /// (`Preferred(Node(1024))` would otherwise become an empty mask, which the kernel
    /// reads as local allocation).
    ///
    /// # Example
    /// ```
    /// use numapin::Node;
    /// use numapin::policy::MemPolicy;
    /// assert!(MemPolicy::Preferred(Node(4096)).validate().is_err());
    /// assert!(MemPolicy::Preferred(Node(0)).validate().is_ok());
    /// ```
    pub fn validate(&self) -> Result<()> {
        match self {
            MemPolicy::PreferredMany(s)
            | MemPolicy::Bind(s)
            | MemPolicy::Interleave(s)
            | MemPolicy::WeightedInterleave(s)
                if s.is_empty() =>
            {
                return Err(Error::empty(
                    "MemPolicy",
                    format!("nodes for {}, which needs at least one", self.name()),
                ));
            }
            _ => {}
        }
        if let MemPolicy::Preferred(node) = self
            && node.index() >= MAX_NODES
        {
            return Err(Error::no_such_node(
                "MemPolicy",
                self.name(),
                node.index(),
                MAX_NODES,
                None,
            ));
        }
        Ok(())
    }

    /// [`MemPolicy::validate`], then every node id against this machine's possible nodes
    /// ([`possible_node_count`]): `Bind({7})` on a one-node machine is refused naming node
    /// 7, instead of the kernel's `EINVAL` with four possible causes. Every call that
    /// hands a policy to the kernel checks this first.
    ///
    /// # Errors
    /// As [`MemPolicy::validate`], or a node this machine cannot have; the message names
    /// the machine's possible node ids and its nodes with memory.
    pub fn validate_here(&self) -> Result<()> {
        self.validate()?;
        check_exist("MemPolicy", self, self.nodes().iter())
    }
}

/// The machine's nodes, for messages: its possible node ids and its nodes with memory.
fn machine_nodes() -> String {
    let possible = possible_node_count();
    let memory = match nodes_with_memory() {
        Ok(Some(set)) => set.to_string(),
        Ok(None) => "0 (no NUMA sysfs)".to_string(),
        Err(e) => format!("unknown ({e})"),
    };
    format!(
        "{possible} possible node id(s) (0-{}); nodes with memory: {memory}",
        possible - 1
    )
}

/// Every node of `nodes` is an id this machine can have (below [`possible_node_count`]).
///
/// # Errors
/// [`Error::InvalidArgument`] naming `what`, the first node that cannot exist, and the
/// machine's nodes.
pub(crate) fn check_exist(
    op: &'static str,
    what: impl fmt::Display,
    nodes: impl IntoIterator<Item = Node>,
) -> Result<()> {
    let possible = possible_node_count();
    match nodes.into_iter().find(|n| n.index() >= possible) {
        None => Ok(()),
        Some(node) => Err(Error::no_such_node(
            op,
            what.to_string(),
            node.index(),
            possible,
            Some(machine_nodes()),
        )),
    }
}

/// The mode flags the kernel knows (`MPOL_MODE_FLAGS`); `ModeFlags` keeps unknown bits.
const KNOWN_MODE_FLAGS: i32 = sys::MPOL_MODE_FLAGS;

/// Mode flags the kernel refuses with `EINVAL` whatever the nodes (`sanitize_mpol_flags`
/// and `mpol_new` in mm/mempolicy.c): a bit it does not know, `STATIC_NODES` with
/// `RELATIVE_NODES`, `NUMA_BALANCING` with a mode other than `Bind` (and
/// `PreferredMany`, accepted since Linux 6.9), `STATIC_NODES` or `RELATIVE_NODES` with
/// `Local`.
///
/// # Errors
/// [`Error::InvalidArgument`] naming the flags and the policy.
pub(crate) fn check_mode_flags(
    op: &'static str,
    policy: &MemPolicy,
    flags: ModeFlags,
) -> Result<()> {
    let refuse = |why: String| {
        Err(Error::bad_value(
            op,
            "policy",
            format_args!("{policy} with mode flags {flags:?}"),
            why,
        ))
    };
    let unknown = flags.bits() & !KNOWN_MODE_FLAGS;
    if unknown != 0 {
        return refuse(format!(
            "bit(s) {unknown:#x} are no mode flag the kernel knows (MPOL_F_STATIC_NODES, \
             MPOL_F_RELATIVE_NODES, MPOL_F_NUMA_BALANCING are {:#x}, {:#x}, {:#x})",
            sys::MPOL_F_STATIC_NODES,
            sys::MPOL_F_RELATIVE_NODES,
            sys::MPOL_F_NUMA_BALANCING
        ));
    }
    let remap = ModeFlags::STATIC_NODES | ModeFlags::RELATIVE_NODES;
    if flags.contains(remap) {
        return refuse("STATIC_NODES and RELATIVE_NODES exclude each other".to_string());
    }
    if flags.contains(ModeFlags::NUMA_BALANCING)
        && !matches!(policy, MemPolicy::Bind(_) | MemPolicy::PreferredMany(_))
    {
        return refuse(format!(
            "NUMA_BALANCING applies to bind (and prefer (many)) only, not to {}",
            policy.name()
        ));
    }
    if flags.intersects(remap) && *policy == MemPolicy::Local {
        return refuse("local allocation has no nodes to keep static or relative".to_string());
    }
    Ok(())
}

/// `mbind` flags the kernel refuses with `EINVAL`: any bit outside `MPOL_MF_VALID`
/// (`STRICT`, `MOVE`, `MOVE_ALL`).
///
/// # Errors
/// [`Error::InvalidArgument`] naming the flags and the unknown bits.
pub(crate) fn check_mbind_flags(flags: MbindFlags) -> Result<()> {
    let unknown = flags.bits() & !sys::MPOL_MF_VALID;
    if unknown == 0 {
        return Ok(());
    }
    Err(Error::bad_value(
        "mbind",
        "flags",
        format_args!("{:#x}", flags.bits()),
        format!(
            "bit(s) {unknown:#x} are no mbind flag the kernel accepts \
             (MPOL_MF_STRICT, MPOL_MF_MOVE, MPOL_MF_MOVE_ALL are {:#x}, {:#x}, {:#x})",
            sys::MPOL_MF_STRICT,
            sys::MPOL_MF_MOVE,
            sys::MPOL_MF_MOVE_ALL
        ),
    ))
}

/// Everything checked before a policy reaches `mbind` or `set_mempolicy`: the policy's
/// shape and node ids ([`MemPolicy::validate_here`]), its mode flags, and that it names a
/// node this process may allocate on.
///
/// # Errors
/// As [`MemPolicy::validate_here`] and [`check_mode_flags`], or
/// [`Error::NodeNotAllowed`].
pub(crate) fn check_policy_call(
    op: &'static str,
    policy: &MemPolicy,
    flags: ModeFlags,
) -> Result<()> {
    policy.validate_here()?;
    check_mode_flags(op, policy, flags)?;
    // Where the call reaches the kernel, its EINVAL for a set without an allowed node
    // becomes the same error after the call (`not_allowed` there); reading the allowed
    // nodes costs two file reads (~25 µs, the whole cost of a bind), so it is done up
    // front only where the kernel will not answer (EPERM, ENOSYS).
    if crate::calls::mempolicy_support().ok() == Some(crate::calls::MempolicySupport::Available) {
        return Ok(());
    }
    match not_allowed(op, policy, flags) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// A node `move_pages` moves pages to: an id this machine can have, and a node with
/// memory this process may allocate on (else the kernel answers `ENODEV` or `EACCES`).
///
/// # Errors
/// As [`check_exist`], or [`Error::NodeNotAllowed`] naming the node and the allowed ones.
pub(crate) fn check_move_target(op: &'static str, node: Node) -> Result<()> {
    // The node itself, not a set of it: a `NodeSet` cannot hold an id past MAX_NODES.
    check_exist(op, "target", [node])?;
    let allowed = NodeSet::allowed()?;
    if allowed.contains(node) {
        return Ok(());
    }
    Err(Error::NodeNotAllowed {
        op,
        node,
        allowed: Box::new(allowed),
    })
}

/// The node sets of `migrate_pages`: ids this machine can have, and a target set that
/// keeps a node once the kernel has cut it down to the caller's allowed nodes with memory
/// (an empty remainder is its `EINVAL`, or `EPERM` without `CAP_SYS_NICE`, which that
/// capability would not cure).
///
/// # Errors
/// As [`check_exist`], or [`Error::NodeNotAllowed`] naming the first target node and the
/// allowed ones.
pub(crate) fn check_migrate_nodes(op: &'static str, from: &NodeSet, to: &NodeSet) -> Result<()> {
    check_exist(op, format_args!("from {{{from}}}"), from.iter())?;
    check_exist(op, format_args!("to {{{to}}}"), to.iter())?;
    let allowed = NodeSet::allowed()?;
    match to.iter().next() {
        Some(node) if to.intersection(&allowed).is_empty() => Err(Error::NodeNotAllowed {
            op,
            node,
            allowed: Box::new(allowed),
        }),
        _ => Ok(()),
    }
}

/// A policy none of whose nodes this process may allocate on (outside `mems_allowed`, or
/// without memory, like the VM's memoryless node 3): the kernel's `EINVAL` (its
/// `mpol_set_nodemask` keeps only allowed nodes with memory, and an empty remainder is
/// refused). Checked before the call ([`check_policy_call`]) and again after an `EINVAL`
/// (the cpuset may have changed in between). Mode flags that reinterpret the set
/// (`STATIC_NODES`, `RELATIVE_NODES`) are left to the kernel's answer.
pub(crate) fn not_allowed(op: &'static str, policy: &MemPolicy, flags: ModeFlags) -> Option<Error> {
    if flags.intersects(ModeFlags::STATIC_NODES | ModeFlags::RELATIVE_NODES) {
        return None;
    }
    let set = match policy {
        MemPolicy::Default | MemPolicy::Local => return None,
        MemPolicy::Preferred(node) => std::iter::once(*node).collect(),
        MemPolicy::Bind(set)
        | MemPolicy::Interleave(set)
        | MemPolicy::WeightedInterleave(set)
        | MemPolicy::PreferredMany(set) => *set,
    };
    let allowed = NodeSet::allowed().ok()?;
    if !set.intersection(&allowed).is_empty() {
        return None;
    }
    Some(Error::NodeNotAllowed {
        op,
        node: set.iter().next()?,
        allowed: Box::new(allowed),
    })
}
