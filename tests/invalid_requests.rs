//! An invalid request is the same error in every environment (issue 19 §6): unknown flag
//! bits, mode flags the kernel refuses, and nodes that do not exist (5 and 1023 exist
//! neither on a one-node host nor in the four-node VM) are refused before any call, so
//! that the answer does not depend on whether the kernel was reached. Before, a seccomp
//! profile (`EPERM`) or a kernel without NUMA (`ENOSYS`) answered first and the request
//! came back `Ok(Degraded)`; in a user namespace `migrate_pages` to a node that does not
//! exist came back as a missing `CAP_SYS_NICE`.
//!
//! Every assertion here holds unchanged in every environment: no branch on
//! `NUMAPIN_EXPECT`. The messages are compared whole, against the machine's own figures.

mod common;

use numapin::policy::set_thread_policy_with;
use numapin::{Error, Node, NodeSet, Region, migrate_process, possible_node_count};

use numapin::policy::{MbindFlags, MemPolicy, ModeFlags};

fn page() -> usize {
    numapin::page_size()
}

/// Node ids no test machine has: the host has one node, the VM four (0-3).
fn missing_nodes() -> [Node; 2] {
    let possible = possible_node_count();
    assert!(
        possible <= 5,
        "this suite assumes node 5 does not exist: {possible} possible"
    );
    [Node(5), Node(1023)]
}

/// What the errors say about this machine's nodes.
fn machine() -> String {
    let possible = possible_node_count();
    let memory = match std::fs::read_to_string("/sys/devices/system/node/has_memory") {
        Ok(text) => NodeSet::parse_in(
            text.trim(),
            &numapin::NodeContext::new(possible, NodeSet::new()),
        )
        .unwrap()
        .to_string(),
        Err(_) => "0 (no NUMA sysfs)".to_string(),
    };
    format!(
        "{possible} possible node id(s) (0-{}); nodes with memory: {memory}",
        possible - 1
    )
}

fn invalid(result: numapin::Result<impl std::fmt::Debug>) -> (&'static str, String) {
    match result {
        Err(Error::InvalidArgument { op, reason }) => (op, reason.to_string()),
        other => panic!("expected an invalid-argument error, got {other:?}"),
    }
}

fn allowed() -> NodeSet {
    common::nodes()
}

/// Unknown `mbind` flag bits (`0x80`; `0x8`, the kernel's unsupported `MPOL_MF_LAZY`) are
/// refused naming the bits, through `bind`, `bind_with`, `bind_part` and `bind_range`.
/// Before: `EINVAL` from the kernel where it was reached, `Ok(Degraded)` elsewhere.
#[test]
fn unknown_mbind_flags_are_an_error_everywhere() {
    let r = Region::anonymous(2 * page()).unwrap();
    let p = MemPolicy::Bind(allowed());
    for bits in [0x80, 0x8, 0x80 | MbindFlags::MOVE.bits()] {
        let flags = MbindFlags::from_bits_retain(bits);
        let unknown = bits & !0x7;
        let want = format!(
            "flags {bits:#x}: bit(s) {unknown:#x} are no mbind flag the kernel accepts \
             (MPOL_MF_STRICT, MPOL_MF_MOVE, MPOL_MF_MOVE_ALL are 0x1, 0x2, 0x4)"
        );
        assert_eq!(invalid(r.bind(&p, flags)), ("mbind", want.clone()));
        assert_eq!(
            invalid(r.bind_with(&p, ModeFlags::empty(), flags)),
            ("mbind", want.clone())
        );
        assert_eq!(
            invalid(r.bind_part(0..page(), &p, flags)),
            ("mbind", want.clone())
        );
        // SAFETY: our own region; the request is refused before any call.
        let range = unsafe { numapin::bind_range(r.as_ptr(), page(), &p, flags) };
        assert_eq!(invalid(range), ("mbind", want));
    }
}

/// Mode flags the kernel refuses whatever the nodes, through `bind_with` and
/// `set_thread_policy_with` (on a thread of its own: the refused calls must not change
/// its policy, and nothing else shares it).
#[test]
fn invalid_mode_flags_are_an_error_everywhere() {
    let nodes = allowed();
    let bind = MemPolicy::Bind(nodes);
    let interleave = MemPolicy::Interleave(nodes);
    let cases = [
        (
            bind,
            ModeFlags::from_bits_retain(1 << 12),
            "bit(s) 0x1000 are no mode flag the kernel knows (MPOL_F_STATIC_NODES, \
             MPOL_F_RELATIVE_NODES, MPOL_F_NUMA_BALANCING are 0x8000, 0x4000, 0x2000)"
                .to_string(),
        ),
        (
            bind,
            ModeFlags::STATIC_NODES | ModeFlags::RELATIVE_NODES,
            "STATIC_NODES and RELATIVE_NODES exclude each other".to_string(),
        ),
        (
            interleave,
            ModeFlags::NUMA_BALANCING,
            "NUMA_BALANCING applies to bind (and prefer (many)) only, not to interleave"
                .to_string(),
        ),
        (
            MemPolicy::Local,
            ModeFlags::STATIC_NODES,
            "local allocation has no nodes to keep static or relative".to_string(),
        ),
    ];
    let r = Region::anonymous(page()).unwrap();
    std::thread::spawn(move || {
        for (policy, flags, why) in cases {
            let want = |op| {
                (
                    op,
                    format!("policy {policy} with mode flags {flags:?}: {why}"),
                )
            };
            assert_eq!(
                invalid(r.bind_with(&policy, flags, MbindFlags::empty())),
                want("mbind")
            );
            assert_eq!(
                invalid(set_thread_policy_with(&policy, flags)),
                want("set_mempolicy")
            );
        }
    })
    .join()
    .unwrap();
}

/// `bind`, `set_mempolicy` and `Region::migrate` to nodes that do not exist: the same
/// error, naming the node and the machine's nodes. `migrate` used to ask for placement
/// first and so answered `Ok(Degraded)` where `move_pages` is denied or unsupported.
#[test]
fn policies_on_nodes_that_do_not_exist_are_an_error_everywhere() {
    let r = Region::anonymous(page()).unwrap();
    for node in missing_nodes() {
        let set: NodeSet = std::iter::once(node).collect();
        let mixed = allowed().union(&set);
        for policy in [
            MemPolicy::Bind(set),
            MemPolicy::Bind(mixed),
            MemPolicy::Preferred(node),
            MemPolicy::Interleave(mixed),
        ] {
            let want = (
                "MemPolicy",
                format!(
                    "{policy}: node {node} does not exist on this machine, whose kernel has {}",
                    machine()
                ),
            );
            assert_eq!(invalid(r.bind(&policy, MbindFlags::empty())), want);
            let p = policy;
            let thread =
                std::thread::spawn(move || invalid(set_thread_policy_with(&p, ModeFlags::empty())));
            assert_eq!(thread.join().unwrap(), want);
        }
        let want = (
            "MemPolicy",
            format!(
                "bind:{set}: node {node} does not exist on this machine, whose kernel has {}",
                machine()
            ),
        );
        assert_eq!(invalid(r.migrate(&set)), want);
    }
}

/// `move_pages_to` a node that does not exist: refused before the call, naming it. Before:
/// the kernel's `ENODEV` where it was reached, `Ok(Degraded)` elsewhere.
#[test]
fn move_pages_to_a_node_that_does_not_exist_is_an_error_everywhere() {
    let mut r = Region::anonymous(4 * page()).unwrap();
    r.as_mut_slice().unwrap().fill(7);
    for node in missing_nodes().into_iter().chain([Node(4096)]) {
        let want = (
            "move_pages",
            format!(
                "target: node {node} does not exist on this machine, whose kernel has {}",
                machine()
            ),
        );
        assert_eq!(invalid(r.move_pages_to(node)), want);
    }
    assert!(r.as_slice().iter().all(|&b| b == 7));
}

/// `migrate_process` from or to nodes that do not exist: refused naming the node, never a
/// missing `CAP_SYS_NICE` (the capability would not make the node exist) and never
/// `Ok(Degraded)`. The pid is checked after the nodes, so a live one and a dead one
/// answer alike.
#[test]
fn migrate_process_with_nodes_that_do_not_exist_is_an_error_everywhere() {
    let nodes = allowed();
    for node in missing_nodes() {
        let set: NodeSet = std::iter::once(node).collect();
        let mixed = nodes.union(&set);
        for pid in [0, i32::MAX] {
            let want_to = |to: &NodeSet| {
                (
                    "migrate_pages",
                    format!(
                        "to {{{to}}}: node {node} does not exist on this machine, whose kernel has {}",
                        machine()
                    ),
                )
            };
            assert_eq!(invalid(migrate_process(pid, &nodes, &set)), want_to(&set));
            assert_eq!(
                invalid(migrate_process(pid, &nodes, &mixed)),
                want_to(&mixed)
            );
            let want_from = (
                "migrate_pages",
                format!(
                    "from {{{set}}}: node {node} does not exist on this machine, whose kernel has {}",
                    machine()
                ),
            );
            assert_eq!(invalid(migrate_process(pid, &set, &nodes)), want_from);
        }
    }
}

/// `StagingPool::bound` to a node that does not exist: refused naming it. Before, an id
/// past `MAX_NODES` (4096) fell out of the one-node set, which was then refused as an
/// empty `bind` policy; 5 and 1023 came back `Degraded` where `mbind` is denied.
#[test]
fn staging_bound_to_a_node_that_does_not_exist_is_an_error_everywhere() {
    for node in missing_nodes().into_iter().chain([Node(4096)]) {
        let want = (
            "StagingPool::new",
            format!(
                "node: node {node} does not exist on this machine, whose kernel has {}",
                machine()
            ),
        );
        assert_eq!(
            invalid(numapin::cache::StagingPool::bound(2, 4096, node)),
            want
        );
    }
}

/// A node that exists but that this process may not allocate on (the VM's memoryless
/// node 3; a node outside the cpuset): `NodeNotAllowed` before the call, for a policy
/// naming only such nodes, `move_pages_to` it, and `migrate_process` to it alone. Where
/// every possible node is allowed (the one-node host) there is no such node.
#[test]
fn nodes_this_process_may_not_use_are_refused_before_the_call() {
    let nodes = allowed();
    let Some(node) = (0..possible_node_count() as u16)
        .map(Node)
        .find(|n| !nodes.contains(*n))
    else {
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "NOT RUN: nodes_this_process_may_not_use_are_refused_before_the_call needs a \
             possible node that is not allowed (a memoryless one); all {} are allowed here",
            possible_node_count()
        );
        return;
    };
    let set: NodeSet = std::iter::once(node).collect();
    let not_allowed = |op: &'static str, result: numapin::Result<()>| match result {
        Err(Error::NodeNotAllowed {
            op: got,
            node: n,
            allowed,
        }) => {
            assert_eq!((got, n, *allowed), (op, node, nodes));
        }
        other => panic!("{op} to node {node}: {other:?}"),
    };
    let mut r = Region::anonymous(page()).unwrap();
    for policy in [MemPolicy::Bind(set), MemPolicy::Preferred(node)] {
        not_allowed("mbind", r.bind(&policy, MbindFlags::empty()).map(drop));
    }
    r.as_mut_slice().unwrap().fill(1);
    not_allowed("move_pages", r.move_pages_to(node).map(drop));
    not_allowed("migrate_pages", migrate_process(0, &nodes, &set).map(drop));
}
